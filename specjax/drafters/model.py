"""A second, smaller model as the drafter, proposing a chain (sampled from its warped q) or
a `specjax.Tree`.

It keeps its own KV cache. Each step it first catches up on the final tokens its cache
lacks, then grows the tree (`base.grow`). After a chain, its drafts sit at the slots of
their positions, so feeding the last two final tokens (positions length-2, length-1) is
enough: its cache lacks one of them, or both when every draft was accepted. A tree's nodes
sit in a region of its own, so it re-feeds every token since the last step's length (at
most depth + 1), overwriting the region in position order. It knows the target only
through the vocabulary it must speak.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from specjax.cache import KVCache
from specjax.drafters.base import DraftRequest, Drafter, grow, grow_cache_length, shape_for
from specjax.models import Model, apply, prefill
from specjax.tree import Tree

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
class DraftModel(Drafter):
    model: Model
    tree: Tree | None = struct.field(pytree_node=False, default=None)  # None: a chain of K

    def resolve(self, K: int | None) -> "DraftModel":
        return self.replace(tree=shape_for(self.tree, K, "sampled"))

    def bind(self, target: Model) -> "DraftModel":
        check_vocabularies(target.config.vocab_size, self.model)
        return self

    def check_lengths(self, longest: int, max_new_tokens: int):
        c = self.model.config
        if longest + max_new_tokens > c.max_position_embeddings:
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the draft "
                             f"{c.model_type} model's max_position_embeddings ({c.max_position_embeddings})")

    def state_rules(self, rules: tuple) -> tuple:
        """A sharded draft's cache follows the draft's own rules; a replicated draft's, replicated."""
        return self.model.rules or super().state_rules(rules)

    def start(self, target: Model, prompts, lengths, max_len, hidden=None):
        """Prefills the draft's cache with the prompts. prompts [B, P], lengths [B]."""
        B, P = prompts.shape
        cache = KVCache.init(self.model.config, B, grow_cache_length(self.tree, max_len), self.model.dtype)
        _, cache = prefill(self.model, prompts, cache, return_hidden=False)  # in chunks if long
        return cache.replace(lengths=lengths - 1)

    def propose(self, cache, request: DraftRequest):
        V = request.target.config.vocab_size

        def forward(cache, tokens, positions, placement=None, features=None):
            logits, _, cache = apply(self.model, tokens, positions, cache, placement=placement)
            Vd = logits.shape[-1]
            if Vd > V:  # the draft's padding rows are not tokens of the target
                logits = logits[..., :V]
            elif Vd < V:  # the draft never proposes the target's extra ids
                logits = jnp.pad(logits, ((0, 0), (0, 0), (0, V - Vd)), constant_values=-jnp.inf)
            return cache, logits, None

        length = request.length
        rows = jnp.arange(length.shape[0])[:, None]
        if self.tree.is_chain:
            first, count = jnp.maximum(length - 2, 0), 2
        else:  # cache.lengths: the length at the last step, whose region is now overwritten
            first, count = cache.lengths, self.tree.depth + 1
        positions = first[:, None] + jnp.arange(count)[None]  # [B, count]
        cache, logits, _ = forward(cache, request.tokens[rows, positions], positions)
        last = jnp.take_along_axis(logits, (length - 1 - first)[:, None, None], axis=1)[:, 0]  # [B, V]
        cache, proposal = grow(forward, cache, last, length, request, self.tree)
        return cache.replace(lengths=length), request.target_cache, proposal
