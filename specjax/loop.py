"""The decoding step, and `generate`'s loop of it: autoregressive and speculative, one machinery.

Three programs over one state (`SlotState`: B rows, each its own request, every array's
logical axes declared, its rows on the axis named "batch"; `state_axes`): `prefill` turns
prompts into rows; `insert` writes rows into a live state (the engine's refill of a free
slot); `step` advances every live row by one verification pass. `generate_loop` is
prefill, then a `lax.while_loop` of that same step; the serving engine (specjax/serve) runs
the same step from its own loop. Everything per request is a per-row value: sampling
settings, stop ids, token budget, PRNG key (row b's step at length n draws from
fold_in(key_b, n): its samples depend on neither its slot nor its neighbours).

Invariant at the top of every step: row b holds `length[b]` final tokens in `tokens`; the
target's cache holds correct entries for positions < length[b] - 1 (the last token is in
no cache yet); entries at or beyond that are stale and masked by position, never cleared.

One step, all shapes fixed:
  1. the drafter proposes a token tree per row (a chain of K drafts is the tree where each
     node has one child): N tokens, their parents, which were proposed, and the
     distributions q they were drawn from (None when deterministic);
  2. the target scores [last token, the N nodes] in one pass, node i at position
     length-1+depth(i), seeing the prefix, its ancestors and itself; p is its warped
     distribution at all N+1 of them. A chain's pass writes its keys and values at their
     positions; a tree's writes none yet (they are pending). A drafter may add a
     `Branch` of tokens to the same pass (after the nodes, under its own mask, unseen by
     them; such a pass defers its writes like a tree's); it gets the target's logits for
     those back through `observe`;
  3. `acceptance.verify` walks each row's tree: it keeps the longest path the target
     agrees with (n nodes) and draws one token of the target's own (greedy: compares
     argmaxes, and p is never built);
  4. those n+1 tokens are written at each row's own offset and length += n+1 (cut at EOS
     and at max_new_tokens); a tree's root and accepted path have their keys/values
     written to the slots of their positions, slot length-1 on (`cache.commit`). Rolling
     back the rest is only this: a chain's rejected nodes lie beyond length-1, stale and
     masked, and the rest of a tree never reaches the cache (or, where the pass had to
     write it for a kernel that reads the whole cache, lies there stale likewise);
  5. a row that emitted one of its stop ids or reached its length limit is done: its state
     is frozen under masks while the other rows go on, and drafters are told. `generate`'s
     loop ends when every row is done.
Autoregressive decoding is the same step with an empty tree and no drafter.

The step knows drafters only through their interface (`specjax.drafters.Drafter`), and
nothing of tokenizers, files, request checks, memory or threads: `generate` (generate.py)
checks and prepares a call (request.py) before it reaches `generate_loop`, and the engine
owns its slots.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import io_callback

from specjax import acceptance, sharding, streams
from specjax.cache import KVCache, paste_row, tree_placement
from specjax.drafters.base import DraftRequest, Features, Proposal, Resume, verify_room
from specjax.backend import Backend
from specjax.grammar import Automaton
from specjax.models import Model, apply, commit
from specjax.models import prefill as models_prefill
from specjax.sampling import FILTERED, History, Logprobs, Sampling, fold_in, logprobs as token_logprobs
from specjax.tree import ancestors, depths, with_branch


@struct.dataclass
class Stats:
    steps: jax.Array  # int32 [B]: target verification passes the row took part in
    drafted: jax.Array  # int32 [B]: draft tokens proposed to the row
    accepted: jax.Array  # int32 [B]: draft tokens accepted and emitted in the row

    AXES = {"steps": ("batch",), "drafted": ("batch",), "accepted": ("batch",)}  # sharding.declared_axes


@struct.dataclass
class GenerateOutput:
    tokens: jax.Array  # int32 [B, max_new_tokens]: new tokens only; 0 after num_tokens[b]
    num_tokens: jax.Array  # int32 [B]: tokens generated, an emitted EOS included
    stats: Stats
    # int32 [B, max_new_tokens]: tokens each step emitted per row (0 once the row is done);
    # None unless generate(..., return_trace=True).
    trace: jax.Array | None = None
    # uint32: the data of the PRNG key the call sampled with (generate's `key`, or the fresh
    # one it drew when none was given); key=jax.random.wrap_key_data(out.key) reproduces the call.
    key: jax.Array | None = None
    # Each new token's log-probability [B, max_new_tokens] and top alternatives [B,
    # max_new_tokens, n] (0 past num_tokens[b]); None unless generate(..., logprobs=n).
    logprobs: Logprobs | None = None
    # Each prompt token's log-probability given those before it [B, P] and the top
    # alternatives there [B, P, n] (raw; 0 at position 0 and past lengths[b]); None unless
    # generate(..., prompt_logprobs=n).
    prompt_logprobs: Logprobs | None = None


@struct.dataclass
class SlotState:
    """B rows of decoding, each its own request (a slot). Each leaf's logical axes are
    declared (AXES below; the drafter's state by its drafter, `Drafter.state_axes`): rows are
    inserted (`insert`) and sharded (rows over data) by them (`state_axes`). Its own fields
    have the batch axis first. Sized by whoever builds it: `generate` for its call, the
    engine for its max_len and deepest draft."""

    tokens: jax.Array  # int32 [B, S]: prompt then generated tokens; slots >= length are junk
    length: jax.Array  # int32 [B]: final tokens per row (prompt + generated)
    limit: jax.Array  # int32 [B]: the row stops at this length (its prompt + its token budget)
    prompt_length: jax.Array  # int32 [B]: where its output begins (penalties count the output from here)
    target_cache: KVCache  # L x [B, G, S, D]; valid below length - 1
    draft_state: Any  # the drafter's own carry (e.g. its KV cache); None without a drafter
    sampling: Sampling  # [B] each: the row's temperature, top-k, top-p, min-p; its logit bias [B, Lb]
    stop_ids: jax.Array  # int32 [B, M]: the row stops after any of these (-1: none)
    key: jax.Array  # uint32 [B, 2]: the row's PRNG key's data; its step at length n uses fold_in(key, n)
    k_limit: jax.Array  # int32 [B]: how deep each row may draft next step (the depth unless adaptive)
    done: jax.Array  # bool [B]: finished (or an empty slot); frozen since
    stats: Stats
    features: Features | None = None  # the target's hidden states, for drafters that want them
    grammar: Automaton | None = None  # the rows' constraints (structured output), or None: none
    grammar_state: jax.Array | None = None  # int32 [B]: each row's state in it (grammar.FREE: none)

    # Each field's logical axes (sharding.declared_axes); draft_state's are its drafter's.
    AXES = {"tokens": ("batch", None), "length": ("batch",), "limit": ("batch",), "prompt_length": ("batch",),
            "target_cache": KVCache,
            "draft_state": None, "sampling": sharding.ROWS, "stop_ids": ("batch", None), "key": ("batch", None),
            "k_limit": ("batch",), "done": ("batch",), "stats": Stats, "features": Features, "grammar": Automaton,
            "grammar_state": ("batch",)}


@struct.dataclass
class StepOut:
    """What one step emitted: row b gained tokens[b, :count[b]]."""

    tokens: jax.Array  # int32 [B, D+1]: 0 past count
    count: jax.Array  # int32 [B]: 0 for rows that were done
    logprobs: Logprobs | None = None  # [B, D+1] (top [B, D+1, n]), where the step was asked for them


CACHE_MULTIPLE = 128  # caches of at least this many slots are rounded up to a multiple of it
SHORT_CACHE_MULTIPLE = 16  # shorter ones (tiny tests, short prompts) to a multiple of this


def cache_length(P: int, max_new_tokens: int, room: int) -> int:
    """The loop's cache length S for prompts [B, P]: P + max_new_tokens + room (a drafter's
    furthest write), rounded up to a multiple of CACHE_MULTIPLE (SHORT_CACHE_MULTIPLE below
    it) so that key blocks and hardware tiles divide it."""
    S = P + max_new_tokens + room
    m = CACHE_MULTIPLE if S >= CACHE_MULTIPLE else SHORT_CACHE_MULTIPLE
    return -(-S // m) * m


def is_stop(tokens: jax.Array, stop: jax.Array) -> jax.Array:
    """bool [B, T]: which of tokens int32 [B, T] are among their row's stop ids int32 [B, M]."""
    return (tokens[..., None] == stop[:, None, :]).any(axis=-1)


