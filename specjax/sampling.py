"""Logits -> the distribution that is sampled from, with transformers' semantics.

`Sampling` holds temperature, top-k, top-p, min-p, a sparse logit bias and three penalties as
traced values, one per row ([B]; rows of one batch may differ), and one static `kind`, the
most any row asks for: "greedy" (every row at temperature 0, none biased or penalized),
"sampled" (no row filters, is biased or penalized) or "filtered". A program is built for
its kind (part of its jit key): a greedy one holds no distribution, draw or sort at all, a
sampled one no sort, and changing the values within a kind never recompiles. `warp` applies
them in transformers' (and vLLM's) order: the logit bias (OpenAI's `logit_bias`, added to
the raw logits: a greedy row takes the argmax of the biased logits), the penalties
(`penalize`: repetition over the prompt and output, then frequency and presence over the
output, as vLLM defines them; they read the row's `History`), temperature, top-k, top-p,
then min-p (vLLM applies min-p before top-k/top-p; the two orders differ only where top-p
and min-p are both set). Temperature 0
is greedy, expressed as a one-hot distribution on the argmax, so that a greedy row in a
sampled batch is the same arithmetic as sampling; a row's setting is applied by `where`,
never by control flow. Random draws take one key per row (`uniform`, `sample`), so a
row's samples do not depend on its neighbours.
This module knows nothing about models, drafts or loops.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


GREEDY, SAMPLED, FILTERED = "greedy", "sampled", "filtered"  # a `Sampling`'s kinds, least first
KINDS = (GREEDY, SAMPLED, FILTERED)


MAX_LOGIT_BIAS = 300  # entries a row's logit_bias may hold (OpenAI's limit)
BIAS_RANGE = 100.0  # a bias lies in [-BIAS_RANGE, BIAS_RANGE] (OpenAI's range)
PENALTY_RANGE = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)


def kind_of(temperature, top_k, top_p, min_p=0.0, biased=False, penalized=False) -> str:
    """The least kind that serves these settings (host values, one per row or one for all;
    biased: whether the row's logit bias holds any entry; penalized: whether any of its
    penalties is on)."""
    temperature, top_k, top_p, min_p, biased, penalized = np.broadcast_arrays(
        np.asarray(temperature, np.float32), np.asarray(top_k), np.asarray(top_p, np.float32),
        np.asarray(min_p, np.float32), np.asarray(biased, bool), np.asarray(penalized, bool))
    if biased.any() or penalized.any():  # a greedy row's argmax is of its adjusted logits: `warp`'s filtered form
        return FILTERED
    sampled = temperature > 0
    if not sampled.any():
        return GREEDY
    return FILTERED if (sampled & ((top_k > 0) | (top_p < 1.0) | (min_p > 0))).any() else SAMPLED


class Settings(NamedTuple):
    """One row's settings as the host holds them (an engine's request): `stack` turns rows of
    them into a `Sampling`."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple = ()  # ((token id, bias), ...)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    constrained: bool = False  # held to a grammar (specjax.grammar): its distribution is masked

    @property
    def penalized(self) -> bool:
        return is_penalized(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)


def is_penalized(presence, frequency, repetition):
    """Whether penalties (host values or arrays alike) change anything."""
    return (np.asarray(presence) != 0) | (np.asarray(frequency) != 0) | (np.asarray(repetition) != 1)


def kind_of_rows(rows: Sequence[Settings]) -> str:
    """The least kind that serves every row of `rows`."""
    return kind_of(*(np.array(x) for x in zip(*(r[:4] for r in rows))),
                   biased=[bool(r.logit_bias) or r.constrained for r in rows], penalized=[r.penalized for r in rows])


