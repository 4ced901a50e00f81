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
At temperature 0 `sampling.warp` makes p one-hot, and the rule reduces to: a candidate is
accepted iff it is the target's argmax at the current node, and the extra token is that
argmax. `verify` takes that path (`accept_greedy`: no [B, V] distribution is built or
walked) in a program for greedy rows alone, and `accept` otherwise: the same tokens, cheaper.
A chain is tested at all its nodes at once, and a tree of deterministic candidates walks by
the rejected mass alone (`_accept_deterministic`); only sampled siblings walk r over [B, V].

This module knows nothing about models, caches or how the tree was grown; the platform its
program is built for, which picks one gather's form (`node_row`), is passed in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling import History, Sampling, argmax, fold_in, sample, uniform, warp


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


def remove_rejected_mass(mass: jax.Array, p_x: jax.Array) -> jax.Array:
    """The rejected mass p(R) [B] after a deterministic candidate x, of p(x) p_x [B] at the
    current node, was rejected: `remove_rejected` for q one-hot, kept as a scalar
    (`_accept_deterministic`)."""
    return mass + p_x


def accept(key: jax.Array, tokens: jax.Array, parents, valid: jax.Array, q: jax.Array | None,
           p: jax.Array, max_depth: int, platform: str | None = None):
    """Walks each row's tree once, nodes in order (parents come before children).

    tokens int32 [B, N]: the candidates; parents int [N] or [B, N]: each node's parent in
    verification order (0 = the root, node i is tokens[:, i-1]); valid bool [B, N]: nodes
    actually proposed; q float32 [B, N, V]: the distribution each node was drawn from, or
    None when every candidate is deterministic; p float32 [B, N+1, V]: the target's warped
    distributions at [root, nodes]; max_depth: a bound on accepted path length; platform:
    the program's (`node_row`).
    Returns (n int32 [B]: nodes accepted, path int32 [B, max_depth]: their verification
    indices by depth (0 past n), extra int32 [B]: the target's own next token)."""
    B, N = tokens.shape
    rows = jnp.arange(B)
    u = uniform(fold_in(key, 0), (B, N))  # key: one per row [B] (or one [] for all)
    extra_key = fold_in(key, 1)
    if is_chain(parents, N):
        return _accept_chain(tokens, valid, q, p, u, extra_key, max_depth, platform)
    parents = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (B, N))
    if q is None:
        return _accept_deterministic(tokens, parents, valid, p, u, extra_key, max_depth, platform)

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


def _accept_deterministic(tokens, parents, valid, p, u, extra_key, max_depth: int, platform: str | None):
    """`accept` for a tree of deterministic candidates (q None: top-k siblings, prompt lookup),
    without a [B, V] distribution in the walk. At the current node r is p there with the
    rejected candidates R removed, r(x) = p(x) / (1 - p(R)) for x outside R (0 inside), so
    the walk carries p(R) [B] and which nodes R holds [B, N]: each visit gathers p(x) alone,
    and the target's own token is drawn once, from p at the stop with R zeroed. The same
    uniforms, tests and draws as the walk over r, up to rounding. (A rejection never leaves
    nothing: a candidate holding all of r's mass is accepted, u < 1; only rounding could
    empty R's complement, and then p is drawn from whole, as `remove_rejected` keeps r.)
    parents int32 [B, N]; the other arguments as `_accept_chain`'s."""
    B, N = tokens.shape
    rows = jnp.arange(B)

    def visit(i, carry):
        current, removed, mass, n, path = carry  # [B], bool [B, N] (nodes in R), [B] p(R), [B], [B, max_depth]
        x = tokens[:, i]
        p_x = p[rows, current, x]  # [B]
        in_r = jnp.any(removed & (tokens == x[:, None]), axis=1)
        tried = valid[:, i] & (parents[:, i] == current)
        accepted = tried & ~in_r & (u[:, i] * (1.0 - mass) < p_x)  # u < r(x), without a division
        rejected = tried & ~accepted & ~in_r
        removed = jnp.where(accepted[:, None], False, removed.at[:, i].set(rejected))
        mass = jnp.where(accepted, 0.0, jnp.where(rejected, remove_rejected_mass(mass, p_x), mass))
        path = path.at[rows, jnp.where(accepted, n, max_depth)].set(i + 1, mode="drop")
        return jnp.where(accepted, i + 1, current), removed, mass, n + accepted, path

    carry = (jnp.zeros((B,), jnp.int32), jnp.zeros((B, N), bool), jnp.zeros((B,), jnp.float32),
             jnp.zeros((B,), jnp.int32), jnp.zeros((B, max_depth), jnp.int32))
    current, removed, _, n, path = jax.lax.fori_loop(0, N, visit, carry)
    r = node_row(p, current, platform)  # [B, V]: p at the stop
    left = r.at[rows[:, None], jnp.where(removed, tokens, r.shape[-1])].set(0.0, mode="drop")
    r = jnp.where(left.sum(-1, keepdims=True) > 0, left, r)  # (`sample` takes it unnormalised)
    return n, path, sample(extra_key, r)