def row_keys(key: jax.Array, batch: int) -> jax.Array:
    """One PRNG key per row of a batch from one key: row b's is fold_in(key, b)."""
    return fold_in(jnp.broadcast_to(key, (batch,)), jnp.arange(batch, dtype=jnp.uint32))


def prefill(target: Model, drafter, prompts, lengths, *, cache_len: int, limit, sampling: Sampling,
            stop_ids, key, cache: KVCache | None = None, resume: Resume | None = None,
            prompt_lengths=None, score: int | None = None, grammar: Automaton | None = None, grammar_state=None):
    """Rows for these prompts (int32 [B, P] right-padded, lengths [B]): the target's cache (and
    the drafter's state) holding them, at cache length `cache_len` (>= P); limit int32 [B]:
    each row's length limit; sampling [B]; stop_ids int32 [B, M]; key [B]: each row's PRNG key.
    The drafter (None, or resolved and bound) sizes its state for its own depth, the deepest
    any step over these rows may draft. cache: the target's cache to write them into (a
    paged one, whose table places them); default a new one of cache_len slots a row.
    resume: None, or where the prefill resumes (`Resume`: the paged engine's admission of
    rows whose caches hold a cached prefix; resume.cache the drafter's cache of the rows):
    only positions resume.start .. + width - 1 are computed, into `cache` and the drafter's,
    which hold the positions before them already; start <= length - 2 (a drafter's
    features begin there). prompt_lengths: int32 [B], where each row's output begins
    (default its length; an engine's resumed row has output among its tokens already).
    score: None, or n (static): also return the prompt's `Logprobs` from the same pass
    (`GenerateOutput.prompt_logprobs`), as (state, logprobs). grammar: None, or the rows'
    constraints (an `Automaton`) and grammar_state int32 [B] each row's initial state in it."""
    B, P = prompts.shape
    S = cache_len
    D = 0 if drafter is None else drafter.tree.depth
    # The padded prompt block is written whole: slots past a row's length are stale and
    # will be overwritten before any query can see them. Long prompts go in chunks
    # (models.prefill); hidden [B, P, E] only for drafters that read it.
    wants_features = drafter is not None and drafter.wants_features
    cache = KVCache.init(target.config, B, S, target.dtype) if cache is None else cache
    taps = drafter.feature_layers if wants_features else None
    if resume is None:
        window, start, W = prompts, jnp.zeros((B,), jnp.int32), P
    else:  # the window of positions computed: [B, width]
        window = jnp.take_along_axis(prompts, jnp.minimum(resume.positions, P - 1), axis=1)
        start, W = resume.start, resume.width
    hidden, cache, *scored = models_prefill(target, window, cache, return_hidden=wants_features, taps=taps,
                                            start=None if resume is None else start, score=score)
    features, draft_state = None, None
    if wants_features:
        # The prompt's states up to position length-2, the last one a drafter may read now.
        first = lengths - 2
        at = jnp.clip(first[:, None] - start[:, None] + jnp.arange(D + 1)[None, :], 0, W - 1)  # [B, D+1]
        features = Features(jnp.take_along_axis(hidden, at[..., None], axis=1), first)
    if drafter is not None:
        resumed = {} if resume is None or not drafter.keeps_cache else {"resume": resume}
        draft_state = drafter.start(target, prompts, lengths, S, hidden=hidden if wants_features else None, **resumed)
    zeros = jnp.zeros((B,), jnp.int32)
    state = SlotState(
        tokens=jnp.zeros((B, S), jnp.int32).at[:, :P].set(prompts), length=lengths,
        limit=jnp.asarray(limit, jnp.int32), target_cache=cache.replace(lengths=lengths - 1),
        prompt_length=jnp.asarray(lengths if prompt_lengths is None else prompt_lengths, jnp.int32),
        draft_state=draft_state, sampling=sampling, stop_ids=jnp.asarray(stop_ids, jnp.int32), key=jax.random.key_data(key),
        k_limit=jnp.full((B,), D, jnp.int32), done=jnp.zeros((B,), bool), stats=Stats(zeros, zeros, zeros),
        features=features, grammar=grammar,
        grammar_state=None if grammar is None else jnp.asarray(grammar_state, jnp.int32))
    state_axes(state, drafter)  # a drafter's state whose declared axes do not fit it fails here, mesh or none
    if score is None:
        return state
    at = start[:, None] + jnp.arange(W)[None, :]  # [B, W]: position i's is token i's given those before it

    def own(x):  # next-token form -> own-token form
        x = jnp.pad(x[:, :-1], ((0, 0), (1, 0)) + ((0, 0),) * (x.ndim - 2))
        keep = (at >= 1) & (at < lengths[:, None])
        return jnp.where(keep.reshape(keep.shape + (1,) * (x.ndim - 2)), x, 0)

    return state, jax.tree.map(own, scored[0])


