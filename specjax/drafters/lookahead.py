"""Lookahead decoding (Fu et al. 2024): the target drafts for itself by Jacobi iteration,
with no draft model and no training.

Each row carries, in the drafter's state:
- a Jacobi window of `ngram - 1` levels x `window` columns. It rides in the verification
  pass as a `Branch`: with t the root's position, level l column i sits at position
  t+1+i+l and sees the prefix, the root, level 0's columns up to i and its own column's
  levels 1..l, so it is the last token of a guessed text of consecutive positions. The
  target's argmax after the last level's tokens is the next Jacobi iterate: the levels
  shift up by one and those argmaxes become the last level;
- a pool of `pool_size` n-grams: each step adds column i's n-gram (its levels, then the
  target's argmax after them). A row's pool is seeded with its prompt's n-grams (the most
  recent `pool_size`), as TensorRT-LLM's lookahead does. A full pool replaces its least
  recently seen n-grams; an n-gram seen again is refreshed, never stored twice.

To draft, a row looks up the up to `guesses` most recently seen n-grams that start with its
last token and proposes their continuations as a trie (guesses sharing a prefix share its
nodes), verified by the multi-candidate rule for deterministic siblings (q one-hot, never
built): exact under greedy decoding and sampling alike, whatever the pool holds. The
Jacobi branch uses the target's argmax whatever the sampling parameters; it only decides
what is guessed. Everything has fixed shapes and each row is its own.

This module knows nothing of tokenizers, files or the models' insides.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.drafters.base import Branch, DraftRequest, Drafter, Proposal
from specjax.tree import Tree


@struct.dataclass
class LookaheadState:
    window: jax.Array  # int32 [B, L, W]: the Jacobi window, L = ngram - 1 levels
    pool: jax.Array  # int32 [B, C, ngram]: n-grams seen
    seen: jax.Array  # int32 [B, C]: when each was last seen (larger is more recent; -1 empty)
    clock: jax.Array  # int32 [B]: the row's next step's first stamp (a row's own: the engine refills rows apart)

    AXES = {"window": ("batch", None, None), "pool": ("batch", None, None), "seen": ("batch", None),
            "clock": ("batch",)}  # sharding.declared_axes


@struct.dataclass
class Lookahead(Drafter):
    """Self-drafting by Jacobi iteration (see the module's docstring). window: W columns;
    ngram: n-gram size (the drafts' depth is ngram - 1); guesses: n-grams verified per step;
    pool_size: n-grams kept per row."""

    window: int = struct.field(pytree_node=False, default=5)
    ngram: int = struct.field(pytree_node=False, default=4)
    guesses: int = struct.field(pytree_node=False, default=5)
    pool_size: int = struct.field(pytree_node=False, default=512)
    tree: Tree | None = struct.field(pytree_node=False, default=None)  # set by resolve
    fixed_shape = True  # window, ngram and guesses set it

    def resolve(self, K: int | None) -> "Lookahead":
        for name, low in (("window", 1), ("ngram", 2), ("guesses", 1), ("pool_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
                raise ValueError(f"Lookahead {name} must be an int >= {low}, got {value!r}")
        if self.pool_size < self.window:
            raise ValueError(f"Lookahead pool_size ({self.pool_size}) must hold at least one step's "
                             f"n-grams (window={self.window})")
        if K is not None:
            raise ValueError(f"Lookahead's shape is set by ngram and guesses ({self.guesses} guesses of "
                             f"{self.ngram - 1} tokens); num_draft_tokens={K} conflicts with it: leave it unset")
        depth = self.ngram - 1
        return self.replace(tree=Tree(depth=depth, top_k=self.guesses, nodes=self.guesses * depth))

    @property
    def levels(self) -> int:
        return self.ngram - 1

    @property
    def target_room(self) -> int:
        """Slots past the root the verification pass writes: the trie's, then the window's."""
        return self.tree.nodes + self.levels * self.window

    def start(self, target, prompts, lengths, max_len, hidden=None):
        """The window filled with prompt tokens (pseudo-random positions, as the reference
        does), the pool with the prompt's most recent n-grams."""
        B, P = prompts.shape
        L, W, C, n = self.levels, self.window, self.pool_size, self.ngram
        rows = jnp.arange(B)[:, None]
        picks = jax.random.randint(jax.random.key(0), (B, L * W), 0, lengths[:, None])
        window = prompts[rows, picks].reshape(B, L, W)

        # The n-grams ending at the prompt's last E positions, E = min(C, P); the most recent
        # copy of a repeated one is kept.
        E = min(C, P)
        ends = lengths[:, None] - 1 - jnp.arange(E)[None]  # [B, E], most recent first
        grams = prompts[rows[..., None], jnp.clip(ends[..., None] - (n - 1) + jnp.arange(n), 0, P - 1)]
        real = ends >= n - 1  # [B, E]
        same = jnp.all(grams[:, :, None] == grams[:, None], axis=-1) & real[:, None]  # [B, E, E']
        repeated = jnp.any(same & (jnp.arange(E)[None, :, None] > jnp.arange(E)[None, None, :]), axis=2)
        keep = real & ~repeated
        pool = jnp.zeros((B, C, n), jnp.int32).at[:, :E].set(grams.astype(jnp.int32))
        seen = jnp.full((B, C), -1, jnp.int32).at[:, :E].set(jnp.where(keep, ends, -1))
        return LookaheadState(window=window.astype(jnp.int32), pool=pool, seen=seen, clock=jnp.full((B,), P, jnp.int32))

    def propose(self, state: LookaheadState, request: DraftRequest):
        tokens, length = request.tokens, request.length
        B, G, D = tokens.shape[0], self.guesses, self.levels
        rows = jnp.arange(B)[:, None]
        last = tokens[rows[:, 0], length - 1]  # [B]

        # The G most recently seen n-grams that start with the last token.
        match = jnp.where(state.pool[:, :, 0] == last[:, None], state.seen, -1)  # [B, C]
        stamp, index = jax.lax.top_k(match, G)  # [B, G]
        found = stamp >= 0
        guess = jnp.take_along_axis(state.pool, index[..., None], axis=1)[:, :, 1:]  # [B, G, D]

        # Their trie: node (g, d) stands for guess g's first d+1 tokens if g is the first
        # found guess with that prefix (its representative); verification index 1 + d*G + g.
        agree = jnp.cumprod(guess[:, :, None] == guess[:, None], axis=-1) > 0  # [B, G, G', D]
        agree &= found[:, None, :, None]
        rep = jnp.argmax(agree, axis=2)  # [B, G, D]: the first guess with the same prefix
        d = jnp.arange(D)[None, None]  # [1, 1, D]
        valid = found[..., None] & (rep == jnp.arange(G)[None, :, None]) & (d < request.k_limit[:, None, None])
        valid &= ~request.done[:, None, None]
        parent = jnp.where(d > 0, 1 + (d - 1) * G + jnp.concatenate([rep[..., :1], rep[..., :-1]], -1), 0)
        depth_major = lambda x: jnp.swapaxes(x, 1, 2).reshape(B, D * G)  # noqa: E731  [B, N], index d*G + g
        proposal = Proposal(tokens=depth_major(guess).astype(jnp.int32),
                            parents=depth_major(parent).astype(jnp.int32), valid=depth_major(valid),
                            q=None, branch=self._branch(state.window))
        return state, request.target_cache, proposal

    def _branch(self, window: jax.Array) -> Branch:
        """The window [B, L, W] as a branch: token l*W + i at offset 1+i+l, seeing level 0's
        columns <= i and its own column's levels 1..l."""
        L, W = self.levels, self.window
        level, column = np.divmod(np.arange(L * W), W)
        sees = (((level[None] == 0) & (column[None] <= column[:, None]))
                | ((column[None] == column[:, None]) & (level[None] >= 1) & (level[None] <= level[:, None])))
        return Branch(tokens=window.reshape(window.shape[0], L * W), offsets=(1 + column + level).astype(np.int32),
                      sees=sees)

    def observe(self, state: LookaheadState, logits: jax.Array, active: jax.Array) -> LookaheadState:
        """One Jacobi step from the target's logits for the branch [B, L*W, V]: the pool takes
        each column's n-gram, the window shifts up a level. Rows not active keep their state."""
        B, (L, W, C) = logits.shape[0], (self.levels, self.window, self.pool_size)
        rows = jnp.arange(B)[:, None]
        after = jnp.argmax(logits[:, (L - 1) * W:], axis=-1).astype(jnp.int32)  # [B, W]: after the last level
        grams = jnp.concatenate([jnp.swapaxes(state.window, 1, 2), after[..., None]], axis=-1)  # [B, W, n]
        stamps = state.clock[:, None] + jnp.arange(W)[None]  # [B, W]

        # Seen before (in the pool, or later in this step): refresh rather than store twice.
        in_pool = jnp.all(grams[:, :, None] == state.pool[:, None], axis=-1) & (state.seen >= 0)[:, None]  # [B, W, C]
        later = jnp.all(grams[:, :, None] == grams[:, None], axis=-1) & (
            jnp.arange(W)[:, None] < jnp.arange(W)[None])[None]  # [B, W, W']
        fresh = ~in_pool.any(-1) & ~later.any(-1)  # [B, W]
        seen = jnp.maximum(state.seen, jnp.max(jnp.where(in_pool, stamps[..., None], -1), axis=1))

        # Fresh n-grams replace the least recently seen (empty first).
        oldest = jax.lax.top_k(-seen, W)[1]  # [B, W]
        slot = jnp.where(fresh, jnp.take_along_axis(oldest, jnp.cumsum(fresh, axis=1) - 1, axis=1), C)
        pool = state.pool.at[rows, slot].set(grams, mode="drop")
        seen = seen.at[rows, slot].set(stamps, mode="drop")
        window = jnp.concatenate([state.window[:, 1:], after[:, None]], axis=1)

        keep = lambda new, old: jnp.where(active.reshape((B,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
        return LookaheadState(window=keep(window, state.window), pool=keep(pool, state.pool),
                              seen=keep(seen, state.seen), clock=state.clock + W)
