"""`load_drafter`: a trained drafter's folder (drafter.json + drafter.safetensors) read back
as the drafter its record names, a published EAGLE-3 head's as a `PublishedEagle3`, a
target's folder that ships multi-token-prediction layers as an `Mtp`, or a draft model's
folder as a `DraftModel` (with its saved vocabulary); a hub id's the same. It
dispatches on the record's kind; the file formats and their checks live in trained.py and
formats.py, each drafter's own reading in medusa.py / eagle.py, a draft model's in model.py."""

from __future__ import annotations

from pathlib import Path

import jax

from specjax.drafters.eagle import Eagle
from specjax.drafters.eagle3 import Eagle3
from specjax.drafters.medusa import Medusa
from specjax.drafters.formats import published_format, read_published
from specjax.drafters.model import DraftModel
from specjax.drafters.mtp import Mtp
from specjax.drafters.trained import READABLE_FORMATS, RECORD, WEIGHTS, read_params, read_signature
from specjax.folders import HUB_PATTERNS, _is_hub_id, resolve
from specjax.hf import CheckpointError, _read_json, check_regular


def load_drafter(path, tree=None, mtp: bool | None = None, **model_kwargs):
    """The drafter saved in a folder (or a hub id's), drafting `tree` (None: a chain). Bad
    files raise CheckpointError.

    - A target's own folder whose config.json declares multi-token-prediction layers
      (num_nextn_predict_layers > 0: DeepSeek-V3/R1, Kimi-K2, GLM-4.5, or one `specjax
      train-mtp` wrote): its MTP layer, a `specjax.Mtp` (`Mtp.load`; dtype= the one
      model_kwargs it takes; a folder of several MTP layers: `Mtp.load(path, layer=k)`).
      mtp=True asks for that (and says so where the folder has none); mtp=False reads such
      a folder as a draft model instead; None (the default): the MTP layer where declared.

    - Trained heads saved with `drafter.save(path)` (drafter.json + drafter.safetensors): a
      `specjax.Medusa`, `specjax.Eagle` or `specjax.Eagle3`. Their weights are float32 on
      the default device; they take the target's dtype when used.
    - A published head's folder, computing as its authors' code does (drafters/formats.py):
      an EAGLE-3 head as SafeAILab/EAGLE, SpecForge or Red Hat's speculators write it
      (config.json and model.safetensors or pytorch_model.bin; e.g. the hub's
      yuhuili/EAGLE3-LLaMA3.1-Instruct-8B or RedHatAI/*.eagle3): a `PublishedEagle3`; an
      EAGLE-1/2 head (SafeAILab/EAGLE's): a `PublishedEagle`; FasterDecoding's Medusa heads
      (medusa_lm_head.safetensors or .pt): a `Medusa`.
    - A draft model's Hugging Face folder (config.json + *.safetensors, e.g. the shipped
      checkpoints/draft): `DraftModel.load(path, tree, **model_kwargs)`, which drafts from
      the vocabulary saved beside it (draft_vocab.json, written by `specjax distill
      --draft-vocab`), as `specjax generate --draft` does; model_kwargs are load_model's
      (dtype, quantize, attention, ...). `specjax.load_model(path)` given as a draft drafts
      from the model's whole vocabulary instead (slower where the head is a large share of a
      draft step)."""
    folder = drafter_folder(path)
    if mtp or (mtp is None and folder.is_dir() and not _exists(folder / RECORD) and declares_mtp(folder)):
        extra = sorted(set(model_kwargs) - {"dtype"})
        if extra:
            raise TypeError(f"load_drafter: {', '.join(extra)} apply to a draft model's folder; {folder}'s MTP layer "
                            f"takes dtype= alone")
        return Mtp.load(folder, tree, **model_kwargs)
    if folder.is_dir() and not _exists(folder / RECORD) and (folder / "config.json").exists():
        if published_format(folder) is not None:
            if model_kwargs:
                raise TypeError(f"load_drafter: {', '.join(sorted(model_kwargs))} apply to a draft model's folder "
                                f"(load_model's arguments); {folder} holds a published head")
            return read_published(folder, tree)
        return DraftModel.load(folder, tree, **model_kwargs)
    if model_kwargs:
        raise TypeError(f"load_drafter: {', '.join(sorted(model_kwargs))} apply to a draft model's folder "
                        f"(load_model's arguments); {folder} is not one")
    return _load_trained(folder, tree)


def declares_mtp(folder: Path) -> bool:
    """Whether a folder's config.json declares multi-token-prediction layers
    (num_nextn_predict_layers > 0)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return False
    count = _read_json(config_file).get("num_nextn_predict_layers")
    return isinstance(count, int) and not isinstance(count, bool) and count > 0


def drafter_folder(path) -> Path:
    """path as a folder: itself, or a hub id's files fetched (or found in the cache; a
    published head's pytorch_model.bin or medusa_lm_head.pt too, read as tensors alone)."""
    folder = Path(path)
    if not folder.exists() and _is_hub_id(str(path)):
        folder = resolve(path, HUB_PATTERNS + ("pytorch_model.bin", "medusa_lm_head.pt"))
    return folder


def holds_heads(folder: Path) -> bool:
    """Whether a folder holds trained heads (specjax's drafter.json, or a published EAGLE-3
    head's config.json) rather than a draft model."""
    return _exists(folder / RECORD) or (folder.is_dir() and published_format(folder) is not None)


def _exists(file: Path) -> bool:
    return file.exists() or file.is_symlink()  # a dangling link too: _load_trained names it


def _load_trained(folder: Path, tree):
    """Trained heads from their drafter.json and drafter.safetensors."""
    record_file, weights_file = folder / RECORD, folder / WEIGHTS
    for file in (record_file, weights_file) if folder.is_dir() else ():
        check_regular(file)  # a FIFO or a dangling link is refused as such, not read or called missing
    missing = [f.name for f in (record_file, weights_file) if not f.is_file()]
    if missing:
        raise CheckpointError(f"{folder} is not a saved drafter: {', '.join(missing)} missing (nor is it a draft "
                              f"model's folder: no config.json)")
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
