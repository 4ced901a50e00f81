"""The engine's compiled programs over one `SlotState` of `slots` rows: the empty state,
prefill of a group of waiting requests per prompt-length bucket, insert, release, and `run`:
several steps of loop.py's `step` at one static K per device call, over the state's first
rows (a few widths: a step costs by its rows), and `sync`: the draft's catch-up after calls
at K = 0. Their number is bounded and fixed at construction (`Programs.listing`): one
prefill per bucket and group size, one run per K, width and sampling kind, never one per
request; widths and group sizes are at most five (shapes.py), so the set does not grow
with slots.

This module knows shapes and the step's arguments; nothing of requests, queues or threads
(engine.py), and nothing of what the step computes (loop.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax import loop
from specjax.backend import Backend
from specjax.drafters.base import Resume, grow_cache_length, verify_room
from specjax.grammar import FREE, Automaton, Capacity
from specjax.serve import timing
from specjax.serve.pages import NULL_PAGE
from specjax.serve.rows import first_rows, written_back
from specjax.serve.scoring import prompt_logprobs, score_bytes
from specjax.serve.shapes import MIN_BUCKET, buckets, spread
from specjax.memory import nbytes
from specjax.sampling import FILTERED, KINDS, Logprobs, Sampling, Settings, stack

# The most prompt tokens one prefill of several requests holds (n requests x their bucket):
# its rows' caches are dense until inserted, so a group bounds what a prefill holds beside
# the state (a long prompt goes alone; 64 slots of 8K-token prompts would be 64 GiB of an 8B's).
GROUP_TOKENS = 4096


class Emitted(NamedTuple):
    """What a run call gives the host (`Programs.run`), each a copy it may read while the
    state is donated to the next call."""

    tokens: jax.Array  # int32 [steps, width, D+1]: what each step emitted per row
    counts: jax.Array  # int32 [steps, width]: how many of them
    taken: jax.Array  # int32 []: steps the call ran
    done: jax.Array  # bool [width]: rows finished (or empty) after it
    held: jax.Array  # int32 [width]: positions below which every cache of the row holds its final entries
    logprobs: Logprobs | None = None  # [steps, width, D+1] (top: [.., n]) where the call scored them


def _as_kind(sampling: Sampling, kind: str = FILTERED) -> Sampling:
    """The rows' settings read as `kind`: the state holds them as FILTERED (its structure
    never changes); a run program reads them as the kind its live rows need (static)."""
    return sampling.replace(kind=kind)


@functools.partial(jax.jit, static_argnames=("slots", "cache_len", "stop_width", "bias_width", "backend", "rules",
                                             "paging", "grammar"))
def _empty(target, drafter, *, slots: int, cache_len: int, stop_width: int, bias_width: int, backend: Backend, rules,
           paging: tuple | None = None, grammar: Capacity | None = None):
    """A state of `slots` empty rows (done, so no step touches them): a prefill of one token
    per row, so that its structure is exactly what `prefill` gives an inserted row.
    paging: None, or (pages, page size, table width): every cache of the state (the target's,
    the drafter's) in a pool of pages, every row's table the null page (serve/pages.py).
    grammar: None, or the `Capacity` each row's grammar may hold (all free)."""
    target, drafter = loop.bound(backend, target, drafter)
    automaton = None if grammar is None else Automaton.free(slots, target.config.vocab_size, grammar)
    state = loop.prefill(
        target, drafter, jnp.zeros((slots, 1), jnp.int32), jnp.ones((slots,), jnp.int32),
        cache_len=cache_len, limit=jnp.ones((slots,), jnp.int32), sampling=stack([Settings()] * slots, bias_width),
        stop_ids=jnp.full((slots, stop_width), -1, jnp.int32), key=loop.row_keys(jax.random.key(0), slots),
        grammar=automaton, grammar_state=None if automaton is None else jnp.full((slots,), FREE, jnp.int32))
    if paging is not None:  # (the row buffers above are then never made: nothing reads them)
        state = loop.paged(state, *paging)
    return loop.place(state.replace(done=jnp.ones((slots,), bool)), drafter, backend.mesh, rules)


@functools.partial(jax.jit, static_argnames=("cache_len", "backend"))
def _prefill(target, drafter, prompt, length, limit, sampling, stop_ids, seed, prompt_length, grammar, grammar_state,
             *, cache_len: int, backend: Backend):
    """n requests' rows: prompts int32 [n, P], their lengths and limits int32 [n], seeds
    uint32 [n], settings [n] each, stop ids [n, M], where their outputs begin int32 [n]
    (a resumed request's prompt holds output already), their grammars (an `Automaton` of n
    rows, or None) and states there; row i's key is generate's row 0 of key(seed[i]), as if
    it were prefilled alone. backend: unsharded (its rows are placed by `insert_rows`)."""
    target, drafter = loop.bound(backend, target, drafter)
    return loop.prefill(target, drafter, prompt, length, cache_len=cache_len, limit=limit, sampling=sampling,
                        stop_ids=stop_ids, key=_seed_keys(seed), prompt_lengths=prompt_length, grammar=grammar,
                        grammar_state=grammar_state)


def _seed_keys(seed):
    """Each row's PRNG key from its seed (uint32 [n]): generate's row 0 of key(seed[i]), as if
    the row were prefilled alone."""
    return jax.vmap(lambda s: loop.row_keys(jax.random.key(s), 1)[0])(seed)


def _prefill_into(target, drafter, state, slots, prompts, start, length, table, width: int, backend: Backend,
                  **settings):
    """(the bound drafter, `loop.prefill`'s rows) for the state's rows `slots`, positions
    start .. start + width - 1 of their prompts computed straight into the state's own pools
    (`loop.resumed_views`); settings: prefill's limit, sampling, stop_ids and key."""
    target, drafter = loop.bound(backend, target, drafter)
    cache, draft_cache = loop.resumed_views(state, slots, table, start)
    return drafter, loop.prefill(target, drafter, prompts, length, cache_len=state.tokens.shape[1], cache=cache,
                                 resume=Resume(draft_cache, start, width), **settings)


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("mesh", "rules", "unrolled"))
def insert_rows(state, slots, rows, state_drafter, table=None, *, mesh, rules, unrolled: bool = True):
    """`state` with rows i (of `prefill`'s n) written into its rows slots[i] (int32 [n]).
    unrolled: n dynamic_update_slices per leaf, the form a TPU writes in place (see
    cache.write: around a scatter XLA copies the whole buffer); else (a CPU's, a GPU's,
    unpaged) one scatter a leaf (`loop.scatter_rows`): the program does not grow with n.
    Each array's rows lie on the axis its declared axes name (`loop.state_axes`). table: a
    paged target cache's whole page table int32 [slots, M], as the host holds it (the rows'
    pages, every other row's, a free row's null pages): a row's prefilled entries go to its
    pages, and the state's table becomes this one."""
    if not unrolled and table is None:
        state = jax.tree.map(lambda b, s, a: b if a.row_axis is None else loop.scatter_rows(b, s, a, slots), state,
                             rows, loop.state_axes(state, state_drafter))
        return loop.place(state, state_drafter, mesh, rules)
    axes = loop.state_axes(rows, state_drafter)
    for i in range(slots.shape[0]):
        row = jax.tree.map(lambda x, a: loop.take_rows(x, a, i, i + 1), rows, axes)
        state = loop.insert(state, slots[i], row, state_drafter, None if table is None else table[slots[i]])
    if table is not None:
        state = loop.with_pages(state, table)
    return loop.place(state, state_drafter, mesh, rules)