def state_axes(state: SlotState, drafter) -> SlotState:
    """The logical axes of `state`'s arrays (a SlotState of `sharding.Axes`): its own fields'
    as SlotState.AXES declares them, the drafter's state's as the drafter does
    (`Drafter.state_axes`), checked against the state's structure and ranks (an error names
    the drafter and the field). Read at trace time; costs nothing in a program."""
    axes = sharding.declared_axes(state.replace(draft_state=None), "the loop's state")
    sharding.check_axes(state.replace(draft_state=None), axes, "the loop's state")
    if state.draft_state is None:
        return axes
    owner = f"{type(drafter).__name__}'s state"
    draft = drafter.state_axes(state.draft_state)
    sharding.check_axes(state.draft_state, draft, owner)
    return axes.replace(draft_state=draft)


def take_rows(x, axes: sharding.Axes, start: int, stop: int):
    """Rows start..stop-1 of one array on its row axis (`Axes.row_axis`); an array all rows
    share (no row axis) whole."""
    at = axes.row_axis
    return x if at is None else jax.lax.slice_in_dim(x, start, stop, axis=at)


def write_rows(big, new, axes: sharding.Axes, start):
    """`big` with `new`'s rows written from row `start` (int, or int32 []) on its row axis, at
    the start of its other axes (new may be shorter on them); an array all rows share is
    `new`'s."""
    at = axes.row_axis
    if at is None:
        return new
    return jax.lax.dynamic_update_slice(big, new, tuple(start if i == at else 0 for i in range(big.ndim)))


