"""A prompt's own log-probabilities for an engine (completions' `echo` with `logprobs`): a
prefill's pass over the prompt's bucket into a cache of its own, reduced to each token's
raw log-probability and the top alternatives (`loop.prefill`'s score). It touches no state;
the engine's thread runs it in a turn (`Engine.score`), one at a time, and its memory is
kept free beside the state (`score_bytes`); `Programs.compile_all` compiles it per bucket
where the engine scores tokens.

It knows the loop's prefill and an engine's `Programs` (its target, buckets and limits);
nothing of requests, slots or HTTP.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax import loop
from specjax.backend import Backend
from specjax.sampling import Sampling


@functools.partial(jax.jit, static_argnames=("top", "backend"))
def _score(target, tokens, length, *, top: int, backend: Backend):
    """A prompt's raw `Logprobs` (tokens int32 [1, b] right-padded, length int32 [1]), [1, b]
    and [1, b, top]."""
    target, _ = loop.bound(backend, target)
    _, scored = loop.prefill(target, None, tokens, length, cache_len=tokens.shape[1], limit=length,
                             sampling=Sampling.make(batch=1), stop_ids=jnp.full((1, 1), -1, jnp.int32),
                             key=loop.row_keys(jax.random.key(0), 1), score=top)
    return scored


def score_bytes(programs) -> int:
    """The bytes its longest bucket's pass needs beside its arguments, its output counted
    (XLA's `memory_analysis()`, compiled for this device): what `Programs.temporaries`
    keeps free for it (0 where the engine scores no tokens)."""
    if programs.logprobs is None:
        return 0
    b = programs.buckets[-1]
    tokens, length = jax.ShapeDtypeStruct((1, b), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
    memory = _score.lower(programs.target, tokens, length, top=programs.logprobs[0],
                          backend=programs.prefill_backend).compile().memory_analysis()
    return int(memory.temp_size_in_bytes + memory.output_size_in_bytes)


def prompt_logprobs(programs, prompt, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A prompt's (token ids [P]) raw log-probabilities under `programs`' target: each token's
    given those before it [P] (0 at position 0, which nothing predicts) and the `top`
    likeliest ids there and theirs [P, top] (top at most the engine's max_logprobs: the
    program is built for that many, one per prompt bucket)."""
    most = 0 if programs.logprobs is None else programs.logprobs[0]
    if programs.logprobs is None or not 0 <= top <= most:
        raise ValueError(f"this engine scores prompts with up to {most} alternatives (Engine(max_logprobs=...)), "
                         f"not {top}")
    P = len(prompt)
    tokens = np.zeros((1, programs.bucket(P)), np.int32)
    tokens[0, :P] = prompt
    scored = jax.device_get(_score(programs.target, tokens, np.array([P], np.int32), top=most,
                                   backend=programs.prefill_backend))
    return scored.chosen[0, :P], scored.top_ids[0, :P, :top], scored.top[0, :P, :top]
