"""Text the target wrote: continuations of training windows by the target itself, to
distil a draft on the kind of text it will draft (the target's own outputs) as well as on
the corpus — sequence-level distillation (Kim & Rush 2016), the on-policy data of
DistillSpec (Zhou et al. 2024) with the target as the writer.

Deterministic for (target, stream, arguments): the windows come from a seeded generator,
batches alternate greedy and temperature 1 (each its own key). It knows `generate`, not
the training loop, which sees the result as more stream (`mixed`).
"""

from __future__ import annotations

import jax
import numpy as np

from specjax.generate import generate


def continuations(target, stream: np.ndarray, count: int, eos_id: int, prompt_len: int = 32,
                  new_tokens: int = 224, batch: int = 64, seed: int = 123) -> np.ndarray:
    """`count` sequences, concatenated into one stream of stream's dtype: a window of
    prompt_len tokens of `stream` (a training stream) and the target's continuation of it,
    up to new_tokens, ended by eos_id (the target's own, or appended). Batches of `batch`
    windows alternate greedy (first) and temperature 1."""
    for name, value in (("count", count), ("prompt_len", prompt_len), ("new_tokens", new_tokens), ("batch", batch)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if len(stream) <= prompt_len:
        raise ValueError(f"the stream ({len(stream)} tokens) is too short for windows of {prompt_len} tokens")
    starts = np.random.default_rng(seed).integers(0, len(stream) - prompt_len, count)
    sequences = []
    for i in range(0, count, batch):
        prompts = np.stack([stream[s: s + prompt_len] for s in starts[i: i + batch]]).astype(np.int32)
        out = generate(target, prompts, np.full(len(prompts), prompt_len, np.int32), max_new_tokens=new_tokens,
                       temperature=0.0 if (i // batch) % 2 == 0 else 1.0, key=jax.random.key(i),
                       eos_token_id=eos_id)
        tokens, num = np.asarray(out.tokens), np.asarray(out.num_tokens)
        for b in range(len(prompts)):
            sequence = np.concatenate([prompts[b], tokens[b, : num[b]]])
            sequences.append(sequence if sequence[-1] == eos_id else np.append(sequence, eos_id))
    return np.concatenate(sequences).astype(stream.dtype)


def mixed(stream: np.ndarray, generated: np.ndarray, repeat: int) -> np.ndarray:
    """The training stream followed by `repeat` copies of the generated one: training
    windows, drawn uniformly, come from generated text in proportion to its share."""
    if not isinstance(repeat, (int, np.integer)) or repeat < 0:
        raise ValueError(f"repeat must be an int >= 0, got {repeat!r}")
    return np.concatenate([stream] + [generated] * int(repeat))