def accept_greedy(tokens: jax.Array, parents, valid: jax.Array, best: jax.Array, max_depth: int):
    """`accept` at temperature 0, where p at every node is one-hot at the target's argmax:
    a candidate is accepted iff it is that argmax at the current node (whatever its q: an
    argmax has r = 1 > u q(x), any other token r = 0, and a rejection leaves r one-hot at the
    argmax), and the extra token is the argmax where the walk stops. best int32 [B, N+1]:
    the target's argmax at [root, nodes] (first of equals, as warp's one-hot takes it).
    Same arguments otherwise and the same returns as `accept`."""
    B, N = tokens.shape
    rows = jnp.arange(B)
    if is_chain(parents, N):  # n: the leading drafts equal to the argmax before them
        n = leading(valid & (tokens == best[:, :N]))
        return n, _chain_path(n, B, max_depth), jnp.take_along_axis(best, n[:, None], axis=1)[:, 0].astype(jnp.int32)
    parents = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (B, N))

    def visit(i, carry):
        current, n, path = carry  # [B], [B], [B, max_depth]
        accepted = valid[:, i] & (parents[:, i] == current) & (tokens[:, i] == best[rows, current])
        path = path.at[rows, jnp.where(accepted, n, max_depth)].set(i + 1, mode="drop")
        return jnp.where(accepted, i + 1, current), n + accepted, path

    carry = (jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32), jnp.zeros((B, max_depth), jnp.int32))
    current, n, path = jax.lax.fori_loop(0, N, visit, carry) if N else carry
    return n, path, best[rows, current].astype(jnp.int32)


def node_row(x: jax.Array, index: jax.Array, platform: str | None = None) -> jax.Array:
    """x[b, index[b]] for every row: x [B, M, V], index int32 [B] -> [B, V]. A gather of the
    rows, except in a program for a TPU (platform "tpu"): there XLA copies x around that
    gather (its node axis is tiled with V; docs/bench/accept_aot.txt), and a sum over the node
    axis with one term kept (exact) reads x once instead."""
    if platform == "tpu":
        return jnp.where(jnp.arange(x.shape[1])[None, :, None] == index[:, None, None], x, 0).sum(axis=1)
    return x[jnp.arange(x.shape[0]), index]


def is_chain(parents, N: int) -> bool:
    """A fixed chain: node i's parent is node i-1 (known at trace time)."""
    return isinstance(parents, np.ndarray) and np.array_equal(parents, np.arange(N))


def leading(accepted: jax.Array) -> jax.Array:
    """int32 [B]: how many of accepted bool [B, N] hold before the first that does not."""
    return jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)


def _chain_path(n: jax.Array, B: int, max_depth: int) -> jax.Array:
    """A chain's accepted path [B, max_depth]: node d+1 at depth d for d < n, 0 beyond."""
    d = jnp.arange(max_depth)[None]
    return jnp.where(d < n[:, None], d + 1, 0).astype(jnp.int32)


def _accept_chain(tokens, valid, q, p, u, extra_key, max_depth: int, platform: str | None):
    """`accept` for a chain, all nodes at once: node i+1's only candidate is tried against p at
    node i (every node before it accepted, r is p there), so its test is u_i q_i(x) < p_i(x)
    for all i in parallel and n is the count of leading accepts; r at the stop is p after the
    last node, or p at the rejected node with its candidate's q removed. The same uniforms,
    tests and draws as the walk, without a loop over the nodes."""
    B, N = tokens.shape
    at = (jnp.arange(B)[:, None], jnp.arange(N)[None, :], tokens)  # node i's candidate, B N points
    p_x = p[at]  # [B, N] (p at node i, the candidate's parent)
    q_x = 1.0 if q is None else q[at]
    n = leading(valid & (u * q_x < p_x))
    r = node_row(p, n, platform)  # [B, V]: p at the stop
    if N:
        stopped = jnp.minimum(n, N - 1)[:, None]  # the rejected node, where n < N
        x = jnp.take_along_axis(tokens, stopped, axis=1)[:, 0]
        q_n = None if q is None else node_row(q, stopped[:, 0], platform)
        tried = jnp.take_along_axis(valid, stopped, axis=1)[:, 0] & (n < N)
        r = jnp.where(tried[:, None], remove_rejected(r, q_n, x), r)
    return n, _chain_path(n, B, max_depth), sample(extra_key, r)


def verify(key: jax.Array, tokens: jax.Array, parents, valid: jax.Array, q: jax.Array | None,
           logits: jax.Array, sampling: Sampling, max_depth: int, platform: str | None = None,
           history: History | None = None, allowed: jax.Array | None = None):
    """`accept` against the target's float32 logits [B, N+1, V] under `sampling`: through
    `accept_greedy` when every row is greedy (the sampling's static kind: p is never built),
    else through `accept` with p = warp(logits), where a greedy row's p is one-hot and `accept`
    gives it what `accept_greedy` would. history: what penalties read at the N+1 positions
    (`sampling.History`), or None; allowed: bool [B, N+1, V], what a grammar allows there, or
    None. Returns (n, path, extra) as `accept` does."""
    if sampling.greedy:
        return accept_greedy(tokens, parents, valid, argmax(logits), max_depth)
    return accept(key, tokens, parents, valid, q, warp(logits, sampling, history, allowed), max_depth, platform)
