"""Self-speculation by early exit (LayerSkip; "draft with the first N layers"): the draft
is the target's first N layers, its final norm and its head.

It holds no weights of its own — it runs the target's, read in place — and no cache of
its own: it writes the target's cache for layers < N at the positions it drafts. That is
correct because the target's verification pass rewrites every one of those positions
(length-1 .. length+K-1) in every layer before anything reads them as final.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from specjax.drafters.base import DraftRequest, draft_autoregressively
from specjax.models import Model, apply


@struct.dataclass
class EarlyExit:
    num_layers: int = struct.field(pytree_node=False)

    def init(self, target: Model, prompts, lengths, max_len):
        if not 1 <= self.num_layers < target.config.num_layers:
            raise ValueError(f"EarlyExit({self.num_layers}) needs 1 <= num_layers < the target's "
                             f"{target.config.num_layers} layers")
        return None

    def propose(self, state, request: DraftRequest):
        def forward(cache, tokens, positions):
            logits, _, cache = apply(request.target, tokens, positions, cache,
                                     exit_layer=self.num_layers)
            return cache, logits

        # The target's cache holds every position < length - 1: feed only the last token.
        last = (request.length - 1)[:, None]  # [B, 1]
        rows = jnp.arange(last.shape[0])[:, None]
        cache, logits = forward(request.target_cache, request.tokens[rows, last], last)
        cache, proposal = draft_autoregressively(forward, cache, logits[:, -1], request)
        return state, cache, proposal

