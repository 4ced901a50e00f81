"""`load_drafter`: a trained drafter's folder (drafter.json + drafter.safetensors) read back
as the drafter its record names. It dispatches on the record's kind; the file format and its
checks live in trained.py, each drafter's own reading in medusa.py / eagle.py."""

from __future__ import annotations

from pathlib import Path

import jax

from specjax.drafters.eagle import Eagle
from specjax.drafters.eagle3 import Eagle3
from specjax.drafters.medusa import Medusa
from specjax.drafters.trained import READABLE_FORMATS, RECORD, WEIGHTS, read_params, read_signature
from specjax.hf import CheckpointError, _read_json, check_regular


def load_drafter(path, tree=None):
    """A trained drafter saved with `drafter.save(path)`: a `specjax.Medusa`, `specjax.Eagle`
    or `specjax.Eagle3`, drafting `tree` (None: a chain). Its weights are float32 on the default
    device; they take the target's dtype when used. Bad files raise CheckpointError."""
    folder = Path(path)
    record_file, weights_file = folder / RECORD, folder / WEIGHTS
    for file in (record_file, weights_file) if folder.is_dir() else ():
        check_regular(file)  # a FIFO or a dangling link is refused as such, not read or called missing
    missing = [f.name for f in (record_file, weights_file) if not f.is_file()]
    if missing:
        raise CheckpointError(f"{folder} is not a saved drafter: {', '.join(missing)} missing")
    record = _read_json(record_file)
    version, kind = record.get("format"), record.get("kind")
    if type(version) is not int or version not in READABLE_FORMATS:
        raise CheckpointError(f"{record_file}: format {version!r}, expected one of {READABLE_FORMATS}")
    kinds = {"medusa": Medusa, "eagle": Eagle, "eagle3": Eagle3}
    if not isinstance(kind, str) or kind not in kinds:
        raise CheckpointError(f"{record_file}: unknown drafter kind {kind!r}; specjax has {sorted(kinds)}")
    signature = read_signature(record.get("target"), record_file)
    # On the device once, not copied from the host by every generate call.
    params = jax.tree.map(jax.device_put, read_params(weights_file))
    return kinds[kind].from_record(params, record, signature, tree, folder)