def scatter_rows(big, new, axes: sharding.Axes, slots):
    """`big` with `new`'s row i written at row slots[i] (int32 [n], distinct) on its row axis,
    at the start of its other axes (new may be shorter on them): one scatter."""
    at = axes.row_axis
    rows, values = jnp.moveaxis(big, at, 0), jnp.moveaxis(new, at, 0)
    index = (slots,) + tuple(slice(0, d) for d in values.shape[1:])
    return jnp.moveaxis(rows.at[index].set(values.astype(rows.dtype)), 0, at)


def is_cache(x) -> bool:
    """Whether a state's leaf (taken with `is_leaf=is_cache`) is a KVCache."""
    return isinstance(x, KVCache)


def caches(state) -> list[KVCache]:
    """Every KVCache a state holds (the target's, a draft model's, an EAGLE layer's)."""
    return [x for x in jax.tree.leaves(state, is_leaf=is_cache) if is_cache(x)]


def insert(state: SlotState, slot, row: SlotState, drafter, pages=None) -> SlotState:
    """`state` with `row` (one row, from `prefill`) written into its row `slot` (int32 []),
    each array on the row axis its declared axes name (`state_axes`; drafter: the one whose
    state the rows carry); an array all rows share keeps the state's. The row's array may
    be shorter than the state's on its other axes (a cache prefilled at its prompt's
    bucket, not at the state's length) and is written at their start: what lies past it is
    stale by the loop's invariant (masked by position, overwritten before read). Nothing
    else moves. pages: where the state's caches are paged, the row's page table int32 [M]:
    each of the row's caches goes into those pages of its pool (`cache.paste_row`)."""
    if jax.tree.structure(state, is_leaf=is_cache) != jax.tree.structure(row, is_leaf=is_cache):
        raise ValueError("the row was prefilled for another drafter (or none) than the state's")

    def one(big, small, axes):
        if isinstance(big, KVCache) and big.pages is not None:
            return paste_row(big, slot, small, pages)
        return jax.tree.map(lambda b, s, a: b if a.row_axis is None else write_rows(b, s, a, slot), big, small, axes)

    return jax.tree.map(one, state, row, state_axes(state, drafter), is_leaf=is_cache)


