"""`Scheduler`: the engine's host-side plan of every turn, as one value (`Turn`).

It holds the queues (waiting, running in a slot, being prefilled a chunk a call), the
`PagePool` (each row's pages, grown to its `reach`; prefix keys and registration;
preemption when pages run out), and chooses each turn's work: which rows stop, which
waiting requests are admitted into which slots in which groups, which long prompt gets its
next chunk, which rows run, and the page table that every device call of the turn reads.
The host's account is updated as the turn is planned, as if its calls succeed; the engine
reports back what happened (`finished`, `unprepared`, `recover`).

It knows requests, slots and pages; nothing of JAX, devices, programs or threads (the
engine calls it under its lock). Its rules hold after every call (`check`): a request is
in one place at most; a slot holds one request at most; a page has as many holders as
owners list it; pages are free, cached or held, never two of these; a waiting request
holds no pages. tests/test_scheduler.py drives it with random sequences against them.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import numpy as np

from specjax.serve.pages import OutOfPages, PagePool, page_keys


@dataclasses.dataclass(frozen=True)
class Admission:
    """Requests prefilled together in one device call (from each one's `prefilled` on) and
    placed in their slots, slots[i] for requests[i]."""

    slots: tuple[int, ...]
    requests: tuple


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A long prompt's next piece: positions start .. start + the engine's chunk - 1 of its
    context written into its pages (its row is placed with its last piece, an `Admission`)."""

    slot: int
    request: object
    start: int


@dataclasses.dataclass(frozen=True)
class Turn:
    """One turn of the engine, planned on the host: apply in this order."""

    cancelled: tuple  # requests that end as cancelled (their pages are back already)
    stopped: tuple[int, ...]  # slots whose rows stop now (cancelled or preempted): marked done on the device
    admissions: tuple[Admission, ...]  # groups admitted into free slots, in order
    chunk: Chunk | None  # a long prompt's next chunk, if one is being prefilled
    score: object  # a prompt to score (`Scoring`), or None: a pass of its own, beside the state
    rows: dict  # slot -> request: the live rows the turn's run call steps (admitted ones included)
    table: np.ndarray | None  # int32 [slots, M]: every slot's pages (paged), what each call of the turn reads

    @property
    def admitted(self) -> list:
        """The requests its admissions place, in order."""
        return [r for a in self.admissions for r in a.requests]


@dataclasses.dataclass(frozen=True)
class Scoring:
    """A prompt's own log-probabilities asked for (completions' echo with logprobs): scored
    by the device thread in a turn of its own, its result (or error) set on `future`."""

    prompt: tuple
    top: int
    future: object  # a concurrent.futures.Future


@dataclasses.dataclass(frozen=True)
class Reach:
    """How far a running row may write by the end of the next two device calls (the host
    knows its tokens a call late): what its pages must cover (`Scheduler.reach`)."""

    steps_per_call: int
    depth: int  # the deepest draft's depth: a step emits at most depth + 1 tokens
    room: int  # slots past the root a step writes (`verify_room`): a last step's in-flight tokens


class Scheduler:
    """Plans turns over `slots` rows. pages: None (each row holds max_len positions), or the
    pool every row's pages come from. chunk: None, or the most prompt tokens one call
    prefills (a longer prompt goes a chunk a call). partition: the sizes of the groups that
    waiting prompts of the given lengths (ascending) are prefilled in (`Programs.partition`).
    prefix_caching: rows share the cached pages of their contexts (`page_keys` with salt)."""

    def __init__(self, slots: int, pages: PagePool | None, reach: Reach, partition: Callable[[list[int]], list[int]],
                 chunk: int | None = None, prefix_caching: bool = False, salt: bytes = b"", table_width: int = 0):
        self.slots, self.pages, self._reach, self.partition = slots, pages, reach, partition
        self.chunk, self.prefix_caching, self.salt, self.table_width = chunk, prefix_caching, salt, table_width
        self.waiting: collections.deque = collections.deque()
        self.live: dict = {}  # slot -> request: rows the device steps
        self.chunking: dict = {}  # slot -> request: a long prompt's row, prefilled a chunk a call
        self.cancelled: set = set()  # cancelled while in a slot: stopped at the next turn
        self.scoring: collections.deque = collections.deque()  # prompts to score, one a turn
        self.preemptions = 0

    # ---- requests come and go -------------------------------------------------------------

    def submit(self, request):
        self.waiting.append(request)

    def score(self, job: Scoring):
        self.scoring.append(job)

    def cancel(self, request) -> bool:
        """A waiting request leaves at once (True: the caller finishes it); one in a slot stops
        at the next turn (False)."""
        if request in self.waiting:
            self.waiting.remove(request)
            return True
        if request in self.live.values() or request in self.chunking.values():
            self.cancelled.add(request)
        return False

    def everyone(self) -> list:
        """Every request it holds: running, being prefilled, waiting."""
        return list(self.live.values()) + list(self.chunking.values()) + list(self.waiting)

    @property
    def busy(self) -> bool:
        """Whether a turn has anything to do."""
        return bool(self.waiting or self.live or self.chunking or self.cancelled or self.scoring)

    def load(self) -> tuple[int, int]:
        """(requests in slots, requests waiting)."""
        return len(self.live) + len(self.chunking), len(self.waiting)

    # ---- pages ----------------------------------------------------------------------------

    def reach(self, request) -> int:
        """The slots a request's row may have written by the end of the next two device calls:
        its tokens then, at most its limit, plus the last step's in-flight ones past them (a
        deterministic pass reads them back from the cache). What its pages cover."""
        known = len(request.prompt) + len(request.tokens)
        grown = known + 2 * self._reach.steps_per_call * (self._reach.depth + 1)
        return min(len(request.prompt) + request.max_new_tokens, grown) + self._reach.room

    def keys(self, request, held: int | None = None) -> list:
        """The keys of the request's context's cacheable pages (none without prefix caching).
        held: those of a finished row whose caches hold its entries below this position."""
        if not self.prefix_caching:
            return []
        count = None if held is None else held // self.pages.page_size
        return page_keys(request.context, self.pages.page_size, self.salt, count)

    def grows(self) -> bool:
        """Every running row's pages grown to its reach, oldest request first; False where the
        free pages ran out first (a turn then preempts)."""
        if self.pages is None:
            return True
        try:
            for request in sorted(self.live.values(), key=lambda r: r.submitted):
                self.pages.grow(request, self.reach(request))
        except OutOfPages:
            return False
        return True

    def table(self) -> np.ndarray | None:
        """int32 [slots, table_width]: each slot's request's pages (running or being
        prefilled), a free slot's the null page; None unpaged."""
        if self.pages is None:
            return None
        owners = {**self.live, **self.chunking}
        return self.pages.table([owners.get(slot) for slot in range(self.slots)], self.table_width)

    # ---- a turn ----------------------------------------------------------------------------

    def schedule(self) -> Turn:
        """The next turn: cancelled rows stopped; pages grown, preempting the newest running
        request while they run out; free slots filled from the queue in arrival order while
        their pages can be taken; the oldest long prompt's next chunk (or its placement)."""
        cancelled, stopped = self._stop_cancelled()
        stopped += self._preempt_until_grown()
        admissions = self._admit()
        chunk = self._next_chunk(admissions)
        if self.pages is not None:  # what the admitted rows write is cached for later requests
            for request in (r for a in admissions for r in a.requests):
                self.pages.count(len(request.context) if self.prefix_caching else 0, request.cached_tokens)
                self.pages.register(request, self.keys(request))
        score = self.scoring.popleft() if self.scoring else None
        return Turn(tuple(cancelled), tuple(stopped), tuple(admissions), chunk, score, dict(self.live), self.table())

    def _stop_cancelled(self) -> tuple[list, list[int]]:
        cancelled, self.cancelled = self.cancelled, set()
        stopped = [slot for slot, r in self.live.items() if r in cancelled]
        for slot in stopped:
            del self.live[slot]
        for slot in [slot for slot, r in self.chunking.items() if r in cancelled]:
            del self.chunking[slot]  # (its row is done on the device: nothing to stop)
        for request in cancelled:
            self._release(request)
        return sorted(cancelled, key=lambda r: r.submitted), stopped

    def _preempt_until_grown(self) -> list[int]:
        """While the running rows' pages cannot grow: the newest running request goes back to
        the front of the queue, its pages freed first (vLLM's recompute: it resumes by
        prefilling its context, and goes on as it would have)."""
        stopped = []
        while not self.grows():
            slot, request = max(self.live.items(), key=lambda item: item[1].submitted)
            del self.live[slot]
            self._release(request)
            request.prefilled = request.cached_tokens = 0
            self.waiting.appendleft(request)
            stopped.append(slot)
            self.preemptions += 1
        return stopped

    def _takes_pages(self, request) -> bool:
        """Whether the request's pages could be taken (its cached prefix shared, the rest grown
        to its reach); none taken where not."""
        if self.pages is None:
            return True
        shared = self.pages.share(request, self.keys(request))
        try:
            self.pages.grow(request, self.reach(request))
        except OutOfPages:
            self.pages.release(request)
            return False
        request.cached_tokens = request.prefilled = shared * self.pages.page_size
        return True

    def _admit(self) -> list[Admission]:
        free = [s for s in range(self.slots) if s not in self.live and s not in self.chunking]
        admitted = []  # the first waiting request whose pages cannot be taken stops admission (arrival order)
        while len(admitted) < len(free) and self.waiting and self._takes_pages(self.waiting[0]):
            admitted.append(self.waiting.popleft())
        rest = lambda r: len(r.context) - r.prefilled  # noqa: E731 - what its prefill computes
        for request in [r for r in admitted if self.chunk is not None and rest(r) > self.chunk]:
            admitted.remove(request)
            self.chunking[free.pop(0)] = request
        admitted.sort(key=rest)  # a group runs in its longest prompt's bucket
        admissions = []
        for n in self.partition([rest(r) for r in admitted]) if admitted else ():
            group, admitted = admitted[:n], admitted[n:]
            slots = tuple(free.pop(0) for _ in group)
            self.live.update(zip(slots, group))
            admissions.append(Admission(slots, tuple(group)))
        return admissions

    def _next_chunk(self, admissions: list[Admission]) -> Chunk | None:
        """The oldest long prompt's next chunk; where what is left fits one, its admission
        instead (appended to `admissions`). A chunk never leaves one token for the last piece
        (an admission starts at length - 2 at most: a drafter's features begin there): then
        the last piece starts one position earlier, rewriting its row's own entry."""
        if not self.chunking:
            return None
        slot, request = min(self.chunking.items(), key=lambda item: item[1].submitted)
        length = len(request.context)
        if length - request.prefilled <= self.chunk:
            del self.chunking[slot]
            self.live[slot] = request
            admissions.append(Admission((slot,), (request,)))
            return None
        start = request.prefilled
        request.prefilled = min(start + self.chunk, length - 2)
        return Chunk(slot, request, start)

    # ---- what the device did ---------------------------------------------------------------

    def finished(self, slot: int, request, held: int | None = None):
        """A running row's request ended (stop or length): its slot is free and its pages
        back; those below `held` (its caches hold its final entries there) cached first."""
        if self.live.get(slot) is request:
            del self.live[slot]
        if self.pages is not None and held is not None and self.prefix_caching:
            self.pages.register(request, self.keys(request, held))
        self._release(request)

    def unprepared(self, request):
        """An admitted request whose preparation failed before any device call: it leaves."""
        self.live = {slot: r for slot, r in self.live.items() if r is not request}
        self._release(request)

    def recover(self, not_started: list) -> list:
        """A device call failed and the device's state starts anew: -> the requests that were
        in it (running, being prefilled), which leave; `not_started` (admitted this turn after
        the call that failed) go back to the front of the queue in arrival order. Every page
        comes back and the cache is forgotten (the new state's pages hold nothing). Prompts
        waiting to be scored stay (a pass of their own: the state is not theirs)."""
        back = sorted(not_started, key=lambda r: r.submitted)
        gone = [r for r in list(self.live.values()) + list(self.chunking.values()) if r not in back]
        self.live.clear()
        self.chunking.clear()
        self.cancelled.clear()
        for request in back:
            request.prefilled = request.cached_tokens = 0
        self.waiting.extendleft(reversed(back))
        if self.pages is not None:
            self.pages.reset()
        return gone

    def fail(self, requests: list):
        """These requests leave wherever they are (their pages back)."""
        drop = set(map(id, requests))
        self.waiting = collections.deque(r for r in self.waiting if id(r) not in drop)
        self.live = {slot: r for slot, r in self.live.items() if id(r) not in drop}
        self.chunking = {slot: r for slot, r in self.chunking.items() if id(r) not in drop}
        for request in requests:
            self._release(request)

    def _release(self, request):
        if self.pages is not None:
            self.pages.release(request)

    # ---- its rules ------------------------------------------------------------------------

    def check(self):
        """Raises AssertionError where a rule is broken (the module's docstring lists them)."""
        placed = list(self.live.values()) + list(self.chunking.values())
        everyone = placed + list(self.waiting)
        assert len(set(map(id, everyone))) == len(everyone), "a request is in two places"
        assert not set(self.live) & set(self.chunking), "a slot holds two requests"
        assert all(0 <= slot < self.slots for slot in [*self.live, *self.chunking]), "a slot out of range"
        if self.pages is not None:
            self.pages.check()
            assert not any(self.pages.pages(r) for r in self.waiting), "a waiting request holds pages"
            owners = self.pages.owners()
            assert all(any(o is r for r in placed) for o in owners), "pages held by a request in no slot"
