"""Self-speculation by early exit (LayerSkip; "draft with the first N layers"): the draft
is the target's first N layers, its final norm and its head, proposing a chain (sampled)
or a `specjax.Tree`.

It holds no weights of its own — it runs the target's, read in place — and no cache of
its own: it writes the target's cache for layers < N at the last final token's slot, and
holds the tree it grows beside the cache (KVCache.tree). That is correct because the root's
slot is rewritten in every layer (the verification pass, or the commit after it) before
anything reads it as final.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from specjax.drafters.base import DraftRequest, Drafter, grow, shape_for
from specjax.models import Model, apply
from specjax.tree import Tree


@struct.dataclass
class EarlyExit(Drafter):
    num_layers: int = struct.field(pytree_node=False)
    tree: Tree | None = struct.field(pytree_node=False, default=None)  # None: a chain of K

    def resolve(self, K: int | None) -> "EarlyExit":
        return self.replace(tree=shape_for(self.tree, K, "sampled"))

    def start(self, target: Model, prompts, lengths, max_len, hidden=None):
        if not 1 <= self.num_layers < target.config.num_layers:
            raise ValueError(f"EarlyExit({self.num_layers}) needs 1 <= num_layers < the target's "
                             f"{target.config.num_layers} layers")
        return None

    def propose(self, state, request: DraftRequest):
        def forward(cache, tokens, positions, placement=None, features=None):
            logits, _, cache = apply(request.target, tokens, positions, cache,
                                     exit_layer=self.num_layers, placement=placement)
            return cache, logits, None

        # The target's cache holds every position < length - 1: feed only the last token.
        last = (request.length - 1)[:, None]  # [B, 1]
        rows = jnp.arange(last.shape[0])[:, None]
        cache, logits, _ = forward(request.target_cache, request.tokens[rows, last], last)
        cache, proposal = grow(forward, cache, logits[:, -1], request.length, request, self.tree)
        return state, cache, proposal