def resumed_views(state: SlotState, slots, table, start):
    """(the target's cache, the drafter's own cache or None) of a paged state's rows `slots`
    int32 [n] for a prefill that resumes at start int32 [n] (`prefill`'s resume): the state's
    pools, the rows' tables table[slots] (table: int32 [B, M], the host's), lengths start."""
    def view(cache):
        return cache.replace(pages=table[slots], lengths=start, tree=None)
    own = caches(state.draft_state)
    return view(state.target_cache), view(own[0]) if own else None


def admit(state: SlotState, slots, rows: SlotState, drafter, table) -> SlotState:
    """A paged `state` with `rows` (n rows, from a `prefill` that resumed into the state's own
    pools: `resumed_views`) in its rows slots int32 [n]: the rows' arrays written at their
    slots (`scatter_rows`: one scatter an array, whatever n: none of them is a cache's
    buffer, so nothing large is copied, and the program does not grow with n), the caches'
    pools the rows' (which hold their new entries and every other row's), their lengths at
    the slots, and every cache's table the host's, table int32 [B, M]."""
    if jax.tree.structure(state, is_leaf=is_cache) != jax.tree.structure(rows, is_leaf=is_cache):
        raise ValueError("the rows were prefilled for another drafter (or none) than the state's")

    def one(big, small, axes):
        if is_cache(big):
            return big.replace(k=small.k, v=small.v, lengths=big.lengths.at[slots].set(small.lengths), pages=table)
        return jax.tree.map(lambda b, s, a: b if a.row_axis is None else scatter_rows(b, s, a, slots), big, small,
                            axes)

    return jax.tree.map(one, state, rows, state_axes(state, drafter), is_leaf=is_cache)


def with_pools(state: SlotState, rows: SlotState) -> SlotState:
    """`state` with every cache's pools taken from `rows`' (a `prefill` that resumed into the
    state's pools, `resumed_views`): its entries written, nothing else of the rows kept."""
    pools = iter(caches(rows))
    return jax.tree.map(lambda x: x.replace(k=(c := next(pools)).k, v=c.v) if is_cache(x) else x, state,
                        is_leaf=is_cache)


def paged(state: SlotState, num_pages: int, page_size: int, table_width: int) -> SlotState:
    """The state with every cache it holds (the target's, a draft model's, an EAGLE layer's)
    in pools of num_pages pages of page_size slots, every row's table of table_width pages
    the null page (`KVCache.in_pages`): what a paged engine's empty state is."""
    return jax.tree.map(lambda x: x.in_pages(num_pages, page_size, table_width) if is_cache(x) else x, state,
                        is_leaf=is_cache)


def page_table(state: SlotState):
    """A paged state's page table int32 [B, M] (every cache reads the same one); None unpaged."""
    paged = [c.pages for c in caches(state) if c.pages is not None]
    return paged[0] if paged else None


def with_pages(state: SlotState, pages) -> SlotState:
    """A paged state whose every cache reads the page table pages int32 [B, M] (one table:
    a row's page ids index each cache's own pool)."""
    return jax.tree.map(lambda x: x.replace(pages=pages) if is_cache(x) else x, state, is_leaf=is_cache)