@functools.partial(jax.jit, donate_argnums=2, static_argnames=("width", "backend", "rules"))
def admit_rows(target, drafter, state, slots, prompts, start, length, limit, sampling, stop_ids, seed, prompt_length,
               grammar, grammar_state, table, *, width: int, backend: Backend, rules):
    """A paged state with n waiting requests prefilled straight into its pages and placed in
    its rows slots int32 [n]: prompts int32 [n, S] (each request's tokens, S the state's
    token buffer), of which positions start[i] .. start[i] + width - 1 are computed (its
    pages hold the ones before: a cached prefix), lengths and limits int32 [n], settings [n]
    each, stop ids [n, M], seeds uint32 [n] (row i's key as `_prefill`'s), where outputs
    begin int32 [n], grammars and states (`_prefill`'s); table: the whole
    page table int32 [slots, M] as the host holds it, the rows' pages included. No row of
    its own is made: the pass writes the state's pools in place."""
    drafter, rows = _prefill_into(target, drafter, state, slots, prompts, start, length, table, width, backend,
                                  limit=limit, sampling=sampling, stop_ids=stop_ids, key=_seed_keys(seed),
                                  prompt_lengths=prompt_length, grammar=grammar, grammar_state=grammar_state)
    return loop.place(loop.admit(state, slots, rows, drafter, table), drafter, backend.mesh, rules)


@functools.partial(jax.jit, donate_argnums=2, static_argnames=("width", "backend"))
def _prefill_chunk(target, drafter, state, slots, prompts, start, length, table, *, width: int, backend: Backend):
    """A paged state with positions start[i] .. start[i] + width - 1 of n requests' prompts
    (`admit_rows`'s arguments) written into their pages: a chunk of a long prompt, its rows not
    live yet (the state's own table keeps their pages away from every step until `admit_rows`
    places them). Only the caches' pools change."""
    n = slots.shape[0]  # (the rows' settings are placeholders: only the pools are kept)
    _, rows = _prefill_into(target, drafter, state, slots, prompts, start, length, table, width, backend,
                            limit=length, sampling=_as_kind(Sampling.make(batch=n)),
                            stop_ids=jnp.full((n, 1), -1, jnp.int32), key=loop.row_keys(jax.random.key(0), n))
    return loop.with_pools(state, rows)


