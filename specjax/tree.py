"""Token trees: the shape of what a drafter proposes in one step.

A tree's nodes are draft tokens; node 0 is the root, the last final token of the row,
which every node descends from. Verification scores [root, nodes 1..N] in one target pass,
each node at position length-1+depth, seeing the committed prefix, its ancestors and
itself. A chain of K drafts is the tree in which every node has one child.

Two kinds, both of fixed size so that the loop's shapes never change:

- `Tree(depth, top_k, nodes)`: dynamic (EAGLE-2). Each row grows its own tree: every
  frontier node expands its top_k draft candidates, the top_k candidates of highest
  cumulative draft probability form the next frontier, and of all candidates the `nodes`
  most probable are verified (closed under prefixes, since a child is never more probable
  than its parent).
- `Tree.from_paths(paths)`: static (Medusa's "choices"). Each path lists the rank of the
  candidate at each depth: (0,) is the draft's most likely first token, (0, 1) the second
  most likely token after it. Every row has the same shape.

`siblings` says how the candidates of one node are chosen, and so which exact acceptance
rule verifies them: "top_k" (the r-th most likely token, deterministic: one-hot q) or
"sampled" (independent draws from the draft's distribution q, SpecInfer). Dynamic trees
are top_k: keeping the most probable of sampled candidates would bias them.

This module knows shapes only: nothing of models, caches or the loop.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

SIBLINGS = ("top_k", "sampled")


@dataclasses.dataclass(frozen=True)
class Tree:
    """A tree shape: static (`paths` set) or dynamic. Frozen and hashable: a jit cache key."""

    depth: int  # D: the deepest node's depth (a path accepts at most D drafts)
    top_k: int  # C: candidates per expanded node
    nodes: int  # N: draft tokens verified per step (the root not counted)
    paths: tuple[tuple[int, ...], ...] | None = None  # static trees: ranks from the root
    siblings: str = "top_k"  # "top_k" | "sampled"

    def __post_init__(self):
        if self.siblings not in SIBLINGS:
            raise ValueError(f"siblings must be one of {SIBLINGS}, got {self.siblings!r}")
        for name in ("depth", "top_k", "nodes"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"Tree {name} must be an int >= 1, got {value!r}")
        if self.paths is None:
            if self.siblings != "top_k":
                raise ValueError("a dynamic Tree keeps the most probable candidates, so its siblings are "
                                 "top_k; sampled siblings need a static tree (Tree.from_paths)")
            most = self.top_k + (self.depth - 1) * self.top_k ** 2
            if self.nodes > most:
                raise ValueError(f"Tree(depth={self.depth}, top_k={self.top_k}) scores at most {most} "
                                 f"candidates; nodes={self.nodes} is more")

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], siblings: str = "top_k") -> "Tree":
        """A static tree from rank paths, e.g. [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)].

        Refused: an empty tree, a negative rank, a duplicate path, and a path whose parent
        path is missing (the tree must be closed under prefixes)."""
        paths = [tuple(int(r) for r in p) for p in paths]
        if not paths:
            raise ValueError("a tree needs at least one path")
        if any(len(p) == 0 for p in paths):
            raise ValueError("the empty path is the root, which every tree has: list only draft nodes")
        if any(r < 0 for p in paths for r in p):
            raise ValueError(f"ranks must be >= 0, got {[p for p in paths if min(p) < 0][0]}")
        if len(set(paths)) != len(paths):
            duplicate = next(p for p in paths if paths.count(p) > 1)
            raise ValueError(f"path {duplicate} appears more than once")
        present = set(paths)
        for p in paths:
            if len(p) > 1 and p[:-1] not in present:
                raise ValueError(f"path {p} has no parent path {p[:-1]}: a tree must be closed under prefixes")
        ordered = tuple(sorted(paths, key=lambda p: (len(p), p)))  # parents before children
        return cls(depth=max(len(p) for p in ordered), top_k=max(max(p) for p in ordered) + 1,
                   nodes=len(ordered), paths=ordered, siblings=siblings)

    @classmethod
    def chain(cls, K: int, siblings: str = "sampled") -> "Tree":
        """K drafts in a row: each node has one child."""
        if not isinstance(K, (int, np.integer)) or K < 1:
            raise ValueError(f"a chain needs K >= 1 drafts, got {K!r}")
        return cls.from_paths([(0,) * d for d in range(1, K + 1)], siblings)

    def __str__(self) -> str:
        """In words, as the bench and the notebooks print a shape: 'chain 4', 'tree d8 k2 n24'
        (dynamic), 'static d5 k2 n9'."""
        if self.is_chain:
            return f"chain {self.depth}"
        return f"{'static' if self.is_static else 'tree'} d{self.depth} k{self.top_k} n{self.nodes}"

    @property
    def is_static(self) -> bool:
        return self.paths is not None

    @property
    def is_chain(self) -> bool:
        return self.is_static and self.top_k == 1 and self.nodes == self.depth

    @property
    def width(self) -> int:
        """W: the most nodes of one depth that are expanded (the draft's frontier)."""
        if not self.is_static:
            return self.top_k
        return max(sum(1 for p in self._expanded if len(p) == d) for d in range(self.depth))

    @property
    def region(self) -> int:
        """Nodes a model drafter holds while it grows the tree (KVCache.hold_tree): the
        frontiers it feeds (the deepest candidates are never fed), (depth - 1) * width."""
        return (self.depth - 1) * self.width

    @functools.cached_property
    def _expanded(self) -> frozenset:
        """Static trees: the paths that have a child (the root () included)."""
        return frozenset(p[:-1] for p in self.paths)

    # ---- static tables (numpy, built at trace time) -------------------------------------

    @functools.cached_property
    def parents(self) -> np.ndarray:
        """Static trees: int32 [N], each node's parent in verification order (0 = root)."""
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        return np.array([index.get(p[:-1], 0) for p in self.paths], np.int32)

    @functools.cached_property
    def frontier_tables(self):
        """Static trees, for the drafter's expansion over a [W, C] candidate grid per depth:

        expand int32 [D, W]: at depth d (0-based), which candidate of the previous grid
            (w * C + c, or the root's row 0 at d = 0) each frontier slot holds; -1 if empty.
        node int32 [D, W, C]: the verification index (1..N) of candidate (w, c) at depth d+1,
            0 if the tree has no such node."""
        W, C, D = self.width, self.top_k, self.depth
        expand = np.full((D, W), -1, np.int32)
        node = np.zeros((D, W, C), np.int32)
        slot_of = {(): 0}  # path -> its frontier slot at its depth
        expand[0, 0] = 0
        for d in range(1, D + 1):
            expanded = [p for p in self.paths if len(p) == d and p in self._expanded]
            for i, p in enumerate(self.paths):
                if len(p) == d:
                    node[d - 1, slot_of[p[:-1]], p[-1]] = i + 1
            if d < D:
                for w, p in enumerate(expanded):
                    slot_of[p] = w
                    expand[d, w] = slot_of[p[:-1]] * C + p[-1]
        return expand, node


# ---- tree arithmetic on parents (numpy for static trees, jnp for per-row ones) ----------


def ancestors(parents):
    """parents int [..., N] (verification indices, 0 = root) -> bool [..., N+1, N+1]:
    entry [i, j] says node j is node i or one of its ancestors (the root is node 0).
    numpy in, numpy out (a constant at trace time); jnp in, jnp out."""
    xp = np if isinstance(parents, np.ndarray) else jnp
    N = parents.shape[-1]
    eye = xp.eye(N + 1, dtype=bool)
    out = xp.broadcast_to(eye, parents.shape[:-1] + (N + 1, N + 1))
    if xp is np:
        out = out.copy()
        for i in range(1, N + 1):  # parents come before children
            out[..., i, :] |= np.take_along_axis(out, parents[..., i - 1, None, None], axis=-2)[..., 0, :]
        return out

    def add(i, out):
        parent_row = jnp.take_along_axis(out, parents[..., i - 1][..., None, None], axis=-2)[..., 0, :]
        return out.at[..., i, :].set(out[..., i, :] | parent_row)

    return jax.lax.fori_loop(1, N + 1, add, out)


def depths(ancestor_matrix):
    """bool [..., N+1, N+1] ancestors -> int32 [..., N+1] depths (the root's is 0)."""
    return ancestor_matrix.sum(-1).astype(np.int32) - 1


def with_branch(depth, ancestor, branch):
    """A verification pass's layout with a drafter's `Branch` of X tokens after the tree's N+1:
    depth int32 [..., N+1] and ancestor bool [..., N+1, N+1] (numpy or jnp, per row or not)
    -> offsets int32 [..., T] (position minus the root's) and sees bool [..., T, T], T = N+1+X.
    Tree nodes see no branch token; a branch token sees the root and what branch.sees marks."""
    xp = np if isinstance(ancestor, np.ndarray) else jnp
    lead, n1, X = ancestor.shape[:-2], ancestor.shape[-1], branch.sees.shape[0]
    bottom = np.concatenate([np.ones((X, 1), bool), np.zeros((X, n1 - 1), bool), branch.sees], axis=1)
    sees = xp.concatenate([xp.concatenate([ancestor, xp.zeros(lead + (n1, X), bool)], axis=-1),
                           xp.broadcast_to(bottom, lead + bottom.shape)], axis=-2)
    offsets = xp.concatenate([depth, xp.broadcast_to(np.asarray(branch.offsets, np.int32), lead + (X,))], axis=-1)
    return offsets, sees