def step(target: Model, drafter, state: SlotState, threshold, *, adaptive_k: bool = False,
         logprobs: tuple[int, str] | None = None) -> tuple[SlotState, StepOut]:
    """Every live row of `state` advances by one verification pass (a drafter's tree, or its
    own next token when drafter is None: then the state's drafter state, if any, is carried
    untouched and catches up when drafting resumes). drafter: resolved and bound, at most
    as deep as the state was sized for. threshold: float32 [] (see `generate`).
    logprobs: None, or (top, mode): each new token's log-probability (and the top
    alternatives) from the pass's logits at the position that scored it (`sampling.logprobs`):
    what plain decoding's pass at that position gives."""
    B, S = state.tokens.shape  # S: the cache's length (`cache_length`)
    N, D = (0, 0) if drafter is None else (drafter.tree.nodes, drafter.tree.depth)
    V = target.config.vocab_size
    rows = jnp.arange(B)[:, None]  # [B, 1]
    offsets = jnp.arange(D + 1)[None, :]  # [1, D+1]: a path of up to D nodes, then the target's token
    length, active = state.length, ~state.done
    key = fold_in(jax.random.wrap_key_data(state.key), length)  # [B]: the row's key at its position, whatever its slot or K
    draft_key, accept_key = fold_in(key, 0), fold_in(key, 1)
    # What penalties read: only a filtered program's rows may have any (`sampling.kind_of`).
    history = None if state.sampling.kind != FILTERED else History.of(
        state.tokens, state.prompt_length, length, V)
    # A constrained row's call is of the filtered kind (`warp` masks): others leave the states be.
    grammar = state.grammar if state.sampling.kind == FILTERED else None
    if drafter is None:
        draft_state, cache = state.draft_state, state.target_cache
        proposal = Proposal(jnp.zeros((B, 0), jnp.int32), np.zeros((0,), np.int32), jnp.zeros((B, 0), bool), None)
    else:
        draft_state, cache, proposal = drafter.propose(state.draft_state, DraftRequest(
            target=target, target_cache=state.target_cache, tokens=state.tokens, length=length,
            done=state.done, key=draft_key, sampling=state.sampling, k_limit=state.k_limit,
            threshold=threshold, features=state.features, history=history, grammar=grammar,
            grammar_state=state.grammar_state))
    valid = proposal.valid & active[:, None]  # [B, N]

    # Verify: one target pass over [last token, the N nodes], node i at slot
    # length-1+i and position length-1+depth(i). A fixed tree's masks are constants;
    # a chain needs none beyond the causal one.
    parents, branch = proposal.parents, proposal.branch
    ancestor = ancestors(parents)  # [N+1, N+1], or [B, N+1, N+1] per row
    depth = depths(ancestor)  # [N+1] or [B, N+1]
    chain = acceptance.is_chain(parents, N) and branch is None
    last = state.tokens[rows[:, 0], length - 1]
    verify = jnp.concatenate([last[:, None], proposal.tokens]
                             + ([] if branch is None else [branch.tokens]), axis=1)  # [B, T]
    T = verify.shape[1]  # N+1, then the branch's X tokens if a drafter asked for them
    offsets_all, sees = (depth, ancestor) if branch is None else with_branch(depth, ancestor, branch)
    start = length - 1  # the root's slot
    placement = None if chain else tree_placement(start, offsets_all, jnp.broadcast_to(sees, (B, T, T)))
    # A chain's pass writes its nodes where they lie (the rejected ones go stale); a tree's
    # writes none, and its root and accepted path are committed after acceptance.
    logits, hidden, cache, *pending = apply(target, verify, start[:, None] + offsets_all, cache, placement=placement,
                                            taps=None if drafter is None else drafter.feature_layers, defer=not chain)
    if branch is not None:  # the drafter reads the target's logits for its branch
        draft_state = drafter.observe(draft_state, logits[:, N + 1:], active)
        logits = logits[:, : N + 1]
    # Node i is penalized as if the nodes on its path (itself included) had been emitted.
    node_paths = None if history is None else jnp.where(ancestor[..., 1:], proposal.tokens[:, None, :], -1)  # B,N+1,N
    # Node i's distribution allows what the state its path reaches does.
    allowed = None if grammar is None else grammar.allows(grammar.walk(state.grammar_state, proposal.tokens,
                                                                       parents, D), V)  # [B, N+1, V]
    n, path, extra = acceptance.verify(accept_key, proposal.tokens, parents, valid, proposal.q, logits,
                                       state.sampling, D, target.runs_on.platform,
                                       None if history is None else history.at(node_paths), allowed)
    if pending:  # the root and the path's nodes to the slots of their positions
        kept = jnp.pad(path, ((0, 0), (1, 0)))  # [B, D+1]: the root, then the node at depth j (past n: stale)
        cache = commit(target, cache, pending[0], kept, start)

    # The row's new tokens: the path's then the target's own; cut after a stop id and at the
    # row's length limit; nothing for rows already done.
    path_tokens = jnp.take_along_axis(verify, path, axis=1)  # [B, D]
    new = jnp.where(offsets < n[:, None], jnp.pad(path_tokens, ((0, 0), (0, 1))), extra[:, None])
    count = n + 1
    stop_at = is_stop(new, state.stop_ids) & (offsets < count[:, None])
    count = jnp.where(stop_at.any(axis=1), jnp.argmax(stop_at, axis=1) + 1, count)
    count = jnp.minimum(count, state.limit - length)
    count = jnp.where(active, count, 0)
    keep = offsets < count[:, None]
    tokens = state.tokens.at[rows, jnp.where(keep, length[:, None] + offsets, S)].set(new, mode="drop")
    new_length = length + count
    done = state.done | (stop_at & keep).any(axis=1) | (new_length >= state.limit)

    stats = Stats(steps=state.stats.steps + active.astype(jnp.int32),
                  drafted=state.stats.drafted + valid.sum(axis=1),
                  accepted=state.stats.accepted + jnp.minimum(n, count))
    k_limit = state.k_limit
    if adaptive_k:  # transformers' heuristic: +2 after a clean sweep, -1 after a rejection
        reach = jnp.max(jnp.where(valid, depth[..., 1:], 0), axis=1, initial=0)  # deepest proposed
        grown = jnp.where(n >= reach, k_limit + 2, k_limit - 1)
        k_limit = jnp.where(active, jnp.clip(grown, 1, D), k_limit)
    features = state.features
    if features is not None and drafter is not None:  # the root's state, then the path's
        kept = jnp.take_along_axis(hidden, jnp.pad(path, ((0, 0), (1, 0)))[..., None], axis=1)  # [B, D+1, F]
        width = features.hidden.shape[1]  # the state's deepest draft + 1
        features = Features(jnp.pad(kept, ((0, 0), (0, width - (D + 1)), (0, 0))).astype(features.hidden.dtype),
                            start)
    new_state = state.replace(tokens=tokens, length=new_length, target_cache=cache.replace(lengths=new_length - 1),
                              draft_state=draft_state, k_limit=k_limit, done=done, stats=stats, features=features,
                              grammar_state=state.grammar_state if grammar is None
                              else grammar.run(state.grammar_state, new, count))
    scored = None
    if logprobs is not None:  # new token j was scored at the root (j = 0), else at the path's node at depth j
        at = jnp.pad(path, ((0, 0), (1, 0)))  # [B, D+1]
        seen = None if history is None else history.at(jnp.take_along_axis(node_paths, at[..., None], axis=1))
        scored = token_logprobs(jnp.take_along_axis(logits, at[..., None], axis=1), new, state.sampling, *logprobs,
                                history=seen, allowed=None if allowed is None else jnp.take_along_axis(
                                    allowed, at[..., None], axis=1))
    return new_state, StepOut(tokens=jnp.where(keep, new, 0), count=count, logprobs=scored)


