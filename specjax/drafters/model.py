"""A second, smaller model as the drafter.

It keeps its own KV cache. Each step it first feeds the last two final tokens at positions
length-2 and length-1 (its cache lacks one of them, or both when every draft was accepted;
rewriting a slot it already holds is harmless), then proposes tokens one at a time. It
knows the target only through the vocabulary it must speak.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from specjax.cache import KVCache
from specjax.drafters.base import DraftRequest, draft_autoregressively
from specjax.models import Model, apply

# Embedding tables that differ by at most this many rows are taken to be padded copies of
# one vocabulary (e.g. rounded up to a multiple of 64/128 for the hardware).
MAX_VOCAB_PADDING = 1024


def check_vocabularies(target_vocab: int, draft: Model):
    """Raises unless the draft speaks the target's vocabulary, up to padding."""
    c = draft.config
    if abs(c.vocab_size - target_vocab) > MAX_VOCAB_PADDING:
        raise ValueError(
            f"draft vocabulary ({c.vocab_size} tokens) and target vocabulary ({target_vocab} "
            f"tokens) differ by more than padding: they cannot share token ids")


@struct.dataclass
class DraftModel:
    model: Model

    def init(self, target: Model, prompts, lengths, max_len):
        """Prefills the draft's cache with the prompts. prompts [B, P], lengths [B]."""
        B, P = prompts.shape
        cache = KVCache.init(self.model.config, B, max_len, self.model.dtype)
        positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
        _, _, cache = apply(self.model, prompts, positions, cache)
        return cache.replace(lengths=lengths - 1)

    def propose(self, cache, request: DraftRequest):
        V = request.target.config.vocab_size

        def forward(cache, tokens, positions):
            logits, _, cache = apply(self.model, tokens, positions, cache)
            Vd = logits.shape[-1]
            if Vd > V:  # the draft's padding rows are not tokens of the target
                logits = logits[..., :V]
            elif Vd < V:  # the draft never proposes the target's extra ids
                logits = jnp.pad(logits, ((0, 0), (0, 0), (0, V - Vd)), constant_values=-jnp.inf)
            return cache, logits

        rows = jnp.arange(request.length.shape[0])[:, None]
        positions = jnp.maximum(request.length[:, None] + jnp.arange(-2, 0), 0)  # [B, 2]
        cache, logits = forward(cache, request.tokens[rows, positions], positions)
        cache = cache.replace(lengths=request.length)  # what follows is speculative
        cache, proposal = draft_autoregressively(forward, cache, logits[:, -1], request)
        return cache, request.target_cache, proposal
