"""Speculative acceptance over a token tree, masked, fixed-shape and exact.

A chain of drafts is the tree where every node has one child, so this one rule covers
Leviathan et al. (2023) / Chen et al. (2023) for chains and multi-candidate rejection for
trees. Each row walks its tree from the root, holding r, the distribution its next token
must follow (the target's warped p at the current node, as long as no candidate was
rejected there). The current node's candidates x are tried in order:

- a candidate drawn from q (SpecInfer's sampled siblings, or a sampling drafter's chain)
  is accepted with probability min(1, r(x) / q(x)); on rejection r <- normalize(max(0, r - q));
- a deterministic candidate (top-k siblings, prompt lookup: q is one-hot) is accepted with
  probability r(x); on rejection r <- r with x removed, renormalized (the same rule with
  q = one-hot(x), so no dense one-hot is ever built).

An accepted candidate becomes the current node and r becomes p there; its siblings are
never tried. When a node's candidates are exhausted (or it has none), one token of the
target's own is drawn from r. Every output token is distributed exactly as the target's.
Greedy needs no special case: `sampling.warp` makes p and q one-hot at temperature 0, where
this keeps the deepest node whose path matches the target's argmax.

This module knows nothing about models, caches or how the tree was grown.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import sample


def remove_rejected(r: jax.Array, q: jax.Array | None, x: jax.Array) -> jax.Array:
    """The distribution left after candidate x (drawn from q, or one-hot when q is None) was
    rejected: normalize(max(0, r - q)). r, q [B, V]; x int32 [B]. Where nothing is left
    (r == q up to rounding, when rejection had probability ~0), r is kept."""
    if q is None:
        left = r.at[jnp.arange(r.shape[0]), x].set(0.0)
    else:
        left = jnp.maximum(r - q, 0.0)
    mass = left.sum(-1, keepdims=True)
    return jnp.where(mass > 0, left / jnp.where(mass > 0, mass, 1.0), r)


def accept(key: jax.Array, tokens: jax.Array, parents, valid: jax.Array, q: jax.Array | None,
           p: jax.Array, max_depth: int):
    """Walks each row's tree once, nodes in order (parents come before children).

    tokens int32 [B, N]: the candidates; parents int [N] or [B, N]: each node's parent in
    verification order (0 = the root, node i is tokens[:, i-1]); valid bool [B, N]: nodes
    actually proposed; q float32 [B, N, V]: the distribution each node was drawn from, or
    None when every candidate is deterministic; p float32 [B, N+1, V]: the target's warped
    distributions at [root, nodes]; max_depth: a bound on accepted path length.
    Returns (n int32 [B]: nodes accepted, path int32 [B, max_depth]: their verification
    indices by depth (0 past n), extra int32 [B]: the target's own next token)."""
    B, N = tokens.shape
    rows = jnp.arange(B)
    parents = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (B, N))
    u_key, extra_key = jax.random.split(key)
    u = jax.random.uniform(u_key, (B, N))

    def visit(i, carry):
        current, r, n, path = carry  # [B], [B, V], [B], [B, max_depth]
        x = tokens[:, i]
        tried = valid[:, i] & (parents[:, i] == current)
        q_i = None if q is None else q[:, i]
        q_x = 1.0 if q is None else q_i[rows, x]
        # u < r(x) / q(x), written without a division: a drawn token has q(x) > 0.
        accepted = tried & (u[:, i] * q_x < r[rows, x])
        r = jnp.where(accepted[:, None], p[:, i + 1],
                      jnp.where(tried[:, None], remove_rejected(r, q_i, x), r))
        path = path.at[rows, jnp.where(accepted, n, max_depth)].set(i + 1, mode="drop")
        return jnp.where(accepted, i + 1, current), r, n + accepted, path

    carry = (jnp.zeros((B,), jnp.int32), p[:, 0], jnp.zeros((B,), jnp.int32),
             jnp.zeros((B, max_depth), jnp.int32))
    _, r, n, path = jax.lax.fori_loop(0, N, visit, carry) if N else carry
    return n, path, sample(extra_key, r)
