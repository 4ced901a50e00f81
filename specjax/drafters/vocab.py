"""Reduced draft vocabularies (EAGLE-3's, and the draft model's: FR-Spec's frequency-ranked
head): which target ids a drafter may propose, and the head columns it reads them out with.
A drafter drafts over those ids alone (`base.grow`), and only the distributions of the
nodes it proposes are spread back over the target's vocabulary (`to_target_vocab`, 0 at the
ids it cannot draft), so that acceptance sees a distribution over the target's ids.
Exactness never depends on the set: a token outside it is still emitted, as the target's own.

A draft model's vocabulary is saved beside its config.json as draft_vocab.json (EAGLE-3's
inside its drafter.json). This module knows nothing of how a drafter computes its states.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.hf import CheckpointError, _read_json
from specjax.models import Model
from specjax.quant import Int8

VOCAB_FILE = "draft_vocab.json"  # {"draft_vocab": [increasing ids]} in a draft model's folder


def check_vocab_size(size, vocab_size: int):
    """Raises unless size is a draft vocabulary's size for a target of vocab_size tokens."""
    if not (type(size) is int and 1 <= size <= vocab_size):
        raise ValueError(f"a draft vocabulary has 1..{vocab_size} tokens (the target's), got {size!r}")


def check_vocab(vocab, vocab_size: int, ordered: bool = False) -> np.ndarray:
    """A draft vocabulary (a list or array of target ids) as int32 [Vd], refused unless its
    ids are distinct integers in 0..vocab_size-1, there is at least one and (ordered: a
    saved one, whose head's columns follow it) they increase."""
    if isinstance(vocab, (list, tuple)) and not all(type(i) is int for i in vocab):
        raise ValueError("a draft vocabulary lists target token ids (integers)")
    ids = np.asarray(vocab)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"a draft vocabulary is a non-empty list of target token ids, got shape {ids.shape} "
                         f"of {ids.dtype}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"draft vocabulary ids must lie in 0..{vocab_size - 1}, got "
                         f"{int(ids.min())}..{int(ids.max())}")
    ordered_ids = np.sort(ids)
    repeats = ordered_ids[1:][ordered_ids[1:] == ordered_ids[:-1]]
    if repeats.size:
        raise ValueError(f"draft vocabulary ids must be distinct; {int(repeats[0])} repeats")
    if ordered and (ids != ordered_ids).any():
        raise ValueError("draft vocabulary ids must increase (its head's columns follow them)")
    return ids.astype(np.int32)


def draft_vocabulary(tokens, size: int, vocab_size: int) -> np.ndarray:
    """The `size` most frequent ids among tokens (any int array of target ids; ties to the
    lower id), sorted: int32 [size]."""
    check_vocab_size(size, vocab_size)
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=vocab_size)[:vocab_size]
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32)


def head_columns(model: Model, vocab) -> jax.Array:
    """A model's head (its lm_head, or its embedding when tied) for the ids vocab int32 [Vd]
    only, dequantised: float32 [E, Vd]."""
    vocab = jnp.asarray(vocab)
    if model.config.tie_word_embeddings:
        w = model.params["embedding"]
        rows = w.rows(vocab) if isinstance(w, Int8) else w[vocab]
        return rows.astype(jnp.float32).T
    w = model.params["lm_head"]
    return (w.dequantize() if isinstance(w, Int8) else w)[:, vocab].astype(jnp.float32)


def check_tree_fits(tree, vocab, drafter: str):
    """Raises when `tree` takes more candidates per node than the draft vocabulary `vocab`
    (int32 [Vd], or None: the whole vocabulary, which `base.grow` checks) holds."""
    if vocab is not None and tree.top_k > vocab.shape[0]:
        raise ValueError(f"the tree takes {tree.top_k} candidates per node, but this {drafter} drafts from "
                         f"{vocab.shape[0]} tokens")


def to_target_vocab(values, vocab, vocab_size: int, fill: float = -jnp.inf):
    """values [..., Vd] over the draft vocabulary `vocab` (int32 [Vd] target ids; None: the
    whole vocabulary, returned as they are) -> [..., V], `fill` at tokens it cannot draft
    (-inf for logits, 0 for probabilities)."""
    if vocab is None:
        return values
    Vd = vocab.shape[0]
    # A gather of each id's column (column Vd: `fill`), not a scatter into [..., V]: on a TPU
    # XLA lays a scatter's output out with its small leading axes padded to tiles (a sampled
    # chain's q at batch 8: 262 MB for 16 MB; docs/bench/draft_vocab_aot.txt).
    column = jnp.full((vocab_size,), Vd, jnp.int32).at[vocab].set(jnp.arange(Vd, dtype=jnp.int32))
    rows = values.reshape(-1, Vd)  # [M, Vd]: one axis of rows, which a TPU tiles by 8
    padded = jnp.concatenate([rows, jnp.full((rows.shape[0], 1), fill, values.dtype)], axis=-1)
    return jnp.take(padded, column, axis=-1).reshape(values.shape[:-1] + (vocab_size,))


def save_vocab(folder, ids, vocab_size: int):
    """Writes a draft vocabulary (ids below vocab_size) as folder/draft_vocab.json."""
    ids = np.sort(check_vocab(ids, vocab_size))
    (Path(folder) / VOCAB_FILE).write_text(json.dumps({"draft_vocab": ids.tolist()}) + "\n")


def read_vocab(folder, vocab_size: int) -> np.ndarray | None:
    """The draft vocabulary saved in a draft model's folder, int32 [Vd] (ids below
    vocab_size, increasing), or None where it has none (or is not a local folder).
    A file specjax cannot take raises CheckpointError, naming what is wrong."""
    file = Path(folder) / VOCAB_FILE
    if not Path(folder).is_dir() or not (file.exists() or file.is_symlink()):
        return None
    record = _read_json(file)
    try:
        return check_vocab(record.get("draft_vocab"), vocab_size, ordered=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise CheckpointError(f"{file}: no draft vocabulary specjax can use ({e})") from None
