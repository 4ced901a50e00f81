"""Logits -> the distribution that is sampled from, with transformers' semantics.

`Sampling` holds temperature, top-k and top-p as traced values, one per row ([B]; changing
them never recompiles, and rows of one batch may differ). `warp` applies them in
transformers' order: temperature, then top-k, then top-p. Temperature 0 is greedy,
expressed as a one-hot distribution on the argmax, so greedy decoding is the same
arithmetic as sampling and needs no separate code path; a row's setting is applied by
`where`, never by control flow on the row (only a whole batch's "all greedy" or "no
filter" skips work). Random draws take one key per row (`uniform`, `sample`), so a
row's samples do not depend on its neighbours.
This module knows nothing about models, drafts or loops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Sampling:
    temperature: jax.Array  # float32 [B] (or [] for every row); 0 means greedy
    top_k: jax.Array  # int32 [B] (or []); 0 means off
    top_p: jax.Array  # float32 [B] (or []); 1 means off

    @classmethod
    def make(cls, temperature=0.0, top_k=0, top_p=1.0, batch: int | None = None) -> "Sampling":
        """The settings as arrays: [batch] each (one value for every row), or as given."""
        values = (jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
                  jnp.asarray(top_p, jnp.float32))
        if batch is not None:
            values = (jnp.broadcast_to(x, (batch,)) for x in values)
        return cls(*values)

    @property
    def all_greedy(self) -> jax.Array:
        """bool []: every row is greedy (whole-batch work may be skipped, never a row's)."""
        return jnp.all(self.temperature == 0)


def _rows(x: jax.Array, ndim: int) -> jax.Array:
    """A per-row value [B] (or []) shaped to broadcast against an array [B, ...] of ndim axes."""
    x = jnp.asarray(x)
    return x if x.ndim == 0 else x.reshape(x.shape + (1,) * (ndim - 1))


def fold_in(key: jax.Array, data) -> jax.Array:
    """jax.random.fold_in for one key [] or one key per row [B] (data: int or int32 [B])."""
    if key.ndim == 0:
        return jax.random.fold_in(key, data)
    return jax.vmap(jax.random.fold_in)(key, jnp.broadcast_to(jnp.asarray(data, jnp.uint32), key.shape))


def uniform(key: jax.Array, shape: tuple) -> jax.Array:
    """float32 uniforms in [0, 1) of `shape`; with one key per row (key [B], shape[0] == B)
    row b's come from its own key alone."""
    if key.ndim == 0:
        return jax.random.uniform(key, shape)
    return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(key)


def validate(temperature, top_k, top_p):
    """Clear errors for nonsense values (traced values are not checked)."""
    def concrete(x):
        return not isinstance(x, jax.core.Tracer)

    if concrete(temperature) and not 0 <= float(temperature) < float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if concrete(top_k) and (int(top_k) != top_k or not 0 <= top_k < 2**31):
        raise ValueError(f"top_k must be an int in [0, 2**31) (0 is off), got {top_k}")
    if concrete(top_p) and not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1] (1 is off), got {top_p}")


def _pick(x: jax.Array, index) -> jax.Array:
    """x[..., index] as [..., 1] (index int [] or [..., 1]) by a masked maximum, not a gather:
    a gather along V made a TPU lay [B, K+1, V] logits out with K+1 in the lanes (padded to
    128, a 25x larger buffer, three of them live in a speculative loop)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.max(jnp.where(iota == index, x, -jnp.inf), axis=-1, keepdims=True)


def _filter(scores: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p (transformers' TopK/TopPLogitsWarper) by one ascending sort.

    scores [..., V] -> scores with filtered entries set to -inf."""
    V = scores.shape[-1]
    ascending = jnp.sort(scores, axis=-1)  # [..., V]
    # top-k keeps every score >= the k-th largest (ties included, as transformers does).
    k = jnp.clip(top_k, 1, V)
    kth = _pick(ascending, V - k)
    kth = jnp.where(top_k > 0, kth, -jnp.inf)
    scores = jnp.where(scores < kth, -jnp.inf, scores)
    ascending = jnp.where(ascending < kth, -jnp.inf, ascending)  # still sorted
    # top-p removes the ascending prefix whose cumulative probability is <= 1 - top_p,
    # always keeping the largest score.
    cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
    removed = jnp.sum(cumulative[..., :-1] <= 1.0 - top_p, axis=-1, keepdims=True)
    cutoff = _pick(ascending, removed)
    return jnp.where(scores < cutoff, -jnp.inf, scores)


def argmax(x: jax.Array) -> jax.Array:
    """int32 [...]: the first index of the largest value along x's last axis [..., V], as
    jnp.argmax gives it (a NaN counts as largest). Two plain reductions (the maximum, then
    the lowest index holding it) instead of XLA's (value, index) pair reduction, which the
    CPU backend does not vectorise: 18 us -> 2.5 us for one row of 4096 on this project's
    CPU, inside a loop (docs/bench/argmax.txt; a greedy chain of K drafts takes 2K + 1 a step)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where((x == top) | jnp.isnan(x), index, x.shape[-1]), axis=-1)


def warp(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """float32 logits [..., V] -> probabilities [..., V] that are actually sampled from."""
    logits = logits.astype(jnp.float32)
    row = lambda x: _rows(x, logits.ndim)  # noqa: E731
    temperature, top_k, top_p = row(sampling.temperature), row(sampling.top_k), row(sampling.top_p)
    greedy = temperature == 0

    def sampled(logits):
        scores = logits / jnp.where(greedy, 1.0, temperature)
        # The sort runs only when some sampled row filters (a batch-wide test: rows differ by `where`).
        filtering = jnp.any(~greedy & ((top_k > 0) | (top_p < 1.0)))
        scores = jax.lax.cond(filtering, _filter, lambda s, k, p: s, scores, top_k, top_p)
        one_hot = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
        return jnp.where(greedy, one_hot, jax.nn.softmax(scores, axis=-1))

    return jax.lax.cond(  # only the branch taken runs (both, under vmap)
        sampling.all_greedy, lambda l: jax.nn.one_hot(argmax(l), l.shape[-1], dtype=jnp.float32), sampled, logits)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Draws from probabilities [..., V] -> int32 [...] by inverting the CDF with one uniform
    per distribution (a tenth of the cost of Gumbel-max, which needs V random numbers); key
    [] or one per row [B] (`uniform`). Ids of zero probability are never drawn: the
    threshold is strictly positive."""
    u = uniform(key, probs.shape[:-1] + (1,))
    cdf = jnp.cumsum(probs, axis=-1)
    threshold = jnp.maximum(u * cdf[..., -1:], jnp.finfo(jnp.float32).tiny)
    index = jnp.sum(cdf < threshold, axis=-1)  # the first id whose cdf reaches the threshold
    return jnp.minimum(index, probs.shape[-1] - 1).astype(jnp.int32)
