"""What trained drafters (Medusa heads, EAGLE) share: the record of the target they were
trained for, and their files — `drafter.save(path)` writes `drafter.safetensors` (the
weights, float32) and `drafter.json` (what kind of drafter, its shape, its target), and
`load_drafter(path)` reads them back.

Trained drafters read the target's own weights (its embedding, its head) and hidden
states, so using one with a target of another shape is refused before anything is traced.
This module knows files and shapes; how each drafter drafts lives in medusa.py / eagle.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from specjax.models import Model

# 2: EAGLE's layer in the per-layer model layout (fused qkv and gate_up kernels). Format 1
# files (separate q/k/v and gate/up kernels) still load: `from_record` converts them.
FORMAT = 2
READABLE_FORMATS = (1, 2)
WEIGHTS, RECORD = "drafter.safetensors", "drafter.json"


@dataclasses.dataclass(frozen=True)
class TargetSignature:
    """What a trained drafter needs of its target: the hidden states it reads, the
    vocabulary it speaks. Frozen, so it is a static (hashable) field of a drafter."""

    model_type: str
    hidden_size: int
    vocab_size: int
    name: str = ""  # where the target came from, when known (informative only)

    @classmethod
    def of(cls, target: Model, name: str = "") -> "TargetSignature":
        c = target.config
        return cls(c.model_type, c.hidden_size, c.vocab_size, name)

    def check(self, target: Model, drafter: str):
        """Raises unless target has the shape this drafter was trained for."""
        mine = dataclasses.replace(self, name="")
        theirs = dataclasses.replace(TargetSignature.of(target), name="")
        if mine != theirs:
            diff = ", ".join(f"{f.name} {getattr(mine, f.name)!r} != {getattr(theirs, f.name)!r}"
                             for f in dataclasses.fields(mine) if getattr(mine, f.name) != getattr(theirs, f.name))
            raise ValueError(f"this {drafter} drafter was made for another target "
                             f"({self.name or 'unnamed'}): {diff} (drafter's vs target's)")


def flatten(params, prefix: str = "") -> dict[str, np.ndarray]:
    """{"a": {"b": x}, "c": [y]} -> {"a.b": float32 numpy x, "c.0": y}."""
    out = {}
    items = enumerate(params) if isinstance(params, (list, tuple)) else params.items()
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, (dict, list, tuple)):
            out.update(flatten(value, name + "."))
        else:
            out[name] = np.asarray(jax.device_get(value), np.float32)
    return out


def unflatten(tensors: dict[str, np.ndarray]) -> dict:
    out: dict = {}
    for name, value in tensors.items():
        *path, last = name.split(".")
        node = out
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return out


def save(path, kind: str, params: dict, signature: TargetSignature, extra: dict) -> Path:
    from safetensors.numpy import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(flatten(params), str(folder / WEIGHTS))
    record = {"format": FORMAT, "kind": kind, "target": dataclasses.asdict(signature), **extra}
    (folder / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return folder


def load_drafter(path, tree=None):
    """A trained drafter saved with `drafter.save(path)`: a `specjax.Medusa` or a
    `specjax.Eagle`, drafting `tree` (None: a chain). Its weights are float32 on the default
    device; they take the target's dtype when used."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    from specjax.drafters.eagle import Eagle
    from specjax.drafters.medusa import Medusa
    from specjax.hf import CheckpointError

    folder = Path(path)
    missing = [n for n in (RECORD, WEIGHTS) if not (folder / n).is_file()]
    if missing:
        raise CheckpointError(f"{folder} is not a saved drafter: {', '.join(missing)} missing")
    try:
        record = json.loads((folder / RECORD).read_text())
        signature = TargetSignature(**record["target"])
        kind = record["kind"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{folder / RECORD} is not a drafter record ({e})") from None
    if record.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"{folder / RECORD}: format {record.get('format')!r}, expected one of "
                              f"{READABLE_FORMATS}")
    try:
        params = unflatten(load_file(str(folder / WEIGHTS)))
        # On the device once, not copied from the host by every generate call.
        params = jax.tree.map(jax.device_put, params)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{folder / WEIGHTS} cannot be read: {e}") from None
    kinds = {"medusa": Medusa, "eagle": Eagle}
    if kind not in kinds:
        raise CheckpointError(f"{folder / RECORD}: unknown drafter kind {kind!r}; specjax has {sorted(kinds)}")
    return kinds[kind].from_record(params, record, signature, tree)