def state_shardings(state: SlotState, drafter, mesh, rules) -> SlotState:
    """Where each array of a state (arrays, or shapes alone) lies on a mesh, by its declared
    axes (`state_axes`): the loop's fields by `rules` (rows over data, the target cache's
    heads over model), the drafter's state by the drafter's (`Drafter.state_rules`)."""
    axes = state_axes(state, drafter)
    own = sharding.carry_sharding(state.replace(draft_state=None), axes.replace(draft_state=None), mesh, rules)
    if state.draft_state is None:
        return own
    return own.replace(draft_state=sharding.carry_sharding(
        state.draft_state, axes.draft_state, mesh, drafter.state_rules(rules), f"{type(drafter).__name__}'s state"))


def place(state: SlotState, drafter, mesh, rules) -> SlotState:
    """Pins a state's layout on a mesh (`state_shardings`)."""
    if mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, state_shardings(state, drafter, mesh, rules))


def initial_state(target: Model, drafter, prompts, lengths, key, max_new_tokens: int,
                  sampling: Sampling | None = None, eos=None, score: int | None = None, grammar=None,
                  grammar_state=None):
    """`generate`'s state before its first step: its prompts prefilled, each row with the
    call's settings (greedy and no stop ids where none are given) and its own key from
    `key` (`row_keys`); traced inside `generate_loop` (and by `jax.eval_shape` where only
    its shapes are wanted: budget.py). score, grammar, grammar_state: `prefill`'s (with a
    score: (state, prompt logprobs))."""
    B, P = prompts.shape
    sampling = Sampling.make(batch=B) if sampling is None else sampling
    eos = jnp.full((4,), -1, jnp.int32) if eos is None else jnp.reshape(eos, (-1,))
    return prefill(target, drafter, prompts, lengths, cache_len=cache_length(P, max_new_tokens, verify_room(drafter)),
                   limit=lengths + max_new_tokens, sampling=sampling.rows(B),
                   stop_ids=jnp.broadcast_to(eos, (B,) + eos.shape), key=row_keys(key, B), score=score,
                   grammar=grammar, grammar_state=grammar_state)


