"""What trained drafters (Medusa heads, EAGLE) share: the record of the target they were
trained for, and their files — `drafter.save(path)` writes `drafter.safetensors` (the
weights, float32) and `drafter.json` (what kind of drafter, its shape, its target), and
`drafters/load.py`'s `load_drafter(path)` reads them back (through `read_signature` and
`read_params` here).

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

# 3: EAGLE's layer in the model's layout (layouts.py: qkv_kernel [G, R+2, D, E], gate_up_kernel
# [2, E, F]). Format 2 (those kernels [E, G, R+2, D] and [E, 2, F]) and format 1 (q/k/v and
# gate/up kernels apart) still load: the drafters' `from_record` converts them.
FORMAT = 3
READABLE_FORMATS = (1, 2, 3)
WEIGHTS, RECORD = "drafter.safetensors", "drafter.json"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # the safetensors dtypes a drafter's tensors may have


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
        """Raises unless target has the shape this drafter was trained for (where the record
        leaves model_type or vocab_size unknown, "" or 0 - a published head's files may not
        say them - any)."""
        c = target.config
        mine = dataclasses.replace(self, name="")
        theirs = TargetSignature(self.model_type and c.model_type, c.hidden_size, self.vocab_size and c.vocab_size)
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
    """flatten's inverse; a tensor named as if inside another ("a" and "a.b") raises ValueError."""
    for name in tensors:
        outer = [o for o in (name.rsplit(".", n)[0] for n in range(1, name.count(".") + 1)) if o in tensors]
        if outer:
            raise ValueError(f"tensor {name} is named as if inside tensor {outer[0]}")
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


def positive_int(value) -> bool:
    """Whether value (read from a file) is an int >= 1; bools and floats are not."""
    return type(value) is int and value >= 1


def read_signature(target, record_file: Path) -> TargetSignature:
    """The record's "target", refused unless it holds a model_type, a hidden_size, a
    vocab_size and (optionally) a name of the right types."""
    from specjax.hf import CheckpointError

    try:
        signature = TargetSignature(**target)
    except TypeError as e:  # not an object, or a key missing or unknown
        raise CheckpointError(f"{record_file}: \"target\" is not a target's record ({e})") from None
    if not (isinstance(signature.model_type, str) and isinstance(signature.name, str)
            and positive_int(signature.hidden_size) and positive_int(signature.vocab_size)):
        raise CheckpointError(f"{record_file}: \"target\" needs text model_type and name and positive integer "
                              f"hidden_size and vocab_size, got {target!r}")
    return signature


def read_params(weights_file: Path) -> dict:
    """drafter.safetensors' tensors as nested params, refused unless each is floating point
    and finite and their names nest."""
    from safetensors import SafetensorError, safe_open

    from specjax.hf import CheckpointError, check_finite

    tensors = {}
    try:
        with safe_open(str(weights_file), "np") as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                if dtype not in FLOAT_DTYPES:
                    raise CheckpointError(f"{weights_file}: tensor {name} is {dtype}, not a floating-point "
                                          f"type ({', '.join(FLOAT_DTYPES)})")
                tensors[name] = f.get_tensor(name)
                check_finite(tensors[name], f"{weights_file}: tensor {name}")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights_file} cannot be read: {e}") from None
    try:
        return unflatten(tensors)
    except ValueError as e:
        raise CheckpointError(f"{weights_file}: {e}") from None
