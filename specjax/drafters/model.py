"""A second, smaller model as the drafter.

It keeps its own KV cache. Each step it first feeds the last two final tokens at positions
length-2 and length-1 (its cache lacks one of them, or both when every draft was accepted;
rewriting a slot it already holds is harmless), then proposes K tokens one at a time in a
`lax.scan`. It knows the target only through the vocabulary size it must speak.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.cache import KVCache
from specjax.models import Model, apply
from specjax.sampling import Sampling, sample, warp

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
    target_vocab: int = struct.field(pytree_node=False)

    def init(self, prompts, lengths, max_len):
        """Prefills the draft's cache with the prompts. prompts [B, P], lengths [B]."""
        B, P = prompts.shape
        cache = KVCache.init(self.model.config, B, max_len, self.model.dtype)
        positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
        _, _, cache = apply(self.model, prompts, positions, cache)
        return cache.replace(lengths=lengths - 1)

    def _q(self, logits, sampling):
        """Draft logits [B, Vd] -> probabilities over the target's vocabulary [B, V]."""
        V, Vd = self.target_vocab, logits.shape[-1]
        if Vd > V:  # the draft's padding rows are not tokens of the target
            logits = logits[:, :V]
        q = warp(logits, sampling)
        if Vd < V:  # the draft never proposes the target's extra ids
            q = jnp.pad(q, ((0, 0), (0, V - Vd)))
        return q

    def propose(self, cache, tokens, length, key, sampling: Sampling, K: int):
        B = tokens.shape[0]
        rows = jnp.arange(B)[:, None]
        positions = jnp.maximum(length[:, None] + jnp.arange(-2, 0), 0)  # [B, 2]
        logits, _, cache = apply(self.model, tokens[rows, positions], positions, cache)
        cache = cache.replace(lengths=length)  # what follows is speculative
        q0 = self._q(logits[:, -1], sampling)

        def step(carry, step_key):
            cache, q, position = carry  # q [B, V]: distribution of the token at `position`
            token = sample(step_key, q)  # [B]
            logits, _, cache = apply(self.model, token[:, None], position[:, None], cache)
            return (cache, self._q(logits[:, 0], sampling), position + 1), (token, q)

        keys = jax.random.split(key, K)
        (cache, q_last, _), (drafts, qs) = jax.lax.scan(step, (cache, q0, length), keys[:-1])
        last = sample(keys[-1], q_last)
        drafts = jnp.concatenate([drafts.T, last[:, None]], axis=1)  # [B, K]
        q = jnp.concatenate([jnp.moveaxis(qs, 0, 1), q_last[:, None]], axis=1)  # [B, K, V]
        return cache, drafts, q