def bias_arrays(logit_bias, rows: int | None = None, width: int | None = None):
    """A logit bias as arrays: (ids int32, biases float32), [width] for one ({token id: bias}
    or (id, bias) pairs: every row's) or [rows, width] for one per row (a sequence of
    those); padded with id -1 (never a token). width: None, the longest rounded up to a
    multiple of 8 (lists of 1-8 entries share a program) and 0 for none."""
    per_row = rows is not None
    biases = [_pairs(b) for b in logit_bias] if per_row else [_pairs(logit_bias)]
    longest = max((len(b) for b in biases), default=0)
    width = -(-longest // 8) * 8 if width is None else width
    if longest > width:
        raise ValueError(f"a logit_bias of {longest} entries; this program takes up to {width}")
    ids, values = np.full((len(biases), width), -1, np.int32), np.zeros((len(biases), width), np.float32)
    for i, pairs in enumerate(biases):
        for j, (token, bias) in enumerate(pairs):
            ids[i, j], values[i, j] = token, bias
    return (ids, values) if per_row else (ids[0], values[0])


def stack(rows: Sequence[Settings], width: int) -> "Sampling":
    """Rows' settings as one `Sampling` of host arrays ([n] each; the bias [n, width]), of
    kind FILTERED (which serves every row: a program reads it as its own kind)."""
    temperature, top_k, top_p, min_p, biases, presence, frequency, repetition, _ = zip(*rows)
    ids, bias = bias_arrays(biases, len(rows), width)
    floats = lambda x: np.array(x, np.float32)  # noqa: E731
    return Sampling(floats(temperature), np.array(top_k, np.int32), floats(top_p), floats(min_p), ids, bias,
                    floats(presence), floats(frequency), floats(repetition), FILTERED)


def _pairs(logit_bias) -> tuple:
    """((id, bias), ...) from None, a {token id: bias} mapping or (id, bias) pairs."""
    if logit_bias is None:
        return ()
    return tuple(logit_bias.items()) if hasattr(logit_bias, "items") else tuple(logit_bias)


def check_logit_bias(logit_bias, vocab_size: int, most: int = MAX_LOGIT_BIAS) -> dict[int, float]:
    """A logit bias ({token id: bias} or (id, bias) pairs; None: none) checked: at most `most`
    entries, ids ints in [0, vocab_size) given once, biases finite numbers in [-100, 100];
    returned as a {id: bias} dict of Python ints and floats, in id order."""
    if isinstance(logit_bias, (str, bytes)):
        raise ValueError(f"logit_bias must be a {{token id: bias}} mapping, got {logit_bias!r}")
    try:
        pairs = _pairs(logit_bias)
        pairs = [(token, bias) for token, bias in pairs]
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must be a {{token id: bias}} mapping, got {logit_bias!r}") from None
    if len(pairs) > most:
        raise ValueError(f"logit_bias holds {len(pairs)} entries; at most {most} are taken")
    seen = set()
    for token, bias in pairs:
        if not isinstance(token, (int, np.integer)) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise ValueError(f"logit_bias: token id {token!r} is not an int in [0, {vocab_size})")
        if token in seen:
            raise ValueError(f"logit_bias: token id {token} is given twice")
        seen.add(token)
        if isinstance(bias, bool) or not isinstance(bias, (int, float, np.integer, np.floating)) \
                or not -BIAS_RANGE <= float(bias) <= BIAS_RANGE:
            raise ValueError(f"logit_bias[{token}] must be a number in [-{BIAS_RANGE:g}, {BIAS_RANGE:g}], "
                             f"got {bias!r}")
    return dict(sorted((int(t), float(b)) for t, b in pairs))


@struct.dataclass
class Sampling:
    temperature: jax.Array  # float32 [B] (or [] for every row); 0 means greedy
    top_k: jax.Array  # int32 [B] (or []); 0 means off
    top_p: jax.Array  # float32 [B] (or []); 1 means off
    min_p: jax.Array  # float32 [B] (or []); 0 means off
    bias_ids: jax.Array  # int32 [B, Lb] (or [Lb]): the tokens each row's logit bias moves; -1 pads
    bias: jax.Array  # float32 [B, Lb] (or [Lb]): what it adds to their logits
    presence: jax.Array  # float32 [B] (or []): subtracted once from every id the output holds; 0 means off
    frequency: jax.Array  # float32 [B] (or []): subtracted per occurrence in the output; 0 means off
    repetition: jax.Array  # float32 [B] (or []): divides positive (multiplies negative) logits of ids in the
    # prompt or output (transformers' / vLLM's repetition_penalty); 1 means off
    # Static, the most any row asks for (KINDS); a program holds no more than it needs. Values
    # that ask for more than their kind are served as the kind (greedy: argmax; sampled: no filter).
    kind: str = struct.field(pytree_node=False, default=FILTERED)

    @classmethod
    def make(cls, temperature=0.0, top_k=0, top_p=1.0, batch: int | None = None, *, min_p=0.0,
             logit_bias=None, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0) -> "Sampling":
        """The settings as arrays: [batch] each (one value for every row), or as given; their
        kind from their values where those are known (traced ones: FILTERED, which serves all).
        logit_bias: None, {token id: bias} (every row's), or with batch a list of one per row
        (mappings or (id, bias) pairs: `bias_arrays`)."""
        scalars = (temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty)
        traced = any(isinstance(x, jax.core.Tracer) for x in scalars)
        per_row = batch is not None and isinstance(logit_bias, (list, tuple))
        ids, bias = bias_arrays(logit_bias, batch if per_row else None)
        kind = FILTERED if traced else kind_of(temperature, top_k, top_p, min_p, biased=(ids >= 0).any(-1),
                                               penalized=is_penalized(*scalars[4:]))
        values = tuple(jnp.asarray(x, jnp.int32 if i == 1 else jnp.float32) for i, x in enumerate(scalars))
        ids, bias = jnp.asarray(ids), jnp.asarray(bias)
        if batch is not None:
            values = tuple(jnp.broadcast_to(x, (batch,)) for x in values)
            ids, bias = (jnp.broadcast_to(x, (batch, x.shape[-1])) for x in (ids, bias))
        return cls(*values[:4], ids, bias, *values[4:], kind=kind)

    def rows(self, batch: int) -> "Sampling":
        """Every setting one per row of `batch` (those given for all rows repeated)."""
        one = lambda x: jnp.broadcast_to(x, (batch,))  # noqa: E731
        two = lambda x: jnp.broadcast_to(x, (batch, x.shape[-1]))  # noqa: E731
        return self.replace(temperature=one(self.temperature), top_k=one(self.top_k), top_p=one(self.top_p),
                            min_p=one(self.min_p), bias_ids=two(self.bias_ids), bias=two(self.bias),
                            presence=one(self.presence), frequency=one(self.frequency),
                            repetition=one(self.repetition))

    def over(self, vocab: jax.Array) -> "Sampling":
        """The settings for logits over a reduced vocabulary, vocab int32 [Vd] (the increasing
        target ids its indices stand for): each bias moves its id's index there, or nothing
        where the id is not in it."""
        return self.replace(bias_ids=_index_in(vocab, self.bias_ids))

    @property
    def greedy(self) -> bool:
        """Every row is greedy (static): nothing is drawn, and no distribution is built."""
        return self.kind == GREEDY


def _rows(x: jax.Array, ndim: int) -> jax.Array:
    """A per-row value [B] (or []) shaped to broadcast against an array [B, ...] of ndim axes."""
    x = jnp.asarray(x)
    return x if x.ndim == 0 else x.reshape(x.shape + (1,) * (ndim - 1))


def fold_in(key: jax.Array, data) -> jax.Array:
    """jax.random.fold_in for one key [] or one key per row [B] (data: int or int32 [B])."""
    if key.ndim == 0:
        return jax.random.fold_in(key, data)
    return jax.vmap(jax.random.fold_in)(key, jnp.broadcast_to(jnp.asarray(data, jnp.uint32), key.shape))


def uniform(key: jax.Array, shape: tuple) -> jax.Array:
    """float32 uniforms in [0, 1) of `shape`; with one key per row (key [B], shape[0] == B)
    row b's come from its own key alone."""
    if key.ndim == 0:
        return jax.random.uniform(key, shape)
    return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(key)


def validate(temperature, top_k, top_p, min_p=0.0):
    """Clear errors for nonsense values (traced values are not checked)."""
    def concrete(x):
        return not isinstance(x, jax.core.Tracer)

    if concrete(temperature) and not 0 <= float(temperature) < float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if concrete(top_k) and (int(top_k) != top_k or not 0 <= top_k < 2**31):
        raise ValueError(f"top_k must be an int in [0, 2**31) (0 is off), got {top_k}")
    if concrete(top_p) and not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1] (1 is off), got {top_p}")
    if concrete(min_p) and not 0.0 <= float(min_p) <= 1.0:
        raise ValueError(f"min_p must lie in [0, 1] (0 is off), got {min_p}")