def bound(backend: Backend, target: Model, drafter=None):
    """The target and the drafter (or None) bound to the backend of the program being built
    (`Model.on`, `Drafter.on`): what every program that runs them does first."""
    return target.on(backend), None if drafter is None else drafter.on(backend)


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "return_trace", "adaptive_k", "backend", "rules",
                                             "logprobs", "prompt_logprobs"))
def generate_loop(target: Model, drafter, prompts, lengths, key, sampling: Sampling, eos, threshold,
                  grammar: Automaton | None = None, grammar_state=None, *, max_new_tokens: int, return_trace: bool,
                  adaptive_k: bool,
                  backend: Backend, rules, stream=None, logprobs: tuple[int, str] | None = None,
                  prompt_logprobs: int | None = None) -> GenerateOutput:
    """The whole generation, compiled: `prefill`, then `step` until every row is done.
    drafter: None or a resolved, bound `Drafter`; eos: int32 [N] stop ids padded with -1;
    stream: None, or int32 [] (a handle of `streams`; being None or not is part of the jit
    key, so None costs nothing). backend: where the program runs (its platform's attention
    kernels and matmul forms; on a mesh, rows over data and the rules' layout), which the
    models are bound to (`bound`). logprobs: None, or `step`'s (top, mode); prompt_logprobs:
    None, or `prefill`'s score. grammar, grammar_state: `prefill`'s."""
    target, drafter = bound(backend, target, drafter)
    mesh = backend.mesh
    state = initial_state(target, drafter, prompts, lengths, key, max_new_tokens, sampling, eos, prompt_logprobs,
                          grammar, grammar_state)
    state, prompt_scored = state if prompt_logprobs is not None else (state, None)
    B = state.tokens.shape[0]
    trace = jnp.zeros((B, max_new_tokens), jnp.int32) if return_trace else None
    scored = None if logprobs is None else Logprobs(
        jnp.zeros((B, max_new_tokens)), jnp.zeros((B, max_new_tokens, logprobs[0]), jnp.int32),
        jnp.zeros((B, max_new_tokens, logprobs[0])))

    def body(carry):
        state, i, trace, scored = carry
        before = state.length
        state, out = step(target, drafter, state, threshold, adaptive_k=adaptive_k, logprobs=logprobs)
        if trace is not None:
            trace = trace.at[:, i].set(out.count)
        if scored is not None:  # each kept token's at its offset among the row's new tokens
            j = jnp.arange(out.tokens.shape[1])[None, :]
            at = jnp.where(j < out.count[:, None], before[:, None] - lengths[:, None] + j, max_new_tokens)
            scored = jax.tree.map(lambda buf, x: buf.at[jnp.arange(B)[:, None], at].set(x, mode="drop"),
                                  scored, out.logprobs)
        if stream is not None:  # the host receives the step's kept tokens, steps in order
            io_callback(streams.to_host, None, stream, out.tokens, out.count, ordered=True)
        return place(state, drafter, mesh, rules), i + 1, trace, scored

    carry = (place(state, drafter, mesh, rules), jnp.zeros((), jnp.int32), trace, scored)
    state, _, trace, scored = jax.lax.while_loop(lambda c: ~jnp.all(c[0].done), body, carry)

    rows = jnp.arange(B)[:, None]
    num_tokens = state.length - lengths
    cols = jnp.arange(max_new_tokens)[None, :]
    out = state.tokens[rows, lengths[:, None] + cols]
    out = jnp.where(cols < num_tokens[:, None], out, 0)
    return GenerateOutput(tokens=out, num_tokens=num_tokens, stats=state.stats, trace=trace,
                          key=jax.random.key_data(key), logprobs=scored, prompt_logprobs=prompt_scored)
