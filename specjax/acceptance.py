"""Speculative acceptance (Leviathan et al. 2023; Chen et al. 2023), masked and fixed-shape.

Given K drafted tokens d with the draft's probabilities q and the target's probabilities p
at K+1 positions, each row keeps its leading drafts while u_i < p_i(d_i) / q_i(d_i), then
adds one token of the target's own: from normalize(max(0, p - q)) at the first rejection,
or from p_{K+1} when every draft passed. The result is distributed exactly as p.

Greedy decoding needs no special case: `sampling.warp` makes p and q one-hot at
temperature 0, where u < p(d)/q(d) means d == argmax p and the residual is p itself.
This module knows nothing about models or caches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import sample


def accept(key: jax.Array, drafts: jax.Array, q: jax.Array, p: jax.Array, num_drafted: jax.Array):
    """Rejection sampling for a batch of rows.

    drafts int32 [B, K]; q [B, K, V] (the draft's warped probabilities; one-hot for a
    deterministic drafter); p [B, K+1, V] (the target's warped probabilities);
    num_drafted int32 [B]: drafts at j >= num_drafted[b] were not proposed.
    Returns (n int32 [B]: leading drafts accepted, extra int32 [B]: the target's token)."""
    B, K = drafts.shape
    u_key, extra_key = jax.random.split(key)
    proposed = jnp.arange(K)[None, :] < num_drafted[:, None]  # [B, K]
    q = jnp.where(proposed[..., None], q, 0.0)  # no draft, no q: the target's p decides alone
    p_d = jnp.take_along_axis(p[:, :K], drafts[..., None], axis=-1)[..., 0]  # [B, K]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]  # [B, K]
    u = jax.random.uniform(u_key, (B, K))
    # u < p/q, written as a product: a token drawn from q has q_d > 0, and no division
    # can blow up.
    passed = (u * q_d < p_d) & proposed
    n = jnp.sum(jnp.cumprod(passed, axis=1), axis=1).astype(jnp.int32)  # [B]

    p_next = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
    q_pad = jnp.concatenate([q, jnp.zeros_like(p[:, :1])], axis=1)  # [B, K+1, V]; no q after K
    q_next = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]  # [B, V]
    residual = jnp.maximum(p_next - q_next, 0.0)
    mass = residual.sum(-1, keepdims=True)
    # p - q <= 0 everywhere only when p == q up to rounding; then p itself is the answer.
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_next)
    extra = sample(extra_key, residual)
    return n, extra