@functools.partial(jax.jit, donate_argnums=1, static_argnames=("width", "backend"))
def _catch_up(drafter, state, tokens, start, table, *, width: int, backend: Backend):
    """A paged state whose draft model's cache holds positions start .. start + width - 1 of
    a row's tokens int32 [1, S], written into its pages (table int32 [1, M]); nothing else
    changes. A row the draft did not follow (calls at K = 0) made cacheable as it ends."""
    _, view = loop.resumed_views(state, np.zeros((1,), np.int32), table, start)
    pools = drafter.on(backend).start(None, tokens, start + 1, 0, resume=Resume(view, start, width)).cache
    return state.replace(draft_state=state.draft_state.replace(cache=state.draft_state.cache.replace(k=pools.k,
                                                                                                     v=pools.v)))


@functools.partial(jax.jit, donate_argnums=0)
def _set_table(state, table):
    """A paged state with the page table int32 [slots, M] the host holds now."""
    return loop.with_pages(state, table)


@functools.partial(jax.jit, donate_argnums=0)
def _release(state, free):
    """Marks rows free (bool [B]) done: a cancelled request's slot stops at once."""
    return state.replace(done=state.done | free)


@functools.partial(jax.jit, static_argnames=("steps", "open_steps", "width", "kind", "backend", "rules", "logprobs"),
                   donate_argnums=3)
def run_steps(target, drafter, state_drafter, full, threshold, limit, *, steps: int, open_steps: int, width: int,
              kind: str, backend: Backend, rules, logprobs: tuple[int, str] | None = None):
    """Up to `limit` (int32 [], at most `steps`) steps of the state's first `width` rows
    (every live row lies among them; a step costs by its rows, so one live request does not
    pay for eight), and at most `open_steps` when a slot is free as the call starts; fewer
    when those rows are all done. A row that finishes stays frozen to the call's end: the
    host learns of it a call late (it dispatched the next call first), so ending there would
    only add a round trip. A request that arrives during a call waits at most `open_steps`
    steps for a free slot.
    kind: the sampling kind its live rows need (`sampling.kind_of`). The drafter's state must
    be within one window of the rows (`_sync` after calls at K = 0), so its steps hold no loop.
    A paged row that is done as the call starts (a free slot, a finished or cancelled
    request's, a long prompt's being prefilled a chunk a call) writes only to the null page
    during the call, whatever its table names: the pages the host gave someone else are
    never written by it.
    Returns (state, `Emitted`). drafter: this K's (None: no drafting); state_drafter: the
    drafter whose state the rows carry (the deepest), whose rules lay it out on a mesh
    whatever K runs. logprobs: None, or `loop.step`'s (top, mode): then `Emitted.logprobs`."""
    target, drafter = loop.bound(backend, target, drafter)
    mesh = backend.mesh
    in_place = backend.platform != "gpu"  # see rows.first_rows
    axes = loop.state_axes(full, state_drafter)  # where each array's rows lie
    state = first_rows(full, width, in_place, axes)
    state = state.replace(sampling=_as_kind(state.sampling, kind))
    table = loop.page_table(full)  # paged: the host's table, which the call gives back as it was
    state = _done_rows_write_nowhere(state)
    B, D = width, 0 if drafter is None else drafter.tree.depth
    limit = jnp.where(jnp.any(full.done), jnp.minimum(limit, open_steps), limit)

    def go_on(carry):
        state, i = carry[0], carry[1]
        return (i < limit) & ~jnp.all(state.done)

    def body(carry):
        state, i, tokens, counts, scored = carry
        state, out = loop.step(target, drafter, state, threshold, logprobs=logprobs)
        state = loop.place(state, state_drafter, mesh, rules)
        if scored is not None:
            scored = jax.tree.map(lambda buf, x: buf.at[i].set(x), scored, out.logprobs)
        return state, i + 1, tokens.at[i].set(out.tokens), counts.at[i].set(out.count), scored

    scored = None
    if logprobs is not None:
        top = (steps, B, D + 1, logprobs[0])
        scored = Logprobs(jnp.zeros(top[:3]), jnp.zeros(top, jnp.int32), jnp.zeros(top))
    carry = (state, jnp.zeros((), jnp.int32), jnp.zeros((steps, B, D + 1), jnp.int32),
             jnp.zeros((steps, B), jnp.int32), scored)
    state, taken, tokens, counts, scored = jax.lax.while_loop(go_on, body, carry)
    state = state.replace(sampling=_as_kind(state.sampling))
    held = state.length - 1  # the target's cache holds its rows below length - 1
    own = None if state_drafter is None else state_drafter.held(state.draft_state, state.tokens, state.length,
                                                                 state.features)
    held = held if own is None else jnp.minimum(held, own)
    full = written_back(full, state, width, in_place, axes)
    if table is not None:  # (laid out again: the table's rows over data, as every call leaves it)
        full = loop.place(loop.with_pages(full, table), state_drafter, mesh, rules)
    return full, Emitted(tokens, counts, taken, state.done, held, scored)


def _done_rows_write_nowhere(state):
    """A paged state whose rows that are done now read and write only the null page (their
    tables' entries NULL_PAGE): a free slot, a finished or cancelled request's row, a long
    prompt's row being prefilled a chunk a call. The pages their tables named may belong to
    another request by now; within a program, no pass over a done row then touches them."""
    table = loop.page_table(state)
    return state if table is None else loop.with_pages(state, jnp.where(state.done[:, None], NULL_PAGE, table))


