"""The scheduler and the page pool without JAX: random sequences of submissions,
cancellations, turns (rows emitting tokens and finishing), preparation failures and failed
device calls, against the rules the engine's correctness rests on:

- the scheduler's and the pool's own account (`Scheduler.check`, `PagePool.check`);
- each turn's table gives every slot its request's pages and a free slot the null page;
- a running row's pages cover what it may write by the end of the next two calls (its reach);
- every page a row may still write is its alone (a shared page is a cached one below where it writes);
- no request is lost or answered twice; arrival order is kept except by preemption and
  recovery (which put requests back at the front);
- once idle, every page comes back.
"""

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from specjax.serve.pages import NULL_PAGE, OutOfPages, PagePool, pages_for
from specjax.serve.scheduler import Reach, Scheduler

PAGE, PAGES, SLOTS, CHUNK, WIDTH = 4, 24, 3, 8, 20
REACH = Reach(steps_per_call=2, depth=2, room=1)
PREFIXES = (tuple(range(3, 15)), tuple(range(20, 29)))  # prompts that share them find cached pages


class Req:
    """What the scheduler reads of an engine's request."""

    def __init__(self, number: int, prompt, max_new_tokens: int):
        self.number = self.submitted = number
        self.prompt, self.max_new_tokens, self.tokens = tuple(prompt), max_new_tokens, []
        self.prefilled = self.cached_tokens = 0

    @property
    def context(self):
        return self.prompt + tuple(self.tokens)

    def __repr__(self):
        return f"Req({self.number})"


def _groups(lengths):
    """Groups of at most 2 (a stand-in for `Programs.partition`)."""
    return [2] * (len(lengths) // 2) + [1] * (len(lengths) % 2)


class World:
    """A scheduler and what its requests' callers see."""

    def __init__(self, chunk):
        self.scheduler = Scheduler(SLOTS, PagePool(PAGES, PAGE), REACH, _groups, chunk, True, b"salt", WIDTH)
        self.answers = {}  # request -> how it ended, once
        self.submitted = []
        self.front = set()  # requests preempted or put back: they may go ahead of older ones

    def end(self, request, how):
        assert request not in self.answers, f"{request} answered twice"
        self.answers[request] = how

    def submit(self, data):
        prefix = data.draw(st.sampled_from(((),) + PREFIXES))
        tail = data.draw(st.lists(st.integers(3, 60), min_size=1 if not prefix else 0, max_size=30))
        request = Req(len(self.submitted), prefix + tuple(tail), data.draw(st.integers(1, 12)))
        if not self.scheduler.pages.fits(len(request.prompt) + request.max_new_tokens + REACH.room):
            return  # refused at submit
        self.submitted.append(request)
        self.scheduler.submit(request)

    def cancel(self, data):
        alive = [r for r in self.submitted if r not in self.answers]
        if alive:
            request = data.draw(st.sampled_from(alive))
            if self.scheduler.cancel(request):
                self.end(request, "cancelled")

    def turn(self, data, fail: bool):
        s = self.scheduler
        waiting_before = list(s.waiting)
        turn = s.schedule()
        self.check_turn(turn, waiting_before)
        for request in turn.cancelled:
            self.end(request, "cancelled")
        admitted = turn.admitted
        if fail and (admitted or turn.rows or turn.chunk):  # a device call of the turn fails
            failing = data.draw(st.integers(0, len(admitted)))  # admissions after this one were not made
            not_started = admitted[failing + 1:]
            for request in s.recover(not_started):
                self.end(request, "failed")
            self.front.update(not_started)
            return
        if admitted and data.draw(st.booleans()) and data.draw(st.booleans()):  # a preparation fails
            request = data.draw(st.sampled_from(admitted))
            s.unprepared(request)
            self.end(request, "unprepared")
        for slot, request in sorted(s.live.items()):  # the rows run: each emits 1 .. depth + 1 tokens
            left = request.max_new_tokens - len(request.tokens)
            n = min(left, data.draw(st.integers(1, REACH.depth + 1)))
            request.tokens.extend(data.draw(st.lists(st.integers(3, 60), min_size=n, max_size=n)))
            if len(request.tokens) == request.max_new_tokens or data.draw(st.integers(0, 9)) == 0:  # or a stop id
                held = len(request.context) - 1 - data.draw(st.integers(0, 2))  # a drafter's cache may lag
                s.finished(slot, request, max(held, 0))
                self.end(request, "finished")
        self.front.update(r for r in s.waiting if r.tokens)  # preempted: back at the front

    def check_turn(self, turn, waiting_before):
        s = self.scheduler
        s.check()
        pool = s.pages
        owners = {**s.live, **s.chunking}
        for slot in range(SLOTS):  # the table every call of the turn reads
            owner = owners.get(slot)
            want = pool.pages(owner) if owner is not None else []
            row = list(turn.table[slot])
            assert row[:len(want)] == want and set(row[len(want):]) <= {NULL_PAGE}, (slot, row, want)
        for request in owners.values():
            pages = pool.pages(request)
            assert len(pages) >= pages_for(s.reach(request), PAGE), (request, len(pages))
            writes_from = request.prefilled if request in s.chunking.values() else len(request.context) - 2
            for page in pages[max(writes_from, 0) // PAGE:]:
                assert pool.holders(page) == 1, f"{request} may write page {page}, which others hold"
        if turn.chunk is not None:  # its last piece holds two tokens at least
            assert turn.chunk.request.prefilled <= len(turn.chunk.request.context) - 2
        for admission in turn.admissions:
            for request in admission.requests:
                assert request.prefilled <= len(request.context) - 2 or request.prefilled == 0, request
                if s.chunk is not None:
                    assert len(request.context) - request.prefilled <= s.chunk
        ahead = [r for r in waiting_before if r not in self.front]
        taken = [r for r in ahead if r not in s.waiting]  # admitted now, or being chunked
        assert taken == ahead[:len(taken)], "a request was admitted ahead of an older one"

    def drain(self):
        for _ in range(400):
            if not self.scheduler.busy:
                break
            turn = self.scheduler.schedule()
            for request in turn.cancelled:
                self.end(request, "cancelled")
            for slot, request in sorted(self.scheduler.live.items()):
                request.tokens.append(7)
                if len(request.tokens) >= request.max_new_tokens:
                    self.scheduler.finished(slot, request, len(request.context) - 1)
                    self.end(request, "finished")
        assert not self.scheduler.busy, "requests never finished"
        assert set(self.answers) == set(self.submitted), "a request was lost"
        pool = self.scheduler.pages
        assert pool.owners() == [] and pool.free_pages == PAGES - 1, "a page did not come back"
        pool.check()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from([None, CHUNK]))
def test_random_traffic_keeps_the_scheduler_s_rules(data, chunk):
    world = World(chunk)
    for _ in range(data.draw(st.integers(1, 40))):
        what = data.draw(st.sampled_from(["submit", "submit", "submit", "cancel", "turn", "turn", "turn", "fail"]))
        if what == "submit":
            world.submit(data)
        elif what == "cancel":
            world.cancel(data)
        else:
            world.turn(data, fail=what == "fail")
        world.scheduler.check()
    world.drain()


def test_a_chunk_never_leaves_one_token_for_the_last_piece():
    """A prompt of prefilled + 2 chunks + 1 tokens: its second chunk stops a token early, and
    its last piece is two tokens from length - 2 (an admission's start is at most length - 2:
    a drafter's features begin there). At 53bdaf5 the last piece started at length - 1."""
    s = Scheduler(1, PagePool(PAGES, PAGE), REACH, _groups, CHUNK, False, b"", WIDTH)
    request = Req(0, range(3, 3 + 2 * CHUNK + 1), 4)
    s.submit(request)
    starts = []
    for _ in range(3):
        turn = s.schedule()
        if turn.chunk:
            starts.append(turn.chunk.start)
    assert starts == [0, CHUNK] and turn.admissions[0].requests == (request,)
    assert request.prefilled == len(request.prompt) - 2


def test_a_preempted_request_frees_its_pages_before_it_waits():
    """Pages run out as two rows grow: the newer goes back to the front of the queue holding
    no pages (at 53bdaf5 it was queued first, and a failure between the two left a waiting
    request holding pages, which `share` then refused every turn)."""
    s = Scheduler(2, PagePool(9, PAGE), Reach(1, 0, 0), _groups, None, False, b"", WIDTH)
    old, new = Req(0, range(3, 8), 25), Req(1, range(3, 8), 25)
    s.submit(old)
    s.submit(new)
    s.schedule()
    for _ in range(20):
        for slot, request in sorted(s.live.items()):
            request.tokens.append(5)
        turn = s.schedule()
        s.check()
        if turn.stopped:
            break
    assert turn.stopped and list(s.waiting) == [new] and s.pages.pages(new) == [] and s.preemptions == 1
    assert list(s.live.values()) == [old]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "share", "register", "release", "reset"]), st.integers(0, 3),
                          st.integers(0, 40)), max_size=60))
