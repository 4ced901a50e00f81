"""Logits -> the distribution that is sampled from, with transformers' semantics.

`Sampling` holds temperature, top-k and top-p as traced values, one per row ([B]; rows of
one batch may differ), and one static `kind`, the most any row asks for: "greedy" (every row
at temperature 0), "sampled" (no row filters) or "filtered". A program is built for its
kind (part of its jit key): a greedy one holds no distribution, draw or sort at all, a
sampled one no sort, and changing the values within a kind never recompiles. `warp`
applies them in transformers' order: temperature, then top-k, then top-p. Temperature 0
is greedy, expressed as a one-hot distribution on the argmax, so that a greedy row in a
sampled batch is the same arithmetic as sampling; a row's setting is applied by `where`,
never by control flow. Random draws take one key per row (`uniform`, `sample`), so a
row's samples do not depend on its neighbours.
This module knows nothing about models, drafts or loops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


GREEDY, SAMPLED, FILTERED = "greedy", "sampled", "filtered"  # a `Sampling`'s kinds, least first
KINDS = (GREEDY, SAMPLED, FILTERED)


def kind_of(temperature, top_k, top_p) -> str:
    """The least kind that serves these settings (host values, one per row or one for all)."""
    temperature, top_k, top_p = np.broadcast_arrays(np.asarray(temperature, np.float32), np.asarray(top_k),
                                                    np.asarray(top_p, np.float32))
    sampled = temperature > 0
    if not sampled.any():
        return GREEDY
    return FILTERED if (sampled & ((top_k > 0) | (top_p < 1.0))).any() else SAMPLED


@struct.dataclass
class Sampling:
    temperature: jax.Array  # float32 [B] (or [] for every row); 0 means greedy
    top_k: jax.Array  # int32 [B] (or []); 0 means off
    top_p: jax.Array  # float32 [B] (or []); 1 means off
    # Static, the most any row asks for (KINDS); a program holds no more than it needs. Values
    # that ask for more than their kind are served as the kind (greedy: argmax; sampled: no filter).
    kind: str = struct.field(pytree_node=False, default=FILTERED)

    @classmethod
    def make(cls, temperature=0.0, top_k=0, top_p=1.0, batch: int | None = None) -> "Sampling":
        """The settings as arrays: [batch] each (one value for every row), or as given; their
        kind from their values where those are known (traced ones: FILTERED, which serves all)."""
        traced = any(isinstance(x, jax.core.Tracer) for x in (temperature, top_k, top_p))
        kind = FILTERED if traced else kind_of(temperature, top_k, top_p)
        values = (jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
                  jnp.asarray(top_p, jnp.float32))
        if batch is not None:
            values = (jnp.broadcast_to(x, (batch,)) for x in values)
        return cls(*values, kind=kind)

    @property
    def greedy(self) -> bool:
        """Every row is greedy (static): nothing is drawn, and no distribution is built."""
        return self.kind == GREEDY


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


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys of float32 x in the same order as x's values (-inf lowest; -0.0 just below
    +0.0): the sign bit flipped for positive values, every bit for negative ones."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _lowest(keys: jax.Array, holds) -> jax.Array:
    """uint32 [..., 1]: per row of keys [..., V], the lowest key t in [its min, its max] for
    which holds(t) (bool [..., 1], monotone: false below some t, true from it on; true at the
    max), found by bisection in 32 fixed halvings (a uint32 range) over the row: no sort,
    and no step waits on the host."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        yes = holds(mid)
        return jnp.where(yes, lo, mid + 1), jnp.where(yes, mid, hi)

    bounds = (jnp.min(keys, axis=-1, keepdims=True), jnp.max(keys, axis=-1, keepdims=True))
    return jax.lax.fori_loop(0, 32, halve, bounds)[1]


def _filter(scores: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p (transformers' TopK/TopPLogitsWarper) without sorting the vocabulary.

    scores [..., V] -> scores with filtered entries set to -inf. Top-k keeps every score >=
    the k-th largest (ties included, as transformers does): the lowest key t with fewer than
    k scores above it. Top-p then removes the lowest scores whose probabilities sum to at
    most 1 - top_p, always keeping the largest: it keeps the scores >= the lowest key t whose
    scores <= t weigh more than 1 - top_p (a tie at that score is kept whole). Each cut is
    found by `_lowest` (2 x 32 masked reductions over V against a sort's V log V)."""
    keys = _order_keys(scores)
    k = jnp.clip(top_k, 1, scores.shape[-1])
    kth = _lowest(keys, lambda t: jnp.sum(keys > t, axis=-1, keepdims=True) < k)
    scores = jnp.where((top_k > 0) & (keys < kth), -jnp.inf, scores)
    keys = _order_keys(scores)
    probs = jax.nn.softmax(scores, axis=-1)
    cutoff = _lowest(keys, lambda t: jnp.sum(jnp.where(keys <= t, probs, 0.0), axis=-1, keepdims=True) > 1.0 - top_p)
    return jnp.where((top_p < 1.0) & (keys < cutoff), -jnp.inf, scores)


def argmax(x: jax.Array) -> jax.Array:
    """int32 [...]: the first index of the largest value along x's last axis [..., V], as
    jnp.argmax gives it (a NaN counts as largest). Two plain reductions (the maximum, then
    the lowest index holding it) instead of XLA's (value, index) pair reduction, which the
    CPU backend does not vectorise (measured in docs/bench/argmax.txt)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where((x == top) | jnp.isnan(x), index, x.shape[-1]), axis=-1)


def warp(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """float32 logits [..., V] -> probabilities [..., V] that are actually sampled from."""
    logits = logits.astype(jnp.float32)
    one_hot = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
    if sampling.greedy:
        return one_hot
    row = lambda x: _rows(x, logits.ndim)  # noqa: E731
    temperature = row(sampling.temperature)
    greedy = temperature == 0
    # Shifted so that the largest score is 0 and the rest <= 0: a tiny temperature sends them
    # to -inf, never to +inf, and the softmax is one-hot on the argmax (ties shared), not
    # NaN. The temperature is clipped to [smallest normal float, 1e37], where it and its
    # reciprocal (XLA may multiply by it) are normal: a subnormal one flushed to 0 would
    # make -inf * 0 = NaN. Beyond either end the distribution is already at its limit.
    top = jnp.max(logits, axis=-1, keepdims=True)
    scores = (logits - top) / jnp.clip(temperature, jnp.finfo(jnp.float32).tiny, 1e37)
    if sampling.kind == FILTERED:  # a row without filters passes through unchanged
        scores = _filter(scores, row(sampling.top_k), row(sampling.top_p))
    return jnp.where(greedy, one_hot, jax.nn.softmax(scores, axis=-1))


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
