"""A second, smaller model as the drafter, proposing a chain (sampled from its warped q) or
a `specjax.Tree`.

It keeps its own KV cache and, per row, the length it had seen when it last proposed
(its cache's `lengths`) and the chain drafts it fed past it (`ModelDraftState`). Each step
it first catches up on the final tokens its cache lacks (`catch_up`, one window: the last
one or two after a chain step at any K, up to depth + 1 after a tree step), then grows
the tree (`base.grow`). Of the tokens it catches up on, only the last one's logits are read
out. After steps that did not draft, `sync` feeds what one window cannot hold.

With a reduced draft vocabulary (`with_vocab`, or `DraftModel.load` of a folder with a
draft_vocab.json) its head is its columns for those ids alone, so a step reads Vd/V of
the head's bytes: for a small draft, the head is half of them. It knows the target only
through the vocabulary it must speak.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.acceptance import leading
from specjax.cache import KVCache
from specjax.drafters.base import DraftRequest, Drafter, Resume, grow, grow_cache_length, shape_for
from specjax.drafters.vocab import check_tree_fits, check_vocab, head_columns, read_vocab
from specjax.hf import load_model
from specjax.models import Model, apply, head_logits, prefill
from specjax.models.layers import matmul
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


def vocabulary_note(target_vocab: int, draft: Model) -> str | None:
    """One line on how a draft whose vocabulary differs in size from the target's (by padding
    at most; more is refused) is used, or None where the sizes agree."""
    check_vocabularies(target_vocab, draft)
    size = draft.config.vocab_size
    if size < target_vocab:
        return (f"the draft's vocabulary has {size} tokens, the target's {target_vocab}: the draft never proposes "
                f"the target's ids {size}..{target_vocab - 1}")
    if size > target_vocab:
        return (f"the draft's vocabulary has {size} tokens, the target's {target_vocab}: its ids "
                f"{target_vocab}..{size - 1} are taken as padding and never proposed")
    return None


@struct.dataclass
class DraftModel(Drafter):
    model: Model
    tree: Tree | None = struct.field(pytree_node=False, default=None)  # None: a chain of K
    # A reduced draft vocabulary (`with_vocab`): the target ids it drafts from, int32 [Vd]
    # increasing, and its head's columns for them [E, Vd]; None: the draft's whole head.
    vocab: jax.Array | None = None
    head: jax.Array | None = None

    def __post_init__(self):
        if isinstance(self.model, Drafter):
            raise TypeError(f"DraftModel takes a draft specjax.Model, got a {type(self.model).__name__}: "
                            f"`drafter.replace(tree=...)` gives a drafter another tree")

    @classmethod
    def load(cls, path, tree: Tree | None = None, **kwargs) -> "DraftModel":
        """The draft model in a folder (`specjax.load_model(path, **kwargs)`) as a drafter of
        `tree` (None: a chain), drafting from the vocabulary saved beside it (draft_vocab.json,
        written by `specjax distill --draft-vocab`) if it has one. `specjax.load_drafter(path)`
        returns the same for a draft model's folder."""
        model = load_model(path, **kwargs)
        drafter = cls(model, tree)
        ids = read_vocab(path, model.config.vocab_size)
        return drafter if ids is None else drafter.with_vocab(ids)

    def with_vocab(self, vocab) -> "DraftModel":
        """This drafter proposing only the ids vocab (distinct, in 0..V-1 of its own
        vocabulary; e.g. `specjax.draft_vocabulary` of a corpus: its most frequent ids),
        read out by its head's columns for them alone. Exactness does not depend on it (a
        token it cannot draft is the target's own next token when the target wants it);
        its reason is speed where the head is a large share of a draft step (measured:
        docs/bench/draft_vocab.txt)."""
        if self.vocab is not None:
            raise ValueError("this draft model already drafts from a reduced vocabulary")
        ids = np.sort(check_vocab(vocab, self.model.config.vocab_size))
        head = head_columns(self.model, ids).astype(self.model.dtype)
        return self.replace(vocab=jnp.asarray(ids), head=head)

    def resolve(self, K: int | None) -> "DraftModel":
        drafter = self.replace(tree=shape_for(self.tree, K, "sampled"))
        check_tree_fits(drafter.tree, self.vocab, "draft model")
        return drafter

    def bind(self, target: Model) -> "DraftModel":
        V = target.config.vocab_size
        check_vocabularies(V, self.model)
        # with_vocab kept its ids below the draft's own vocabulary: only a draft with padding
        # rows past the target's can hold one the target lacks (read then, once per call).
        if self.vocab is not None and self.model.config.vocab_size > V and int(self.vocab[-1]) >= V:
            raise ValueError(f"the draft vocabulary holds id {int(self.vocab[-1])}, outside the target's {V} tokens")
        return self

    def on(self, backend) -> "DraftModel":
        return self.replace(model=self.model.on(backend))

    def check_lengths(self, longest: int, max_new_tokens: int):
        c = self.model.config
        if longest + max_new_tokens > c.max_position_embeddings:
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the draft "
                             f"{c.model_type} model's max_position_embeddings ({c.max_position_embeddings})")

    def state_rules(self, rules: tuple) -> tuple:
        """A sharded draft's cache follows the draft's own rules; a replicated draft's, replicated."""
        return self.model.rules or super().state_rules(rules)

    keeps_cache = True

    def start(self, target: Model, prompts, lengths, max_len, hidden=None, resume: Resume | None = None):
        """Prefills the draft's cache with the prompts (prompts [B, P], lengths [B]), or,
        resumed, its positions resume.positions into resume.cache."""
        B, P = prompts.shape
        if resume is None:
            cache = KVCache.init(self.model.config, B, grow_cache_length(self.tree, max_len), self.model.dtype)
            _, cache = prefill(self.model, prompts, cache, return_hidden=False)  # in chunks if long
        else:
            window = jnp.take_along_axis(prompts, jnp.minimum(resume.positions, P - 1), axis=1)
            _, cache = prefill(self.model, window, resume.cache, return_hidden=False, start=resume.start)
        fed = jnp.full((B, self.tree.depth - 1 if self.tree.is_chain else 0), -1, jnp.int32)
        return ModelDraftState(cache.replace(lengths=lengths - 1), fed)

    def read(self, hidden, vocab_size: int):
        """The draft's final states [B, W, E] -> float32 logits [B, W, Vd] over its draft
        vocabulary's ids (`vocab`), or, without one, [B, W, V] over the target's vocab_size
        ids: -inf at ids past its own vocabulary, its padding rows dropped."""
        if self.vocab is not None:
            return matmul("bwe,ev->bwv", hidden, self.head, jnp.float32)
        logits = head_logits(self.model, hidden)
        Vd = logits.shape[-1]
        if Vd > vocab_size:  # the draft's padding rows are not tokens of the target
            return logits[..., :vocab_size]
        if Vd < vocab_size:  # the draft never proposes the target's extra ids
            return jnp.pad(logits, ((0, 0), (0, 0), (0, vocab_size - Vd)), constant_values=-jnp.inf)
        return logits

    def propose(self, state: "ModelDraftState", request: DraftRequest):
        V = request.target.config.vocab_size
        read = lambda hidden: self.read(hidden, V)  # noqa: E731

        def forward(cache, tokens, positions, placement=None, features=None):
            _, hidden, cache = apply(self.model, tokens, positions, cache, placement=placement)  # its logits unused
            return cache, read(hidden), None

        cache, last = self.catch_up(state, request, read)
        cache, proposal = grow(forward, cache, last, request.length, request, self.tree, vocab=self.vocab)
        fed = state.fed
        if fed.shape[1]:  # a chain's drafts d1..d_{D-1} now sit at positions length.. (-1: not fed)
            D1 = self.tree.depth - 1
            drafted = jnp.where(proposal.valid[:, :D1], proposal.tokens[:, :D1], -1)
            fed = jnp.pad(drafted, ((0, 0), (0, fed.shape[1] - D1)), constant_values=-1)
        return ModelDraftState(cache.replace(lengths=request.length), fed), request.target_cache, proposal

    def catch_up(self, state: "ModelDraftState", request: DraftRequest, read):
        """Feeds the final tokens its cache lacks, through the row's last, in one window, and
        returns (cache, the draft's logits [B, V] after the last). Its cache holds what it
        had seen when it last proposed (`lengths`; the prompt's but the last token, after
        `start`), and after a chain also the drafts it fed past that (`fed`) that became
        final; the window starts at the first position that holds neither: 2 tokens for a
        chain, depth + 1 for a tree (whose drafts sit in a region apart), which covers what
        any drafting step leaves. After steps that did not draft, `sync` first brings the
        cache within one window. Slots past the last final token get junk, stale by the
        invariant: grow overwrites them in position order."""
        tokens, length = request.tokens, request.length
        B, S = tokens.shape
        rows = jnp.arange(B)[:, None]
        seen = self._seen(state, tokens, length)
        W = self._window
        positions = seen[:, None] + jnp.arange(W)[None]  # [B, W]
        _, hidden, cache = apply(self.model, tokens[rows, jnp.minimum(positions, S - 1)], positions, state.cache)
        at = length - 1 - seen  # the last final token's place in the window (in it, for a row in step)
        return cache, read(jnp.take_along_axis(hidden, jnp.clip(at, 0, W - 1)[:, None, None], axis=1))[:, 0]

    @property
    def _window(self) -> int:
        return 2 if self.tree.is_chain else self.tree.depth + 1

    @staticmethod
    def _seen(state: "ModelDraftState", tokens, length):
        """int32 [B]: positions its cache holds: those it had seen, and the fed chain drafts
        after them that became final."""
        seen = state.cache.lengths
        if state.fed.shape[1]:
            B, S = tokens.shape
            at = seen[:, None] + jnp.arange(state.fed.shape[1])[None]  # [B, D-1]
            final = (state.fed == tokens[jnp.arange(B)[:, None], jnp.minimum(at, S - 1)]) & (at < length[:, None] - 1)
            seen = seen + leading(final)
        return seen

    def held(self, state: "ModelDraftState", tokens, length, features):
        return self._seen(state, tokens, length)

    def sync(self, state: "ModelDraftState", tokens, length, done) -> "ModelDraftState":
        """Feeds every final token but each live row's last, in windows, until one window
        covers what is left: after steps that did not draft (the engine runs it before its
        first call that drafts after calls at K = 0). tokens [B, S], length and done [B] as
        the loop's state holds them."""
        B, S = tokens.shape
        rows = jnp.arange(B)[:, None]
        W = self._window

        def feed(carry):
            cache, seen = carry
            positions = seen[:, None] + jnp.arange(W)[None]  # [B, W]
            _, _, cache = apply(self.model, tokens[rows, jnp.minimum(positions, S - 1)], positions, cache)
            return cache, jnp.minimum(seen + W, jnp.maximum(length - 1, seen))

        behind = lambda carry: jnp.any(~done & (carry[1] + W < length))  # noqa: E731
        cache, seen = jax.lax.while_loop(behind, feed, (state.cache, self._seen(state, tokens, length)))
        return ModelDraftState(cache.replace(lengths=seen), jnp.full_like(state.fed, -1))


@struct.dataclass
class ModelDraftState:
    """A draft model's carry: its cache, valid below `cache.lengths` (what it had seen when it
    last proposed), and the chain drafts it fed at the positions after that."""

    cache: KVCache
    fed: jax.Array  # int32 [B, D-1] (a chain; [B, 0] for a tree): -1 where nothing was fed

    AXES = {"cache": KVCache, "fed": ("batch", None)}  # sharding.declared_axes