def check_penalties(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0) -> tuple:
    """Penalties checked (presence and frequency in [-2, 2], OpenAI's range; repetition a
    finite number > 0, vLLM's and transformers'): Python floats, or float32 arrays where
    given one per row."""
    def checked(name, value, ok, what):
        x = np.asarray(value)
        if x.dtype == bool or not np.issubdtype(x.dtype, np.number) or not np.all(ok(x.astype(np.float64))):
            raise ValueError(f"{name} must be {what}, got {value!r}")
        return float(x) if x.ndim == 0 else x.astype(np.float32)

    span = lambda x: (-PENALTY_RANGE <= x) & (x <= PENALTY_RANGE)  # noqa: E731 (NaN fails)
    in_span = f"a number in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] (0 is off)"
    return (checked("presence_penalty", presence_penalty, span, in_span),
            checked("frequency_penalty", frequency_penalty, span, in_span),
            checked("repetition_penalty", repetition_penalty, lambda x: (0 < x) & (x < np.inf),
                    "a finite number > 0 (1 is off)"))


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys of float32 x in the same order as x's values (-inf lowest; -0.0 just below
    +0.0): the sign bit flipped for positive values, every bit for negative ones."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _lowest(keys: jax.Array, holds) -> jax.Array:
    """uint32 [..., 1]: per row of keys [..., V], the lowest key t in [its min, its max] for
    which holds(t) (bool [..., 1], monotone: false below some t, true from it on; true at the
    max), found by bisection in 32 fixed halvings (a uint32 range) over the row: no sort,
    and no step waits on the host."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        yes = holds(mid)
        return jnp.where(yes, lo, mid + 1), jnp.where(yes, mid, hi)

    bounds = (jnp.min(keys, axis=-1, keepdims=True), jnp.max(keys, axis=-1, keepdims=True))
    return jax.lax.fori_loop(0, 32, halve, bounds)[1]


def _filter(scores: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Top-k, top-p, then min-p (transformers' TopK/TopP/MinPLogitsWarper) without sorting the
    vocabulary.

    scores [..., V] -> scores with filtered entries set to -inf. Top-k keeps every score >=
    the k-th largest (ties included, as transformers does): the lowest key t with fewer than
    k scores above it. Top-p then removes the lowest scores whose probabilities sum to at
    most 1 - top_p, always keeping the largest: it keeps the scores >= the lowest key t whose
    scores <= t weigh more than 1 - top_p (a tie at that score is kept whole). Each cut is
    found by `_lowest` (2 x 32 masked reductions over V against a sort's V log V). Min-p keeps
    the scores whose probability is at least min_p times the largest: with scores shifted so
    that the largest is 0 (`warp`), those >= log(min_p)."""
    keys = _order_keys(scores)
    k = jnp.clip(top_k, 1, scores.shape[-1])
    kth = _lowest(keys, lambda t: jnp.sum(keys > t, axis=-1, keepdims=True) < k)
    scores = jnp.where((top_k > 0) & (keys < kth), -jnp.inf, scores)
    keys = _order_keys(scores)
    probs = jax.nn.softmax(scores, axis=-1)
    cutoff = _lowest(keys, lambda t: jnp.sum(jnp.where(keys <= t, probs, 0.0), axis=-1, keepdims=True) > 1.0 - top_p)
    scores = jnp.where((top_p < 1.0) & (keys < cutoff), -jnp.inf, scores)
    return jnp.where(scores < jnp.log(min_p), -jnp.inf, scores)  # log(0) = -inf: off