@functools.partial(jax.jit, donate_argnums=1, static_argnames=("backend", "rules"))
def _sync(drafter, state, state_drafter, *, backend: Backend, rules):
    """The drafter's state brought within one window of its rows (`Drafter.sync`): run before
    the first call that drafts after calls that did not. A done row writes only to the null
    page (`_done_rows_write_nowhere`); the table comes back as it was."""
    drafter = drafter.on(backend)
    table, state = loop.page_table(state), _done_rows_write_nowhere(state)
    state = state.replace(draft_state=drafter.sync(state.draft_state, state.tokens, state.length, state.done))
    state = state if table is None else loop.with_pages(state, table)
    return loop.place(state, state_drafter, backend.mesh, rules)


def _zeros(layout):
    """A state of zeros laid out as `layout` (ShapeDtypeStructs with their shardings)."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), layout)


def pool_bytes(state) -> int:
    """Bytes of the key/value buffers of every cache a state holds (a paged state's pools)."""
    return sum(nbytes((c.k, c.v)) for c in loop.caches(state))


class Programs:
    """The compiled programs of one engine: its target, its drafter at each K it runs (K = 0:
    none), and the state's sizes. drafters: {K: a resolved, bound drafter, or None for 0}."""

    def __init__(self, target, drafters: dict, slots: int, max_len: int, stop_width: int,
                 steps_per_call: int, threshold: float, mesh=None, rules=None, deterministic: bool = False,
                 open_steps: int | None = None, paging: tuple | None = None, prefill_chunk: int | None = None,
                 bias_width: int = 0, logprobs: tuple[int, str] | None = None, grammar: Capacity | None = None):
        self.target, self.drafters, self.slots, self.max_len = target, drafters, slots, max_len
        # None, or the Capacity (states, token masks, exceptional moves) a row's grammar may hold
        self.grammar = None if grammar is None else Capacity(*grammar)
        self.bias_width = bias_width  # entries of a row's logit bias the state holds
        # None, or (top, mode): the run programs that also score the tokens they emit
        # (`loop.step`'s logprobs), one per K and width, of the filtered kind (which serves every row).
        self.logprobs = logprobs
        # None, or (pages, page size): the target's cache in a pool of pages (serve/pages.py).
        self.paging = None if paging is None else tuple(int(x) for x in paging)
        if self.paging is not None:
            page = self.paging[1]
            if MIN_BUCKET % page and page % MIN_BUCKET:
                raise ValueError(f"page_size must divide {MIN_BUCKET} or be a multiple of it (a prompt bucket is a "
                                 f"whole number of pages), got {page}")
        self.stop_width, self.steps_per_call = stop_width, steps_per_call
        self.open_steps = steps_per_call if open_steps is None else min(open_steps, steps_per_call)
        self.threshold = jnp.float32(threshold)
        self.deepest = max((d for d in drafters.values() if d is not None), key=lambda d: d.tree.depth, default=None)
        self.buckets = buckets(max_len, MIN_BUCKET if paging is None else max(MIN_BUCKET, self.paging[1]))
        # (a prefilled row's tokens and caches fit the state's: pages of more than 16 round
        # the last bucket up past max_len)
        self.room = verify_room(self.deepest)  # slots past the root a step writes
        self.cache_len = max(loop.cache_length(max_len, 0, self.room), self.buckets[-1])
        # Paged: a prompt longer than `chunk` (the longest bucket within prefill_chunk) is
        # prefilled a chunk a call (`prefill_chunk`) and admitted with its last; the buckets
        # a group is admitted in stop there. None: every prompt at once.
        self.chunk = None
        if prefill_chunk is not None:
            if self.paging is None:
                raise ValueError("prefill_chunk prefills into a row's pages: give kv_pages or kv_cache_bytes")
            self.chunk = max([b for b in self.buckets if b <= prefill_chunk] or [self.buckets[0]])
        # On a mesh, rows lie over `data`: a call steps them all (a narrower slice would move rows).
        self.widths = (slots,) if mesh is not None else spread(slots)
        # Requests that wait together are prefilled together, in groups of these sizes (one
        # at a time on a mesh, and where a row must not depend on its neighbours' prefill).
        self.prefill_sizes = (1,) if mesh is not None or deterministic else spread(slots)
        self.mesh, self.rules = mesh, rules
        # What a prefill call costs beyond its token slots, in tokens' worth (`partition`):
        # measured by `compile_all`. Until then (and where tokens cost nothing measurable
        # beside a call) a call is priced as the largest prefill: bursts go in fewest calls.
        self.call_tokens = self.most_tokens = float(max(n * b for n, b in self.sizes))
        # Where its programs run: the mesh's devices, else the default backend's.
        self.backend = Backend.of(None, mesh)
        # A prefill runs unsharded, its rows then placed by `insert_rows`; on a mesh it attends
        # portably, as the sharded programs' cuDNN and splash do (one kernel would run per call).
        self.prefill_backend = Backend(self.backend.platform, portable=mesh is not None)
        self._compiled = {}  # {("admit" or "insert", n, bucket): `compile_group`'s executable}

    def listing(self) -> list[str]:
        """Every program this engine may compile, by name and shape."""
        return ([f"empty state [{self.slots}, {self.cache_len}]", "release"]
                + ([] if self.paging is None else [f"set the page table [{self.slots}, {self.table_width}]"])
                + [f"{name} [{n}, {b}]" for n, b in self.sizes for name in self.admissions]
                + ([] if self.chunk is None else [f"prefill a chunk [1, {self.chunk}]"])
                + ([f"catch the draft up on a chunk [1, {self.chunk}]"] if self.catches_up else [])
                + [f"run {self.steps_per_call} steps of rows [:{w}] at K={K}, {kind}"
                   for K in sorted(self.drafters) for w in self.widths for kind in KINDS]
                + ([] if self.logprobs is None else [
                    f"run {self.steps_per_call} steps of rows [:{w}] at K={K}, {FILTERED}, with top-{self.logprobs[0]} "
                    f"{self.logprobs[1]} logprobs" for K in sorted(self.drafters) for w in self.widths]
                    + [f"score a prompt [1, {b}]" for b in self.buckets])
                + [f"sync the draft for K={K}" for K in self._synced()])

    @property
    def admissions(self) -> tuple[str, ...]:
        """The programs that admit a group: a prefill of rows, then their insert; or, paged,
        one that prefills into the state's own pages (`admit_rows`)."""
        return ("prefill", "insert") if self.paging is None else ("admit",)

    def state_shapes(self):
        return jax.eval_shape(self._empty, self.target, self.deepest)

    @property
    def _empty(self):
        """`_empty` of this engine's sizes, of (target, drafter)."""
        return functools.partial(_empty, slots=self.slots, cache_len=self.cache_len, stop_width=self.stop_width,
                                 bias_width=self.bias_width, backend=self.backend, rules=self.rules,
                                 paging=self._paging, grammar=self.grammar)

    def state_bytes(self) -> int:
        return nbytes(self.state_shapes())

    def page_bytes(self) -> tuple[int, int]:
        """(bytes of one page, every cache's pools together; bytes of the state but its pools),
        read from the paged state's shapes: what a byte budget of pages is divided by."""
        shapes = self.state_shapes()
        pools = pool_bytes(shapes)
        return pools // self.paging[0], nbytes(shapes) - pools

    def set_pool(self, num_pages: int):
        """The pool's size in pages (its null page included), before any program is built."""
        self.paging = (int(num_pages), self.paging[1])

    def temporaries(self) -> int:
        """The most bytes any of its programs needs beside its arguments (XLA's accounting,
        `memory_analysis()`, of each K's widest run and the largest prefill, compiled for
        this device here), a prefill's rows counted, and a prompt's scoring pass (`score_bytes`):
        what the device must keep free beside the state and the weights."""
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.state_shapes())
        most = 0
        for K in self.drafters:
            run = run_steps.lower(self.target, self.drafters[K], self.deepest, state, self.threshold, np.int32(1),
                                  steps=self.steps_per_call, open_steps=self.open_steps, width=self.slots,
                                  kind=KINDS[-1], backend=self.backend, rules=self.rules)
            most = max(most, run.compile().memory_analysis().temp_size_in_bytes)
        most = max(most, score_bytes(self))  # a prompt's own pass (echo with logprobs), between calls
        if self.paging is not None:  # the admission of the most tokens: its rows are the state's
            admit = self.lower_admission(state, *self._largest_size())[0].compile().memory_analysis()
            return int(max(most, admit.temp_size_in_bytes))
        args, b = self.largest_prefill()
        prefill = _prefill.lower(self.target, self.deepest, *args, cache_len=b,
                                 backend=self.prefill_backend).compile().memory_analysis()
        return int(max(most, prefill.temp_size_in_bytes + prefill.output_size_in_bytes))

    def _largest_size(self) -> tuple[int, int]:
        """(n, bucket) of the prefill of the most tokens (`sizes`; of those, the most requests)."""
        return max(self.sizes, key=lambda nb: (nb[0] * nb[1], nb[0]))

    def largest_prefill(self) -> tuple:
        """(`_prefill`'s host arguments, their bucket; paged, `admit_rows`'s after the state and the
        slots, starting at 0) for its prefill of the most tokens (`sizes`; of those, the most
        requests): the one whose rows and temporaries a device must keep room for."""
        n, b = self._largest_size()
        return self._prefill_args(*self.dummy_prompts(n, b), starts=None if self.paging is None else [0] * n)

    def empty(self):
        return self._empty(self.target, self.deepest)

    def bucket(self, prompt_len: int) -> int:
        return next(b for b in self.buckets if b >= prompt_len)

    def prefill(self, prompts: list, limits: list, samplings: list, stop_ids: np.ndarray, seeds: list,
                prompt_lengths: list | None = None, grammars: list | None = None):
        """n requests' rows (n in `prefill_sizes`), in the bucket of the longest prompt:
        prompts int32 [P_i] each; samplings `Settings` each; stop_ids int32 [n, M];
        prompt_lengths: where each output begins (None: past its prompt; a resumed request's
        holds output already); grammars: None, or each row's (a `Grammar` or None, the
        tokens of its output so far). Its arguments go as host arrays: nothing runs eagerly."""
        args, b = self._prefill_args(prompts, limits, samplings, stop_ids, seeds, prompt_lengths=prompt_lengths,
                                     grammars=grammars)
        return _prefill(self.target, self.deepest, *args, cache_len=b, backend=self.prefill_backend)

    def _prefill_args(self, prompts: list, limits: list, samplings: list, stop_ids, seeds: list, starts=None,
                      prompt_lengths=None, grammars=None):
        """(`_prefill`'s host arrays for `prefill`'s arguments, their bucket: the longest
        prompt's). starts: None, or (`admit_rows`'s) where each prompt's prefill starts: then the
        tokens are [n, cache_len], the starts follow them, and the bucket is the longest rest's."""
        n = len(prompts)
        starts = [0] * n if starts is None else list(starts)
        b = self.bucket(max(len(p) - s for p, s in zip(prompts, starts)))
        if (n, b) not in self.sizes:
            raise ValueError(f"{n} rows in bucket {b}: this engine prefills {self.prefill_sizes} at a time, at most "
                             f"{GROUP_TOKENS} tokens together")
        tokens = np.zeros((n, b if self.paging is None else self.cache_len), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        settings = stack(samplings, self.bias_width)
        head = (tokens,) if self.paging is None else (tokens, np.array(starts, np.int32))
        lengths = np.array([len(p) for p in prompts], np.int32)
        return head + (lengths, np.array(limits, np.int32), settings, np.asarray(stop_ids, np.int32).reshape(n, -1),
                       np.array(seeds, np.uint32), lengths if prompt_lengths is None
                       else np.array(prompt_lengths, np.int32)) + self._grammar_args(n, grammars), b

    def _grammar_args(self, n: int, grammars) -> tuple:
        """(`_prefill`'s grammar and grammar_state) for n rows (`Automaton.resumed`)."""
        if self.grammar is None:
            return None, None
        return Automaton.resumed(grammars or [(None, ())] * n, self.target.config.vocab_size, self.grammar)

    @property
    def table_width(self) -> int:
        """Pages in a row's table (paged): enough for its longest cache (a drafter's own runs
        a window past the target's: `grow_cache_length`)."""
        longest = self.cache_len if self.deepest is None else grow_cache_length(self.deepest.tree, self.cache_len)
        return -(-longest // self.paging[1])

    @property
    def unrolled_inserts(self) -> bool:
        """Whether an insert writes its rows one update a row (a TPU's form, `insert_rows`)."""
        return self.backend.platform == "tpu"

    @property
    def _paging(self) -> tuple | None:
        """`_empty`'s paging: (pages, page size, table width), or None."""
        return None if self.paging is None else (*self.paging, self.table_width)

    def insert(self, state, slots: list, rows, table=None):
        """`state` with `prefill`'s rows written into its rows `slots`; paged, with the whole
        page table int32 [slots, table_width] as the host holds it (None: every row's null
        pages, for rows that are thrown away)."""
        if self.paging is not None and table is None:
            table = np.zeros((self.slots, self.table_width), np.int32)
        args = (state, np.array(slots, np.int32), rows, self.deepest, table)
        compiled = self._compiled.get(("insert", len(slots), rows.tokens.shape[1]))
        return compiled(*args) if compiled else insert_rows(*args, mesh=self.mesh, rules=self.rules,
                                                            unrolled=self.unrolled_inserts)

    def admit(self, state, slots: list, prompts: list, starts: list, limits: list, samplings: list, stop_ids,
              seeds: list, table=None, prompt_lengths: list | None = None, grammars: list | None = None):
        """Paged: n requests (n in `prefill_sizes`) prefilled straight into their pages and
        placed in the state's rows `slots`, in the bucket of the longest rest of a prompt past
        its start (starts: positions its pages hold already, a cached prefix: a whole number
        of pages, at most its length - 2); table: the whole page table as the host holds it,
        the rows' pages included (None: every row's null pages, for throwaway rows).
        `prefill`'s other arguments; nothing runs eagerly."""
        args, b = self._prefill_args(prompts, limits, samplings, stop_ids, seeds, starts=starts,
                                     prompt_lengths=prompt_lengths, grammars=grammars)
        if table is None:
            table = np.zeros((self.slots, self.table_width), np.int32)
        args = (self.target, self.deepest, state, np.array(slots, np.int32), *args, np.asarray(table, np.int32))
        compiled = self._compiled.get(("admit", len(slots), b))
        return compiled(*args) if compiled else admit_rows(*args, width=b, backend=self.backend, rules=self.rules)

    def prefill_chunk(self, state, slot: int, prompt, start: int, table):
        """Paged: positions start .. start + `chunk` - 1 of a long prompt written into its
        pages (table: the host's, the row's pages included), its row not placed yet."""
        return _prefill_chunk(self.target, self.deepest, state, np.array([slot], np.int32), self._row(prompt),
                              np.array([start], np.int32), np.array([len(prompt)], np.int32),
                              np.asarray(table, np.int32), width=self.chunk, backend=self.backend)

    def _row(self, tokens) -> np.ndarray:
        """int32 [1, cache_len]: one row's tokens, as the state's token buffer holds them."""
        row = np.zeros((1, self.cache_len), np.int32)
        row[0, :len(tokens)] = tokens
        return row

    @property
    def catches_up(self) -> bool:
        """Whether a finished row's draft model may lag it (calls at K = 0 beside a draft that
        keeps a cache of tokens alone), so that `catch_up` runs before its pages are cached."""
        d = self.deepest
        return (self.chunk is not None and 0 in self.drafters and d is not None and d.keeps_cache
                and not d.wants_features)

    def catch_up(self, state, tokens, held: int, pages) -> tuple:
        """(state, held) for a finished row of `tokens` whose caches hold it below `held`: where
        its draft model lags it by a page or more (`catches_up`: calls at K = 0 leave it so),
        the draft's cache in its `pages` made to hold what the target's does (all but the last
        token), a `chunk` a call (`_catch_up`: the draft's passes alone); else as they were (a
        lag within the last page costs no page: nothing is fed)."""
        end, page = len(tokens) - 1, self.paging[1]
        if not self.catches_up or held // page >= end // page:
            return state, held
        row, table = self._row(tokens), np.zeros((1, self.table_width), np.int32)
        table[0, :len(pages)] = pages
        for at in range(held, end, self.chunk):
            state = self._feed_draft(state, row, at, table)
        return state, end

    def _feed_draft(self, state, row, at: int, table):
        """`_catch_up` of one chunk of a row (`_row`) from position `at` (table int32 [1, M])."""
        return _catch_up(self.deepest, state, row, np.array([at], np.int32), table, width=self.chunk,
                         backend=self.backend)

    def set_table(self, state, table):
        """A paged state with the host's page table (rows grown, or freed, since it was set)."""
        return _set_table(state, np.asarray(table, np.int32))

    def release(self, state, slots):
        free = np.zeros((self.slots,), bool)
        free[list(slots)] = True
        return _release(state, free)

    def partition(self, lengths: list[int], call_tokens: float, skip=frozenset()) -> list[int]:
        """How waiting prompts of `lengths` (ascending) are prefilled at least cost: the sizes
        of consecutive groups, each in its longest prompt's bucket. A group of n in bucket b
        costs its n b token slots (padding computes like prompt) plus `call_tokens`, what a
        call costs beyond them (it reads every weight once, whatever it holds) in tokens'
        worth; so a burst's short prompts are not padded to its longest one's bucket when a
        call of their own costs less. (n, b) in skip: not compiled yet, not used."""
        best = [(0.0, ())]  # best[i]: (cost, group sizes) of the first i prompts
        for i in range(1, len(lengths) + 1):
            b = self.bucket(lengths[i - 1])
            best.append(min(((best[i - n][0] + n * b + call_tokens, best[i - n][1] + (n,))
                             for n in self.prefill_sizes if n <= i and (n, b) in self.sizes
                             and (n == 1 or (n, b) not in skip)),
                            key=lambda option: (option[0], len(option[1]))))  # a tie: fewer calls
        return list(best[-1][1])

    def groups(self) -> list[tuple[int, int]]:
        """(n, bucket) of every prefill of more than one request, shortest bucket first."""
        return [(n, b) for n, b in self.sizes if n > 1]

    @functools.cached_property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        """(n, bucket) of every prefill: n requests of a bucket together, one always, more
        while they hold at most GROUP_TOKENS; shortest bucket first."""
        return tuple((n, b) for b in self.buckets for n in self.prefill_sizes
                     if (n == 1 or n * b <= GROUP_TOKENS) and (self.chunk is None or b <= self.chunk))

    def _dummy_rows(self, n: int, b: int):
        """`prefill`'s rows for n prompts filling bucket b (compiling it, once)."""
        return self.prefill(*self.dummy_prompts(n, b))

    def dummy_admit(self, state, n: int, b: int):
        """`state` with n prompts filling bucket b admitted into its rows 0..n-1 (their prefill
        and insert, or, paged, their admission into the null pages), compiling them once."""
        if self.paging is None:
            return self.insert(state, list(range(n)), self._dummy_rows(n, b))
        prompts, limits, samplings, stops, seeds = self.dummy_prompts(n, b)
        return self.admit(state, list(range(n)), prompts, [0] * n, limits, samplings, stops, seeds)

    def dummy_prompts(self, n: int, b: int) -> tuple:
        """`prefill`'s arguments for n prompts filling bucket b."""
        stops = np.full((n, self.stop_width), -1, np.int32)
        return [np.ones((b,), np.int32)] * n, [min(b + 1, self.max_len)] * n, [Settings()] * n, stops, [0] * n

    def compile_all(self, skip=(), progress=None):
        """Runs every program once on a throwaway state, so that none compiles while serving,
        but the prefills and inserts of `skip` ((n, bucket) pairs: `compile_group`'s). Returns
        the state's layout (shapes, dtypes and shardings), which `compile_group` wants.
        progress: None, or a function called with the number of programs just compiled."""
        done = progress or (lambda n: None)
        state = self.empty()
        done(1)
        if self.paging is not None:
            state = self.set_table(state, np.zeros((self.slots, self.table_width), np.int32))
            done(1)
        layout = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        for n, b in self.sizes:
            if (n, b) not in skip:
                state = self.dummy_admit(state, n, b)
                done(len(self.admissions))
        if self.chunk is not None:  # (into the null pages)
            state = self.prefill_chunk(state, 0, np.ones((self.chunk,), np.int32), 0,
                                       np.zeros((self.slots, self.table_width), np.int32))
            done(1)
        if self.catches_up:  # (into the null page)
            state = self._feed_draft(state, self._row(np.ones((self.chunk,), np.int32)), 0,
                                     np.zeros((1, self.table_width), np.int32))
            done(1)
        state, self.call_tokens = timing.call_tokens(self, state, skip)
        state = self.release(state, range(max(self.prefill_sizes)))
        done(1)
        for K in self.drafters:
            if K in self._synced():
                state = self.sync(state, K)
                done(1)
            for w in self.widths:
                for kind in KINDS:
                    state, _ = self.run(state, K, w, kind)
                    done(1)
                if self.logprobs is not None:
                    state, _ = self.run(state, K, w, FILTERED, logprobs=True)
                    done(1)
        for b in self.buckets if self.logprobs is not None else ():
            prompt_logprobs(self, np.ones((b,), np.int32), 0)
            done(1)
        jax.block_until_ready(state)
        return layout

    def lower_admission(self, layout, n: int, b: int) -> tuple:
        """Paged: (the admission of n prompts filling bucket b into a state of `layout`,
        lowered; its arguments after the state and the slots, every row's pages null)."""
        args, b = self._prefill_args(*self.dummy_prompts(n, b), starts=[0] * n)
        args = args + (np.zeros((self.slots, self.table_width), np.int32),)
        return admit_rows.lower(self.target, self.deepest, layout, jax.ShapeDtypeStruct((n,), jnp.int32), *args,
                                width=b, backend=self.backend, rules=self.rules), args

    def compile_group(self, n: int, b: int, layout):
        """Compiles the prefill of n requests in bucket b (by running it on a throwaway prompt)
        and its insert (ahead of time against `layout`, `compile_all`'s) while the engine may
        serve; `admit` and `insert` call the executable kept here, which a CPU has run once on a
        state of zeros (a state's memory more, for a moment; an accelerator's may not fit twice),
        so that a group's first admission compiles nothing and costs what its second does (jit's
        own path would compile it again: docs/bench/serve_first_group.txt)."""
        slots = jax.ShapeDtypeStruct((n,), jnp.int32)
        if self.paging is not None:  # one program, the state's own pages its rows
            lowered, args = self.lower_admission(layout, n, b)
            name, run = "admit", lowered.compile()
            first = (self.target, self.deepest, layout, np.arange(n, dtype=np.int32), *args)
        else:
            rows = self._dummy_rows(n, b)
            name, run = "insert", insert_rows.lower(layout, slots, rows, self.deepest, None, mesh=self.mesh,
                                                    rules=self.rules, unrolled=self.unrolled_inserts).compile()
            first = (layout, np.arange(n, dtype=np.int32), rows, self.deepest, None)
        if self.backend.platform == "cpu":  # once, on a state of zeros
            jax.block_until_ready(run(*(_zeros(x) if x is layout else x for x in first)))
        self._compiled[(name, n, b)] = run

    def width(self, rows: int) -> int:
        """The narrowest run that covers the state's first `rows` rows."""
        return next(w for w in self.widths if w >= rows)

    def run(self, state, K: int, rows: int, kind: str, steps: int | None = None, logprobs: bool = False):
        """Up to `steps` (at most, and by default, `steps_per_call`; `open_steps` while a
        slot is free) steps at K over the narrowest width covering the first `rows` rows, for
        rows that need sampling of `kind` (`sampling.kind_of` their settings); one program
        whatever `steps`. logprobs: the program that also scores the emitted tokens (the
        engine's `logprobs`; kind must be FILTERED): `Emitted.logprobs`. -> (state, `Emitted`)."""
        limit = self.steps_per_call if steps is None else min(steps, self.steps_per_call)
        if logprobs and (self.logprobs is None or kind != FILTERED):
            raise ValueError("this engine scores tokens only in its filtered runs, and only with max_logprobs set")
        return run_steps(self.target, self.drafters[K], self.deepest, state, self.threshold, np.int32(limit),
                    steps=self.steps_per_call, open_steps=self.open_steps, width=self.width(rows), kind=kind,
                    backend=self.backend, rules=self.rules, logprobs=self.logprobs if logprobs else None)

    def _synced(self) -> list[int]:
        """The Ks whose calls may follow calls at K = 0 (a draft that skipped steps)."""
        return [K for K in sorted(self.drafters) if K] if 0 in self.drafters and self.deepest is not None else []

    def sync(self, state, K: int):
        """The draft's state caught up on calls that did not draft, before one at K (> 0)."""
        return _sync(self.drafters[K], state, self.deepest, backend=self.backend, rules=self.rules)
