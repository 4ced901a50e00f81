"""`Backend`: where a program runs, decided once where the program is built and carried
explicitly down to the layers.

A program is built for a platform ("cpu", "gpu", "tpu": the devices it runs on, which
need not be this host's: aot.py compiles for a TPU or a GPU here), on one device or split
over a mesh, and its attention either may take that platform's kernels (where the model
asks: Model.attention) or must take the portable jnp path. `generate`, the engine's
programs and aot.py build a Backend from where their arguments live and bind it to the
models (`Model.on`, `Drafter.on`); the layers read it from there (transformer.View) and
ask nothing ambient, so a program traced here for another platform is by construction the
program that platform runs. A static value: part of every program's jit key.

It knows no kernels (models/attention.py chooses among them) and no models.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class Backend:
    platform: str  # "cpu", "gpu" or "tpu" ("cuda" and "rocm" are read as "gpu")
    mesh: Mesh | None = None  # the mesh a sharded program runs on; None: one device
    portable: bool = False  # True: attention takes the jnp path whatever the model asks

    def __post_init__(self):
        platform = "gpu" if self.platform in ("cuda", "rocm") else self.platform
        if platform not in PLATFORMS:
            raise ValueError(f"a backend's platform must be one of {', '.join(PLATFORMS)}, got {self.platform!r}")
        object.__setattr__(self, "platform", platform)

    @classmethod
    def default(cls) -> "Backend":
        """The default backend's devices, unsharded: what a model not bound to a backend
        (`Model.on`) is traced for, as `jax.jit` of it would run."""
        return cls(jax.default_backend())

    @classmethod
    def of(cls, tree, mesh: Mesh | None = None, portable: bool = False) -> "Backend":
        """The backend of a call on `mesh` (its devices' platform), else of the devices the
        arrays of `tree` (or shape structs with a sharding) are placed on, else the default."""
        if mesh is not None:
            return cls(mesh.devices.flat[0].platform, mesh, portable)
        for leaf in jax.tree.leaves(tree):
            placed = getattr(leaf, "sharding", None)
            if placed is not None:
                return cls(next(iter(placed.device_set)).platform, None, portable)
        return cls(jax.default_backend(), None, portable)

    @property
    def consecutive_writes(self) -> bool:
        """Whether a pass writes its cache entries as one slice per row (`cache.write`'s
        consecutive form) rather than one scatter: a TPU's, on one device (around a scatter
        its XLA copies the whole buffer; a sharded program's rows were not compared)."""
        return self.platform == "tpu" and self.mesh is None and not self.portable