def add_bias(logits: jax.Array, ids: jax.Array, bias: jax.Array) -> jax.Array:
    """logits [B, ..., V] (or [..., V] with one bias for all) plus each row's sparse bias: ids
    int32 [B, Lb] (or [Lb]; -1 pads, adding nothing), bias float32 alike."""
    if ids.shape[-1] == 0:
        return logits
    ids = jnp.where(ids < 0, logits.shape[-1], ids)  # out of range: dropped
    add = lambda x, i, b: x.at[..., i].add(b, mode="drop")  # noqa: E731
    return add(logits, ids, bias) if ids.ndim == 1 else jax.vmap(add)(logits, ids, bias)


def argmax(x: jax.Array) -> jax.Array:
    """int32 [...]: the first index of the largest value along x's last axis [..., V], as
    jnp.argmax gives it (a NaN counts as largest). Two plain reductions (the maximum, then
    the lowest index holding it) instead of XLA's (value, index) pair reduction, which the
    CPU backend does not vectorise (measured in docs/bench/argmax.txt)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where((x == top) | jnp.isnan(x), index, x.shape[-1]), axis=-1)


@struct.dataclass
class History:
    """What the penalties read at scored positions: the row's tokens so far, as counts over
    the vocabulary, and each position's own path of tokens not yet emitted (a draft's nodes
    before it): plain decoding, had that path been emitted, would count them too. Over the
    target's vocabulary, or a reduced draft vocabulary's indices (`over`)."""

    counts: jax.Array  # int32 [B, V]: occurrences of each id in the row's output so far
    prompt: jax.Array  # bool [B, V]: the ids its prompt holds
    path: jax.Array | None = None  # int32 [B, T, A]: the path tokens before each of T positions (-1 pads)
    vocab: jax.Array | None = None  # int32 [Vd]: over a reduced vocabulary (counts and prompt over its indices)

    @classmethod
    def of(cls, tokens: jax.Array, prompt_length: jax.Array, length: jax.Array, vocab_size: int) -> "History":
        """Rows' history from their tokens int32 [B, S]: the prompt's are those before
        prompt_length [B], the output's those from there to length [B]."""
        B, S = tokens.shape
        at, rows = jnp.arange(S)[None, :], jnp.arange(B)[:, None]
        output = (at >= prompt_length[:, None]) & (at < length[:, None])
        counts = jnp.zeros((B, vocab_size), jnp.int32).at[rows, tokens].add(output.astype(jnp.int32), mode="drop")
        prompt = jnp.zeros((B, vocab_size), jnp.int32).at[rows, tokens].max(
            (at < prompt_length[:, None]).astype(jnp.int32), mode="drop")
        return cls(counts, prompt > 0)

    def at(self, path: jax.Array) -> "History":
        """The history at T positions whose paths hold tokens int32 [B, T, A] (target ids; -1
        pads)."""
        if self.vocab is not None:
            path = _index_in(self.vocab, path)
        return self.replace(path=path)

    def over(self, vocab: jax.Array) -> "History":
        """The history over a reduced vocabulary, vocab int32 [Vd] (increasing target ids)."""
        return self.replace(counts=self.counts[:, vocab], prompt=self.prompt[:, vocab], vocab=vocab,
                            path=None if self.path is None else _index_in(vocab, self.path))


