"""Prompt lookup decoding (Saxena 2023): draft by matching the sequence's last n-gram
against earlier text (prompt and generated alike) and proposing what followed it.

No parameters and fixed shapes, vectorised over the batch: for every earlier end position
e it measures how many tokens ending at e equal the tokens ending at length-1 (up to
max_ngram), takes the longest match of at least min_ngram tokens (among equals, the one
followed by the most known tokens, up to K, then the most recent), and proposes the up to
K tokens that followed it. Without a match a row proposes
nothing and the step yields the target's own token. Its drafts are deterministic (q is
one-hot, never built): a chain verified by the top-k rule.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from specjax.drafters.base import DraftRequest, Drafter, Proposal, shape_for
from specjax.tree import Tree


@struct.dataclass
class PromptLookup(Drafter):
    max_ngram: int = struct.field(pytree_node=False, default=3)
    min_ngram: int = struct.field(pytree_node=False, default=1)
    tree: Tree | None = struct.field(pytree_node=False, default=None)  # a chain of K, set by generate

    def resolve(self, K: int | None) -> "PromptLookup":
        tree = shape_for(self.tree, K, "top_k")
        if not tree.is_chain:
            raise ValueError("PromptLookup proposes one continuation: a chain, not a tree")
        return self.replace(tree=tree)

    def start(self, target, prompts, lengths, max_len, hidden=None):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"PromptLookup needs 1 <= min_ngram <= max_ngram, got "
                             f"min_ngram={self.min_ngram}, max_ngram={self.max_ngram}")
        return None

    def propose(self, state, request: DraftRequest):
        tokens, length, K = request.tokens, request.length, self.tree.nodes
        B, S = tokens.shape
        rows = jnp.arange(B)[:, None, None]
        ends = jnp.arange(S)[None, None, :]  # [1, 1, S]: candidate match ends e
        back = jnp.arange(self.max_ngram)[None, :, None]  # [1, N, 1]
        last = (length - 1)[:, None, None]  # [B, 1, 1]
        # equal[b, i, e]: the token i before e equals the token i before the sequence's end.
        earlier = tokens[rows, jnp.clip(ends - back, 0, S - 1)]
        recent = tokens[rows, jnp.clip(last - back, 0, S - 1)]
        in_range = (ends - back >= 0) & (last - back >= 0)
        equal = (earlier == recent) & in_range  # [B, N, S]
        match = jnp.sum(jnp.cumprod(equal, axis=1), axis=1)  # [B, S]: n-gram length ending at e
        positions = jnp.arange(S)[None]  # [1, S]
        usable = (match >= self.min_ngram) & (positions < length[:, None] - 1)
        # Longest match first, then the most continuation (up to K tokens), then the latest.
        continuation = jnp.minimum(length[:, None] - 1 - positions, K)  # [B, S]
        score = jnp.where(usable, (match * (K + 1) + continuation) * S + positions, -1)
        end = jnp.argmax(score, axis=1)  # [B]
        found = jnp.max(score, axis=1) >= 0

        follow = end[:, None] + 1 + jnp.arange(K)[None]  # [B, K]
        available = jnp.where(found, length - 1 - end, 0)  # tokens known after the match
        num = jnp.where(request.done, 0, jnp.minimum(available, request.k_limit))
        drafts = jnp.take_along_axis(tokens, jnp.clip(follow, 0, S - 1), axis=1)
        valid = jnp.arange(K)[None] < num[:, None]
        return state, request.target_cache, Proposal(drafts, self.tree.parents, valid, q=None)