def test_the_page_pool_keeps_its_account_under_random_use(ops):
    """Owners grow, share cached runs, register, release, and the pool is reset, in any order:
    its account holds (`PagePool.check`); a page handed out by `grow` is held by no one else;
    `share` gives exactly the cached pages of the longest registered run of keys; with every
    owner gone every page is free (cached ones count: they are evicted on demand)."""
    pool = PagePool(12, PAGE)
    keys = [bytes([k]) for k in range(10)]  # owners' keys: a run from the first (page_keys' chain)
    for op, owner, n in ops:
        if op == "grow":
            before = {o: set(pool.pages(o)) for o in range(4) if o != owner}
            mine = set(pool.pages(owner))
            try:
                new = set(pool.grow(owner, n)) - mine
            except OutOfPages:
                assert set(pool.pages(owner)) == mine  # nothing taken
                continue
            assert all(not new & theirs for theirs in before.values()), "a held page handed out again"
        elif op == "share" and not pool.pages(owner):
            cached = pool.cached()
            want = []
            for key in keys[:n % 10]:
                if key not in cached:
                    break
                want.append(cached[key])
            assert pool.share(owner, keys[:n % 10]) == len(want) and pool.pages(owner) == want
        elif op == "register":
            pool.register(owner, keys[:n % 10])
        elif op == "release":
            pool.release(owner)
        elif op == "reset":
            pool.reset()
        pool.check()
    for owner in range(4):
        pool.release(owner)
    pool.check()
    assert pool.owners() == [] and pool.free_pages == 11