def _index_in(vocab: jax.Array, ids: jax.Array) -> jax.Array:
    """Each of target ids int32 [...] as its index in vocab int32 [Vd] (increasing), or -1
    where it is not there (or is -1)."""
    at = jnp.minimum(jnp.searchsorted(vocab, ids), vocab.shape[0] - 1)
    return jnp.where((ids >= 0) & (vocab[at] == ids), at, -1).astype(jnp.int32)


def penalize(logits: jax.Array, sampling: Sampling, history: History) -> jax.Array:
    """logits [B, T, V] penalized as vLLM's `apply_penalties` (and transformers'
    RepetitionPenaltyLogitsProcessor) would after the tokens each position has seen: its
    row's `history` and its own path. Repetition: an id in the prompt or output has its
    logit divided by the penalty where positive, multiplied where not; then frequency times
    its count in the output and presence once if it occurs there are subtracted."""
    B, T, V = logits.shape
    counts = jnp.broadcast_to(history.counts[:, None, :], logits.shape)
    if history.path is not None and history.path.shape[-1]:
        path = jnp.where(history.path < 0, V, history.path)  # -1 pads: dropped
        counts = counts.at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], path].add(1, mode="drop")
    row = lambda x: _rows(x, 3)  # noqa: E731
    seen = counts > 0
    repetition = row(sampling.repetition)
    logits = jnp.where(seen | history.prompt[:, None, :],
                       jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - row(sampling.frequency) * counts - row(sampling.presence) * seen


def warp(logits: jax.Array, sampling: Sampling, history: History | None = None,
         allowed: jax.Array | None = None) -> jax.Array:
    """float32 logits [..., V] -> probabilities [..., V] that are actually sampled from.
    history: where logits are [B, T, V], what a filtered program's penalties read (None:
    none are applied). A row without penalties passes through them unchanged, bit for bit
    (x / 1, x * 1, x - 0); no branch skips them (a conditional waits on the host on a GPU).
    allowed: bool [..., V], the tokens a grammar allows (None: all), masked first (vLLM's
    order); only a filtered program's rows may be constrained."""
    logits = jnp.asarray(logits, jnp.float32)
    if sampling.kind == FILTERED:  # only a filtered program's rows may be biased or penalized (`kind_of`)
        if allowed is not None:
            logits = jnp.where(allowed, logits, -jnp.inf)
        logits = add_bias(logits, sampling.bias_ids, sampling.bias)
        if history is not None:
            logits = penalize(logits, sampling, history)
    one_hot = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
    if sampling.greedy:
        return one_hot
    row = lambda x: _rows(x, logits.ndim)  # noqa: E731
    temperature = row(sampling.temperature)
    greedy = temperature == 0
    # Shifted so that the largest score is 0 and the rest <= 0: a tiny temperature sends them
    # to -inf, never to +inf, and the softmax is one-hot on the argmax (ties shared), not
    # NaN. The temperature is clipped to [smallest normal float, 1e37], where it and its
    # reciprocal (XLA may multiply by it) are normal: a subnormal one flushed to 0 would
    # make -inf * 0 = NaN. Beyond either end the distribution is already at its limit.
    top = jnp.max(logits, axis=-1, keepdims=True)
    scores = (logits - top) / jnp.clip(temperature, jnp.finfo(jnp.float32).tiny, 1e37)
    if sampling.kind == FILTERED:  # a row without filters passes through unchanged
        scores = _filter(scores, row(sampling.top_k), row(sampling.top_p), row(sampling.min_p))
    return jnp.where(greedy, one_hot, jax.nn.softmax(scores, axis=-1))


MAX_LOGPROBS = 20  # top alternatives a token's logprobs may list (OpenAI's top_logprobs)
LOGPROBS_MODES = ("raw", "processed")


@struct.dataclass
class Logprobs:
    """What the target gave the emitted tokens: each token's log-probability and the top-n
    alternatives at its position (n static; 0: none)."""

    chosen: jax.Array  # float32 [..., J]
    top_ids: jax.Array  # int32 [..., J, n]: the n likeliest ids, likeliest first
    top: jax.Array  # float32 [..., J, n]: their log-probabilities


def logprobs(logits: jax.Array, tokens: jax.Array, sampling: Sampling, top: int, mode: str,
             history: History | None = None, allowed: jax.Array | None = None) -> Logprobs:
    """The log-probabilities of tokens int32 [B, J] under logits [B, J, V] (each token's row
    of the distribution it was drawn from), and the top `top` alternatives: "raw", of the
    model's own distribution (log_softmax of the logits, vLLM's raw_logprobs); "processed",
    of the one sampled from (`warp`: a grammar's mask (allowed), bias, penalties (history: at
    those J positions), temperature and filters applied; -inf where a filter removed a
    token; a greedy row's is 0 at the argmax)."""
    logits = logits.astype(jnp.float32)
    lp = (jax.nn.log_softmax(logits, axis=-1) if mode == "raw"
          else jnp.log(warp(logits, sampling, history, allowed)))
    chosen = jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(lp, top)
    return Logprobs(chosen, top_ids.astype(jnp.int32), top_lp)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Draws from probabilities [..., V] -> int32 [...] by inverting the CDF with one uniform
    per distribution (a tenth of the cost of Gumbel-max, which needs V random numbers); key
    [] or one per row [B] (`uniform`). Ids of zero probability are never drawn: the
    threshold is strictly positive."""
    u = uniform(key, probs.shape[:-1] + (1,))
    cdf = jnp.cumsum(probs, axis=-1)
    threshold = jnp.maximum(u * cdf[..., -1:], jnp.finfo(jnp.float32).tiny)
    index = jnp.sum(cdf < threshold, axis=-1)  # the first id whose cdf reaches the threshold
    return jnp.minimum(index, probs.shape[-1] - 1).astype(jnp.int32)
