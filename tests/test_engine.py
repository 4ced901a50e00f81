"""The engine: requests that come and go give exactly what `generate` gives each alone.

One engine per drafter for the whole module (its programs compile once); requests are
staggered so that slots are refilled while others run, and K changes with the number of
live rows (a K table given per test), so a draft model skips steps, drafts at another K
and starts in a refilled slot."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.drafters import Eagle3, Medusa
from specjax.serve import timing
from tests.test_penalties import _exact_joint
from tests.test_sampling import PROMPT, V, _chi_square_p, _tiny

SLOTS = 3
MAX_LEN = 64
rng = np.random.default_rng(0)
# (prompt, max_new_tokens, stop ids): lengths, budgets and stops differ per request.
REQUESTS = [(list(rng.integers(3, 97, n)), budget, stops) for n, budget, stops in
            [(5, 12, ()), (17, 6, ()), (3, 20, (7, 11)), (9, 9, ()), (30, 15, ()), (1, 8, ()), (12, 18, (5,))]]


@pytest.fixture(scope="module")
def engines(pair):
    target, drafts, _ = pair
    made = {}

    def make(name):
        if name not in made:
            draft, table = {
                "plain": (None, None),
                # K by live rows: 3 alone, 1 with two, off with three (a draft that skips steps).
                "draft": (drafts["near"], (3, 1, 0)),
                "eagle3": (Eagle3.init(target, jax.random.key(1)), (3, 2, 1)),
                "lookup": (specjax.PromptLookup(2, 1), (3, 3, 3)),
                "early_exit": (specjax.EarlyExit(1), (2, 1, 0)),
                "medusa": (Medusa.init(target, 3, jax.random.key(2)), (3, 2, 1)),
                # A datastore of the requests' own greedy text: its drafts are accepted.
                "lookahead": (specjax.Lookahead(3, 3, 2), None),  # (its shape is its own)
                "retrieval": (specjax.Retrieval(specjax.Datastore.build(
                    [p + _alone(target, p, b, s) for p, b, s in REQUESTS])), (3, 2, 2)),
            }[name]
            made[name] = specjax.Engine(target, draft=draft, slots=SLOTS, max_len=MAX_LEN, num_draft_tokens=table,
                                        steps_per_call=4)
        return made[name]

    yield make
    for engine in made.values():
        if engine._thread is not None:
            engine.stop()


ALONE_TOKENS = 20  # a greedy `_alone` generates at least this many (one program), its first `budget` kept
_ALONE = {}  # (id(target), prompt, tokens, stops, settings) -> (target, tokens): the suite's runs shared


def _alone(target, prompt, budget, stops, at_least=ALONE_TOKENS, **kwargs):
    """`prompt` alone through `generate`: what the engine's row must equal. Greedy (penalised,
    biased or constrained), any run's first `budget` tokens are the `budget` run's (each token
    depends only on those before it): so it runs at least `at_least`, one compile for most
    budgets. Runs whose settings are plain values (numbers, strings, dicts of them) are
    remembered; others (a Grammar) run each time: their repr need not tell two apart."""
    room = target.config.max_position_embeddings - len(prompt)
    tokens = budget if kwargs.get("temperature", 0) else max(budget, min(at_least, room))

    def run():
        prompts, lengths = specjax.pad_prompts([prompt])
        out = specjax.generate(target, prompts, lengths, max_new_tokens=tokens, eos_token_id=list(stops) or None,
                               **kwargs)
        return [int(t) for t in np.asarray(out.tokens[0, :int(out.num_tokens[0])])]

    if not all(isinstance(v, (int, float, str, dict, type(None))) for v in kwargs.values()):
        return run()[:budget]
    key = (id(target), tuple(int(t) for t in prompt), tokens, tuple(stops), repr(sorted(kwargs.items())))
    if key not in _ALONE:
        _ALONE[key] = target, run()
    return _ALONE[key][1][:budget]


def _staggered(engine, requests, gap=0.02, **kwargs):
    submitted = []
    with engine:
        for prompt, budget, stops in requests:
            submitted.append(engine.submit(prompt, max_new_tokens=budget, stop_token_ids=stops, **kwargs))
            time.sleep(gap)
        return [r.result(timeout=300) for r in submitted], submitted


@pytest.mark.parametrize("name", ["plain", pytest.param("draft", marks=pytest.mark.slow),  # (test_engine_pages' tree)
                                  pytest.param("eagle3", marks=pytest.mark.slow), "lookup",
                                  pytest.param("early_exit", marks=pytest.mark.slow), "medusa", "retrieval",
                                  "lookahead"])
def test_staggered_requests_equal_generate_alone(pair, engines, name):
    target = pair[0]
    engine = engines(name)
    outputs, requests = _staggered(engine, REQUESTS)
    for (prompt, budget, stops), got, request in zip(REQUESTS, outputs, requests):
        assert got == _alone(target, prompt, budget, stops), (name, len(prompt), budget)
        stopped = bool(stops) and got[-1] in stops
        assert request.finish_reason == ("stop" if stopped else "length")
        assert len(got) == budget or stopped
    if name == "draft":  # and two that start together (K=1 beside each other, then K=3 alone)
        pair_of = REQUESTS[:2]
        with engine:
            with engine._lock:
                two = [engine.submit(p, max_new_tokens=b, stop_token_ids=s) for p, b, s in pair_of]
            assert [r.result(timeout=300) for r in two] == [_alone(target, *r) for r in pair_of]
    stats = engine.stats()
    if name == "draft":  # every K of the table ran: drafting alone, at K=1 beside another, and not at all
        assert set(stats["steps"]) == {0, 1, 3}, stats
        assert stats["syncs"] >= 1, stats  # the draft caught up after calls at K = 0 before drafting again
    if name == "retrieval":  # the datastore holds the text: most drafts are kept
        assert stats["accepted"] > stats["draft_tokens"] / 2, stats
    # Bounded: empty, release; prefill and insert per bucket (16, 32, 64) and group size (1, 2, 3);
    # a run per K, width (1, 2, 3) and sampling kind (greedy, sampled, filtered); where K = 0 is in
    # the table beside a draft, the draft's catch-up per K that drafts.
    Ks = set(engine.k_table)
    synced = len(Ks - {0}) if 0 in Ks else 0
    assert len(stats["programs"]) == 2 + 2 * 3 * 3 + len(Ks) * 3 * 3 + synced


@pytest.mark.parametrize("name", ["plain", "draft"])
def test_a_burst_is_prefilled_together_and_equals_generate_alone(pair, engines, monkeypatch, name):
    """Requests that wait together (of different lengths, budgets and stops) take the free
    slots in one prefill call; each still gives what it gives alone. A call runs one step
    after rows were inserted, `steps_per_call` while every slot is live, at most OPEN_STEPS
    when one is free. The device never waits on the host: each call but the last is read
    after the next one was dispatched, but for one read first after a row finished while none
    waited (its client's next request may come: it then goes ahead of that next call)."""
    from specjax.serve.engine import OPEN_STEPS

    engine = engines(name)
    calls, runs = [], []
    real, real_run = engine.programs.prefill, engine.programs.run
    monkeypatch.setattr(engine.programs, "prefill", lambda prompts, *a: calls.append(len(prompts)) or real(prompts, *a))

    def run(state, *a, **kw):
        live = len(engine.scheduler.live)
        out = real_run(state, *a, **kw)
        runs.append((live, a[-1], int(out[1].taken)))
        return out

    order, real_dispatch, real_deliver = [], engine._dispatch, engine._deliver

    def dispatch(*args, **kwargs):
        call = real_dispatch(*args, **kwargs)
        if call is not None:
            order.append(("run", call))
        return call

    monkeypatch.setattr(engine.programs, "run", run)
    monkeypatch.setattr(engine, "_dispatch", dispatch)
    finished = []  # per read: whether a row finished in it

    def deliver(call):
        order.append(("read", call))
        real_deliver(call)
        finished.append(engine._finished)

    monkeypatch.setattr(engine, "_deliver", deliver)
    # Budgets 20, 6, 15: after the fresh step and a full call (5 tokens), the 6-token request
    # finishes at the first step of the next full call, which must end there.
    burst = [(p, b, s) for (p, _, s), b in zip(REQUESTS[2:2 + SLOTS], (20, 6, 15))]
    with engine:
        with engine._lock:  # the device thread admits none of them before all wait
            submitted = [engine.submit(p, max_new_tokens=b, stop_token_ids=s) for p, b, s in burst]
        outputs = [r.result(timeout=300) for r in submitted]
    assert calls == [SLOTS]
    assert runs[0] == (SLOTS, 1, 1)  # the fresh rows' first tokens
    assert any(taken == engine.programs.steps_per_call for _, _, taken in runs), runs
    assert all(taken <= OPEN_STEPS for live, _, taken in runs if live < SLOTS), runs
    assert any(live < SLOTS for live, _, _ in runs), runs
    calls = [c for what, c in order if what == "run"]
    assert [c for what, c in order if what == "read"] == calls  # each read once, in order
    runs_before = [sum(what == "run" for what, _ in order[:i]) for i, (what, _) in enumerate(order) if what == "read"]
    first = [k for k, n in enumerate(runs_before[:-1]) if n == k + 1]  # read before call k + 1 was dispatched
    assert first and all(k and finished[k - 1] for k in first), (first, finished)
    assert all(n in (k + 1, k + 2) for k, n in enumerate(runs_before)), runs_before
    for (prompt, budget, stops), got in zip(burst, outputs):
        assert got == _alone(pair[0], prompt, budget, stops)


def test_an_engine_serves_while_every_program_compiles_in_the_background(pair):
    """compile_all(background=True) (`specjax serve` on a CPU) returns before any program is
    compiled, and requests are served meanwhile, each as it is alone (compiling what it needs
    on the engine's thread); the thread compiles every program, times the steps, then the
    grouped prefills, and says how many are left as it goes."""
    target = pair[0]
    engine = specjax.Engine(target, slots=SLOTS, max_len=MAX_LEN, steps_per_call=4)
    started = time.perf_counter()
    engine.compile_all(background=True)
    assert time.perf_counter() - started < 1 and engine.warming and engine.step_ms is None
    assert 0 < engine.stats()["programs_compiling"] <= len(engine.stats()["programs"])
    with engine:
        got = [engine.submit(p, max_new_tokens=b, stop_token_ids=s) for p, b, s in REQUESTS[:4]]
        assert [r.result(timeout=600) for r in got] == [_alone(target, *r) for r in REQUESTS[:4]]
        assert engine.wait_warm(600) and engine.compile_error is None
        assert engine.stats()["programs_compiling"] == engine.stats()["compiling"] == 0
        assert set(engine.step_ms) == {0} and set(engine.step_ms[0]) == set(engine.programs.widths)
        got = engine.submit(REQUESTS[5][0], max_new_tokens=REQUESTS[5][1], stop_token_ids=REQUESTS[5][2])
        assert got.result(timeout=600) == _alone(target, *REQUESTS[5])


@pytest.mark.slow  # the suite's time on 2 cores (-m slow runs it)
def test_grouped_prefills_compile_in_the_background(pair, engines, monkeypatch):
    """compile_all(groups_later=True) returns before the prefills of several requests are
    compiled: until they are, a burst is prefilled one request at a time, and once they are,
    together; each request still gives what it gives alone. A background compile that fails
    leaves the groups unused and says why."""
    engine = engines("plain")
    gate, real_group = threading.Event(), engine.programs.compile_group
    monkeypatch.setattr(engine.programs, "compile_group", lambda *a: gate.wait(60) and real_group(*a))
    calls, real = [], engine.programs.prefill
    monkeypatch.setattr(engine.programs, "prefill", lambda prompts, *a: calls.append(len(prompts)) or real(prompts, *a))
    burst = REQUESTS[2:2 + SLOTS]
    expected = [_alone(pair[0], *r) for r in burst]

    def prefills_of_a_burst():
        calls.clear()
        with engine:
            with engine._lock:  # the device thread admits none of them before all wait
                submitted = [engine.submit(p, max_new_tokens=b, stop_token_ids=s) for p, b, s in burst]
            assert [r.result(timeout=300) for r in submitted] == expected
        return list(calls)

    def settled():
        deadline = time.monotonic() + 120
        while engine.stats()["compiling"] and engine.compile_error is None and time.monotonic() < deadline:
            time.sleep(0.05)

    engine.compile_all(groups_later=True)
    assert engine.stats()["compiling"] == len(engine.programs.groups()) == 2 * 3  # sizes 2, 3 x buckets 16, 32, 64
    assert engine.warming
    # compile_all measured a call's cost from the compiled one-row admissions (a number, at most the default's)
    assert 0 <= engine.stats()["prefill_call_tokens"] <= engine.programs.most_tokens
    assert prefills_of_a_burst() == [1] * SLOTS
    gate.set()
    settled()
    assert engine.stats()["compiling"] == 0 and engine.compile_error is None
    assert engine.wait_warm(60) and not engine.warming
    assert prefills_of_a_burst() == [SLOTS]

    # Stopped (a process that exits), the compile ends after the program it is compiling.
    gate.clear()
    engine.compile_all(groups_later=True)
    assert engine.warming and engine.stats()["compiling"] == 6
    threading.Timer(0.2, gate.set).start()
    engine.stop_compiling()
    assert not engine.warming and engine.stats()["compiling"] == 5
    engine.warmup.pending.clear()  # those programs are compiled already

    def fail(*a):
        raise RuntimeError("out of memory, say")

    monkeypatch.setattr(engine.programs, "compile_group", fail)
    engine.compile_all(groups_later=True)
    settled()
    assert "out of memory, say" in str(engine.compile_error) and engine.stats()["compiling"] == 6
    assert prefills_of_a_burst() == [1] * SLOTS
    engine.warmup.error = None
    engine.warmup.pending.clear()


def test_chunks_come_as_the_device_emits_them(pair, engines):
    """Alone in a plain engine of 4 steps per call, a request of 16 tokens arrives as its
    first token alone (the call after a row is inserted steps once), then chunks of
    OPEN_STEPS (other slots are free), which together are generate's output."""
    from specjax.serve.engine import OPEN_STEPS

    engine = engines("plain")
    prompt = REQUESTS[0][0]
    with engine:
        chunks = list(engine.submit(prompt, max_new_tokens=16))
    assert OPEN_STEPS < engine.programs.steps_per_call
    rest = [15 % OPEN_STEPS] if 15 % OPEN_STEPS else []
    assert [len(c) for c in chunks] == [1] + [OPEN_STEPS] * (15 // OPEN_STEPS) + rest
    assert [t for c in chunks for t in c] == _alone(pair[0], prompt, 16, ())


def test_a_call_runs_the_steps_that_last_about_call_ms(pair, engines):
    """Where its steps were timed (`compile_all`), a call runs as many as last about CALL_MS
    (`KPolicy.call_steps`), 1 to steps_per_call: steps dearer than CALL_MS give a step a call,
    so a request's chunks come a step apart; untimed, steps_per_call (OPEN_STEPS with a
    slot free, as above)."""
    from specjax.serve.policy import CALL_MS

    engine = engines("plain")
    policy, widths = engine.policy, engine.programs.widths
    assert policy.call_steps(1, 0, 4) == 4  # untimed
    try:
        policy.price({0: {w: CALL_MS / 3 for w in widths}}, widths)
        assert [policy.call_steps(n, 0, 4) for n in (1, 2, 3)] == [3, 3, 3]
        policy.price({0: {w: CALL_MS / 100 for w in widths}}, widths)
        assert policy.call_steps(1, 0, 4) == 4
        policy.price({0: {1: CALL_MS / 10, 2: CALL_MS / 10, 3: 2 * CALL_MS}}, widths)
        assert [policy.call_steps(n, 0, 4) for n in (1, 2, 3)] == [4, 4, 1]
        policy.price({0: {w: 2 * CALL_MS for w in widths}}, widths)
        prompt = REQUESTS[0][0]
        with engine:
            chunks = list(engine.submit(prompt, max_new_tokens=8))
        assert [len(c) for c in chunks] == [1] * 8
        assert [t for c in chunks for t in c] == _alone(pair[0], prompt, 8, ())
    finally:
        policy.step_ms = None


def test_every_k_shares_one_copy_of_the_drafters_weights(pair):
    """The drafter is bound once: its float32 weights are cast to a bfloat16 target's dtype
    once, and the programs of every K read that one copy (memory counts it once)."""
    from specjax.memory import nbytes

    target = pair[0]
    bf16 = target.replace(params=jax.tree.map(lambda w: w.astype(jnp.bfloat16), target.params))
    engine = specjax.Engine(bf16, draft=Eagle3.init(target, jax.random.key(1)), slots=SLOTS, max_len=32,
                            num_draft_tokens=(3, 2, 1))
    weights = [jax.tree.leaves(d.params) for d in engine.programs.drafters.values()]
    assert len(weights) == 3 and {w.dtype for w in weights[0]} == {jnp.dtype(jnp.bfloat16)}
    assert all(a is b for other in weights[1:] for a, b in zip(weights[0], other))
    assert engine.memory["weight_bytes"] == nbytes(bf16.params) + nbytes(engine.programs.deepest)


@pytest.mark.slow  # (a minute of the suite on 2 cores)
def test_sampling_through_the_engine_is_exact_beside_greedy_rows():
    """Per-row settings: sampled requests with top-k, top-p, min-p, a logit bias and the three
    penalties (chi-square against the enumerated joint) share the batch with greedy ones,
    some with a bias or penalties of their own (each exactly its plain continuation)."""
    target, draft = _tiny(0, 0.6), _tiny(1, 0.15, base=_tiny(0, 0.6))
    settings = dict(temperature=1.0, top_k=5, top_p=0.9, min_p=0.1, logit_bias={2: 1.5, 4: -100.0, 6: -2.0},
                    presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.5)
    engine = specjax.Engine(target, draft=draft, slots=16, max_len=16, num_draft_tokens=2, steps_per_call=2)
    others = [{}, dict(logit_bias={3: 5.0}), dict(repetition_penalty=3.0, presence_penalty=2.0)]
    alone = [_alone(target, PROMPT, 2, (), **s) for s in others]
    assert len({tuple(a) for a in alone}) == 3
    rows = 1500
    with engine:
        sampled = [engine.submit(PROMPT, max_new_tokens=2, seed=i, **settings) for i in range(rows)]
        greedy = [[engine.submit(PROMPT, max_new_tokens=2, **s) for _ in range(16)] for s in others]
        tokens = np.array([r.result(timeout=600) for r in sampled])
        assert [[r.result() for r in group] for group in greedy] == [[a] * 16 for a in alone]
    expected = _exact_joint(target, settings.pop("temperature"), bias=settings.pop("logit_bias"), **settings)
    observed = np.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V).reshape(V, V)
    assert observed[expected == 0].sum() == 0
    assert _chi_square_p(observed, expected) > 1e-3


def test_a_seeded_request_reproduces_whatever_its_slot_and_neighbours(pair):
    """Deterministic mode: the same seed gives the same bits alone (= generate with its key),
    among other requests, and in another slot."""
    target, drafts, _ = pair
    prompt, seed = REQUESTS[1][0], 1234
    settings = dict(max_new_tokens=10, temperature=0.8, top_k=20)
    engine = specjax.Engine(target, draft=specjax.PromptLookup(2, 1), slots=SLOTS, max_len=MAX_LEN,
                            num_draft_tokens=2, deterministic=True, steps_per_call=4)
    with engine:
        alone = engine.submit(prompt, seed=seed, **settings).result(timeout=300)
        others = [engine.submit(p, max_new_tokens=b, temperature=1.0, seed=i) for i, (p, b, _) in
                  enumerate(REQUESTS[:2])]
        crowded = engine.submit(prompt, seed=seed, **settings)  # in the third slot, beside two others
        assert crowded.result(timeout=300) == alone
        [r.result(timeout=300) for r in others]
    prompts, lengths = specjax.pad_prompts([prompt])
    out = specjax.generate(target, prompts, lengths, key=jax.random.key(seed), deterministic=True,
                           draft=specjax.PromptLookup(2, 1), num_draft_tokens=2, **settings)
    assert alone == [int(t) for t in np.asarray(out.tokens[0])]


def test_cancel_frees_the_slot_for_a_waiting_request(engines):
    """A cancelled live request's slot takes the waiting request at once: it finishes while the
    other long requests still run. A request cancelled while waiting ends at once."""
    engine = engines("plain")
    budget = MAX_LEN - 1  # a one-token prompt's longest
    first = []  # the first long request, cancelled at its first chunk (its slot live), on the engine's thread
    with engine:
        with engine._lock:  # (none admitted before all are in)
            long = [engine.submit(REQUESTS[5][0], max_new_tokens=budget,
                                  listener=(lambda tokens: tokens and first[0].cancel()) if i == 0 else None)
                    for i in range(SLOTS)]
            first.append(long[0])
            waiting = engine.submit(REQUESTS[0][0], max_new_tokens=5)
            queued = engine.submit(REQUESTS[1][0], max_new_tokens=5)
            queued.cancel()  # still waiting: finished at once
            assert queued.finish_reason == "cancelled" and queued.result() == []
        assert len(waiting.result(timeout=300)) == 5 and waiting.finish_reason == "length"
        assert not long[1].finished and not long[2].finished  # the cancelled slot served it
        assert long[0].finish_reason == "cancelled" and len(long[0].tokens) < budget
        for r in long[1:]:
            r.cancel()
    assert engine.scheduler.load() == (0, 0)


def test_refusals_name_the_problem(pair, engines):
    target, drafts, _ = pair
    engine = engines("plain")
    with pytest.raises(RuntimeError, match="not running"):
        engine.submit([1, 2], max_new_tokens=2)
    with engine:
        for kwargs, match in [
            (dict(prompt_ids=[]), "non-empty"), (dict(prompt_ids=[1, 10 ** 6]), "must lie in"),
            (dict(prompt_ids=[1] * 60, max_new_tokens=5), "exceeds the engine's max_len"),
            (dict(prompt_ids=[1], max_new_tokens=0), "max_new_tokens"),
            (dict(prompt_ids=[1], temperature=-1.0), "temperature"), (dict(prompt_ids=[1], top_p=0.0), "top_p"),
            (dict(prompt_ids=[1], stop_token_ids=list(range(9))), "stop ids"),
            (dict(prompt_ids=[1], seed=-3), "seed"),
        ]:
            with pytest.raises(ValueError, match=match):
                engine.submit(**{"max_new_tokens": 2, **kwargs})

    class OwnDrafter(specjax.drafters.Drafter):  # a user's drafter: whether its state splits by row is unknown
        pass

    with pytest.raises(ValueError, match="OwnDrafter's state per row"):
        specjax.Engine(target, draft=OwnDrafter(), slots=2, max_len=32)
    with pytest.raises(ValueError, match="cannot skip"):
        specjax.Engine(target, draft=Eagle3.init(target, jax.random.key(1)), slots=2, max_len=32,
                       num_draft_tokens=(2, 0))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        specjax.Engine(target, slots=2, max_len=10 ** 6)
    with pytest.raises(specjax.InsufficientMemoryError, match="slots"):
        specjax.Engine(target, slots=10 ** 6, max_len=target.config.max_position_embeddings)


def test_a_failed_preparation_fails_that_request_only(engines, monkeypatch):
    engine = engines("plain")
    real = engine.programs.prefill

    def prefill(prompts, *args):
        if any(len(p) == 2 for p in prompts):
            raise RuntimeError("broken preparation")
        return real(prompts, *args)

    monkeypatch.setattr(engine.programs, "prefill", prefill)
    with engine:
        with engine._lock:  # both wait, and are prepared together first
            bad = engine.submit([4, 5], max_new_tokens=3)
            good = engine.submit([4, 5, 6], max_new_tokens=3)
        with pytest.raises(RuntimeError, match="broken preparation"):
            bad.result(timeout=300)
        assert len(good.result(timeout=300)) == 3


@pytest.mark.parametrize("grouped", [False, True], ids=["groups_of_one", "a_failed_group_one_by_one"])
def test_a_failed_insert_loses_no_request(pair, engines, monkeypatch, grouped):
    """Three requests wait together and the first insert fails: its request fails with the
    error, and the two taken off the queue beside it are served as they would be alone (at
    02042b0 they were in neither queue and their clients waited forever). Taken in groups of
    one, or in a group of three whose preparation failed, then one by one."""
    engine = engines("plain")
    real_insert, real_prefill = engine.programs.insert, engine.programs.prefill
    inserts = []

    def insert(*args):
        inserts.append(1)
        if len(inserts) == 1:
            raise RuntimeError("injected insert failure")
        return real_insert(*args)

    def prefill(prompts, *args):
        if len(prompts) > 1:
            raise RuntimeError("a group's preparation failed")
        return real_prefill(prompts, *args)

    monkeypatch.setattr(engine.programs, "insert", insert)
    monkeypatch.setattr(engine.programs, "partition",
                        lambda lengths, *a, **k: [len(lengths)] if grouped else [1] * len(lengths))
    monkeypatch.setattr(engine.programs, "prefill", prefill if grouped else real_prefill)
    failures = engine.failures
    prompts = [[4, 5], [4, 5, 6], [4, 5, 6, 7]]  # the shortest is placed first
    with engine:
        with engine._lock:  # all three wait, and are taken together
            submitted = [engine.submit(p, max_new_tokens=3) for p in prompts]
        with pytest.raises(RuntimeError, match="injected insert failure"):
            submitted[0].result(timeout=60)
        for prompt, request in zip(prompts[1:], submitted[1:]):
            assert request.result(timeout=60) == _alone(pair[0], prompt, 3, ())
    assert engine.failures == failures + 1


def test_an_idle_engine_blocks_without_using_cpu(engines):
    engine = engines("plain")
    with engine:
        engine.submit([1, 2, 3], max_new_tokens=2).result(timeout=300)
        before = time.process_time()
        time.sleep(1.0)
        used = time.process_time() - before
        assert engine._thread.is_alive()
    assert used < 0.2, f"an idle engine used {used:.2f} s of CPU in 1 s"
    assert not any(t.name == "specjax-engine" for t in threading.enumerate())


def test_a_draft_that_skipped_steps_syncs_and_then_drafts_in_one_window(pair):
    """A draft model drafting for itself (the target) accepts every draft in steady state;
    after steps that did not draft (the engine's K = 0), `sync` feeds what it missed, so its
    next step's one-window catch-up again accepts all K. Without `sync` that step drafts from
    a cache with holes (still exact, by verification, but it accepts less): the control."""
    from specjax import loop

    target = pair[0]
    drafter = specjax.DraftModel(target).resolve(3).bind(target)
    prompts, lengths = specjax.pad_prompts([list(range(3, 12)), list(range(20, 25))])
    step = jax.jit(lambda d, s: loop.step(target, d, s, jnp.float32(0))[0])
    state = jax.jit(lambda d: loop.initial_state(target, d, prompts, lengths, jax.random.key(0), 40))(drafter)
    state = step(drafter, state)
    np.testing.assert_array_equal(state.stats.accepted, [3, 3])  # steady state: the window suffices
    for _ in range(5):
        state = step(None, state)  # K = 0: the draft's state is carried, 5 tokens behind
    synced = state.replace(draft_state=jax.jit(drafter.sync)(state.draft_state, state.tokens, state.length,
                                                             state.done))
    np.testing.assert_array_equal(step(drafter, synced).stats.accepted - state.stats.accepted, [3, 3])
    assert (step(drafter, state).stats.accepted - state.stats.accepted < 3).any()


def test_the_k_table_follows_the_acceptance_the_traffic_shows(pair, monkeypatch):
    """A cost profile whose own text is drafted at 0.5 a position speculates with one live
    row only: (2, 0, 0). A draft that is the target itself keeps every draft; once the
    traffic has shown it (ADAPT_DRAFTS drafts, shrunk here), the table is chosen again
    among the compiled Ks: K = 2 at every load. Outputs stay the target's own."""
    from specjax.serve import policy

    monkeypatch.setattr(policy, "ADAPT_DRAFTS", 8)
    monkeypatch.setattr(policy, "SEEN", 8)
    target = pair[0]
    profile = specjax.CostProfile((1, 3), ((1.0, 1.1, 1.2), (1.0, 2.0, 2.4)), (0.5, 0.5))
    engine = specjax.Engine(target, draft=target, slots=SLOTS, max_len=MAX_LEN, cost_profile=profile,
                            steps_per_call=4)
    assert engine.k_table == (2, 0, 0) and engine.policy.acceptance() == (0.5, 0.5)
    prompt, budget, stops = REQUESTS[0][0], 40, ()
    with engine:
        assert engine.submit(prompt, max_new_tokens=budget).result(timeout=300) == _alone(
            target, prompt, budget, stops)
        assert engine.policy.drafts >= 8 and min(engine.policy.acceptance()) > 0.9, engine.policy.acceptance()
        assert engine.k_table == (2, 2, 2)
        requests = [engine.submit(p, max_new_tokens=b, stop_token_ids=s) for p, b, s in REQUESTS[:3]]
        for (p, b, s), request in zip(REQUESTS[:3], requests):
            assert request.result(timeout=300) == _alone(target, p, b, s)
    assert engine.steps[0] == 0, engine.steps  # every step drafted


def test_a_table_that_always_drafts_can_turn_drafting_off(pair):
    """A profile whose text is drafted perfectly speculates at every load, (2, 2, 2); traffic
    that keeps no draft turns the table off, (0, 0, 0), and K = 0's programs were compiled
    beside K = 2's from the start (the engine never runs a K it has no program for)."""
    target, drafts, _ = pair
    profile = specjax.CostProfile((1, 3), ((1.0, 1.1, 1.2), (1.0, 1.2, 1.4)), (1.0, 1.0))
    engine = specjax.Engine(target, draft=drafts["far"], slots=SLOTS, max_len=MAX_LEN, cost_profile=profile)
    assert engine.k_table == (2, 2, 2) and sorted(engine.programs.drafters) == [0, 2]
    assert any("at K=0" in name for name in engine.stats()["programs"])
    engine.policy.record(2, np.zeros(256, int))  # 256 drafted steps that kept nothing
    assert engine.policy.acceptance() == (0.0, 1.0)  # no draft reached position 2: the profile's figure
    assert engine.k_table == (0, 0, 0)
    # EAGLE-3 drafts every step (it reads the target's states of each): no K = 0 to turn to,
    # so the table stays among the Ks compiled (it fell to K = 1, with no program, before).
    eagle = specjax.Engine(target, draft=Eagle3.init(target, jax.random.key(1)), slots=SLOTS, max_len=MAX_LEN,
                           cost_profile=profile)
    assert eagle.k_table == (2, 2, 2) and sorted(eagle.programs.drafters) == [2]
    eagle.policy.record(2, np.zeros(256, int))
    assert eagle.k_table == (2, 2, 2)


def test_a_profile_s_table_is_chosen_again_at_the_engine_s_own_steps(pair, engines):
    """`timing.step_costs` times every K's step at every width over live rows; an
    engine whose table a profile chose takes such costs (`KPolicy.price`, as `compile_all` does)
    and chooses again: a profile whose batch-3 steps make K = 2 lose beyond one row gives
    (2, 0, 0); steps measured cheap at every width give (2, 2, 2); costs missing a (K,
    width) are not taken."""
    programs = engines("draft").programs
    costs = timing.step_costs(programs, calls=1)
    assert sorted(costs) == sorted(programs.drafters), costs
    assert all(sorted(c) == list(programs.widths) and min(c.values()) > 0 for c in costs.values()), costs
    profile = specjax.CostProfile((1, 3), ((1.0, 1.1, 1.2), (1.0, 3.0, 4.0)), (0.9, 0.9))
    engine = specjax.Engine(pair[0], draft=pair[1]["near"], slots=SLOTS, max_len=MAX_LEN, cost_profile=profile)
    assert engine.k_table == (2, 0, 0) and engine.step_ms is None
    missing = {0: {1: 1.0, 2: 1.0}, 2: {1: 1.2, 2: 1.3, 3: 1.4}}  # K = 0 at width 3 missing
    engine.policy.price(missing, engine.programs.widths)
    assert engine.k_table == (2, 0, 0) and engine.step_ms is None
    cheap = {0: {1: 1.0, 2: 1.0, 3: 1.0}, 2: {1: 1.2, 2: 1.3, 3: 1.4}}
    engine.policy.price(cheap, engine.programs.widths)
    assert engine.k_table == (2, 2, 2) and engine.stats()["step_ms"] == cheap


def test_a_narrow_run_steps_its_rows_caches_in_place(engines):
    """A run over the state's first rows (one live request in a three-slot engine) reads and
    writes those rows' caches where they lie in the state: its program slices no cache
    rows out before its loop and writes none back after it (the loop carries the whole
    buffers, donated), so one request pays for no other slot's cache."""
    import re

    from specjax.serve import programs as P

    engine = engines("draft")
    p = engine.programs
    state = p.empty()
    caches = {tuple(x.shape) for x in jax.tree.leaves((state.target_cache.k, state.draft_state.cache.k))}
    K = max(p.drafters)
    hlo = P.run_steps.lower(p.target, p.drafters[K], p.deepest, state, p.threshold, np.int32(4),
                       steps=p.steps_per_call, open_steps=p.open_steps, width=1, kind="greedy", backend=p.backend,
                       rules=None).compile().as_text()
    entry = hlo[hlo.index("\nENTRY "):]
    entry = entry[:entry.index("\n}\n")]
    narrow = {(1,) + shape[1:] for shape in caches}
    made = [line for line in entry.splitlines()[1:] if "parameter(" not in line
            and any(re.search(r"\[%s\]" % ",".join(map(str, s)), line.split("=", 1)[-1].split("(")[0])
                    for s in narrow)]
    assert not made, made


def test_a_prefill_group_holds_at_most_group_tokens(pair, monkeypatch):
    """Several waiting requests are prefilled together only while their rows hold at most
    GROUP_TOKENS tokens (dense until inserted): a long bucket's requests go in smaller groups
    or alone, and a burst is partitioned among the groups that exist."""
    from specjax.serve import programs as programs_module

    monkeypatch.setattr(programs_module, "GROUP_TOKENS", 64)
    p = specjax.Engine(pair[0], slots=8, max_len=MAX_LEN).programs
    assert p.buckets == (16, 32, 64) and p.prefill_sizes == (1, 2, 4, 8)
    assert p.sizes == ((1, 16), (2, 16), (4, 16), (1, 32), (2, 32), (1, 64))
    assert p.partition([40] * 3, call_tokens=1000) == [1, 1, 1]  # no group in the 64 bucket
    assert sorted(p.partition([20] * 5, call_tokens=1000)) == [1, 2, 2]
    with pytest.raises(ValueError, match="at most 64 tokens together"):
        p.prefill([[1] * 40] * 2, [50] * 2, [(0.0, 0, 1.0)] * 2, np.full((2, 8), -1, np.int32), [0, 0])


def test_the_program_set_does_not_grow_with_slots(pair):
    """An engine compiles at most SIZES run widths and prefill group sizes, whatever its
    slots: 64 slots and 1,024 list as many runs, and 1,024 no more programs (paged,
    drafting, chunked prefill)."""
    from specjax.serve.shapes import SIZES, spread

    assert spread(8) == (1, 2, 4, 8) and spread(64) == (1, 8, 16, 32, 64) and spread(3) == (1, 2, 3)
    assert all(len(spread(s)) <= SIZES and spread(s)[0] == 1 and spread(s)[-1] == s for s in range(1, 2000))
    listed = {}
    for slots in (8, 64, 1024):
        engine = specjax.Engine(pair[0], draft=pair[1]["near"], slots=slots, max_len=MAX_LEN, kv_pages=64,
                                prefill_chunk=32)
        listed[slots] = engine.programs.listing()
        assert engine.programs.widths == engine.programs.prefill_sizes == spread(slots)
    runs = {slots: [x for x in names if x.startswith("run ")] for slots, names in listed.items()}
    assert len(runs[64]) == len(runs[1024]) <= 2 * SIZES * 3  # (K = 0 and the draft's, three sampling kinds)
    # (fewer admissions at 1,024: its largest groups would hold more than GROUP_TOKENS)
    assert len(listed[8]) < len(listed[64]) and len(listed[1024]) <= len(listed[64]), \
        {s: len(v) for s, v in listed.items()}


def test_a_burst_is_partitioned_by_what_a_call_costs(engines):
    """Waiting prompts (ascending) go in consecutive groups that cost least: n rows in their
    longest prompt's bucket cost n b token slots plus a call's own cost. Dear calls: one
    group, padded; cheap ones: short prompts apart from a long one; no padding to save:
    fewest calls; a group size not compiled yet is not used."""
    p = engines("plain").programs
    assert p.buckets == (16, 32, 64) and p.prefill_sizes == (1, 2, 3)
    assert p.partition([3, 5, 40], call_tokens=1000) == [3]
    assert p.partition([3, 5, 40], call_tokens=0) == [2, 1]  # 2 x 16 + 64, not 3 x 64
    assert p.partition([3, 5, 40], call_tokens=95) == [2, 1]  # 96 + 2 x 95 < 192 + 95
    assert p.partition([3, 5, 40], call_tokens=97) == [3]
    assert p.partition([3, 5, 9], call_tokens=0) == [3]  # one bucket: no padding to save
    assert p.partition([3, 5, 40], call_tokens=1000, skip={(3, 64)}) == [2, 1]
    assert p.partition([3, 5, 9], call_tokens=0, skip={(3, 16), (2, 16)}) == [1, 1, 1]
