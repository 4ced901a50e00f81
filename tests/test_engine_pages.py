"""The engine with its target's cache in pages (Engine(kv_pages=...)): staggered requests
give what `generate` gives each alone, with a pool too small for all of them at once (so
that requests wait for pages, and running ones are preempted and resume), a pool whose
pages all come back when the engine is idle, a cancelled request's pages freed, and a
request larger than the pool refused at submit; prefixes cached and shared, and long
prompts prefilled a chunk a call while other rows stream."""


import time

import jax
import numpy as np
import pytest

import specjax
from specjax import loop
from specjax.drafters import Eagle3
from specjax.sampling import Settings
from specjax.serve.pages import page_keys
from specjax.serve.programs import insert_rows
from tests.test_engine import MAX_LEN, REQUESTS, SLOTS, _alone, _staggered

PAGE = 8


@pytest.fixture(scope="module")
def paged(pair):
    target, drafts, _ = pair
    made = {}

    def make(name):
        if name not in made:
            draft, table = {"plain": (None, None), "draft": (drafts["near"], (3, 1, 0)),
                            "eagle3": (Eagle3.init(target, jax.random.key(1)), (3, 2, 1)),
                            # a tree of 6 nodes: a verification's in-flight tokens pass its depth
                            "tree": (specjax.DraftModel(drafts["near"], specjax.Tree(3, 2, 6)), None),
                            "lookup": (specjax.PromptLookup(2, 1), (3, 3, 3)),
                            "draft_off": (drafts["near"], (0, 0, 3))}[name]  # alone, K = 0: its cache lags
            # 7 pages of 8 (56 tokens, less than max_len): three requests of up to 48 tokens cannot
            # all run at once. Prompts over 16 tokens are prefilled 16 a call (chunked prefill).
            made[name] = specjax.Engine(target, draft=draft, slots=SLOTS, max_len=MAX_LEN, num_draft_tokens=table,
                                        steps_per_call=4, kv_pages=7, page_size=PAGE, prefill_chunk=16)
        return made[name]

    yield make
    for engine in made.values():
        if engine._thread is not None:
            engine.stop()


@pytest.mark.parametrize("name", [pytest.param("plain", marks=pytest.mark.slow),
                                  pytest.param("draft", marks=pytest.mark.slow),  # (the tree's is a draft model's)
                                  pytest.param("eagle3", marks=pytest.mark.slow), "tree",
                                  pytest.param("lookup", marks=pytest.mark.slow)])
def test_paged_requests_equal_generate_alone(pair, paged, name):
    target = pair[0]
    engine = paged(name)
    outputs, requests = _staggered(engine, REQUESTS)
    for (prompt, budget, stops), got in zip(REQUESTS, outputs):
        assert got == _alone(target, prompt, budget, stops), (name, len(prompt), budget)
    stats = engine.stats()
    assert stats["kv_pages"] == 7 and stats["page_size"] == PAGE and stats["kv_capacity_tokens"] == 56
    assert stats["free_pages"] == 7 and stats["kv_cache_usage"] == 0.0, stats  # idle: every page back
    assert engine.pages.owners() == []
    caches = loop.caches(engine.runner.state)
    assert len(caches) == (1 if name in ("plain", "lookup") else 2)  # the target's, and a draft model's or layer's
    for cache in caches:  # every cache in pools of the engine's pages, one table
        assert cache.k[0].shape[0] == 8 and cache.k[0].shape[2] == PAGE, cache.k[0].shape
        assert cache.pages.shape == (SLOTS, engine.programs.table_width)
    if name == "plain":  # the server's gauge, under vLLM's name
        from prometheus_client import generate_latest

        from specjax.serve.metrics import Metrics
        scraped = generate_latest(Metrics(engine, "m").registry).decode()
        assert 'specjax:kv_cache_usage_perc{model_name="m"} 0.0' in scraped


def test_paged_admission_cancellation_and_refusal(pair, paged):
    target = pair[0]
    engine = paged("plain")
    with pytest.raises(ValueError, match=r"needs more than the engine's whole page pool \(56 tokens in 7 pages of 8\)"):
        engine.submit([5] * 40, max_new_tokens=20)  # 60 tokens: within max_len, not the pool
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 97, 40)]
    seen = []

    def first_chunk(tokens):  # on the engine's thread, between calls: what waits, then cancel
        if tokens and not seen:
            seen.append((engine.load(), list(waiting.tokens)))
            long.cancel()

    with engine:
        with engine._lock:  # both queued before the engine admits either
            long = engine.submit(prompt, max_new_tokens=16, listener=first_chunk)  # 40 + 16: 6 pages, then 7
            waiting = engine.submit(prompt[:5], max_new_tokens=20)  # 2 pages at once: more than are left
        assert waiting.result(timeout=300) == _alone(target, prompt[:5], 20, ())
    assert seen == [((1, 1), [])]  # a slot was free: it waited for pages
    assert long.finish_reason == "cancelled" and len(long.tokens) < 16
    assert engine.stats()["free_pages"] == 7


def test_rows_that_outgrow_the_pool_are_preempted_and_resume_exactly(pair, paged):
    """Three requests of 10 + 30 tokens submitted together on 7 pages of 8: two start (3
    pages each), and as they grow together past the pool the newer is preempted, waits with
    its tokens, and resumes by prefilling them: every output is generate's alone. Two have
    penalties: a resumed one still counts only its output as output (not its whole context)."""
    target = pair[0]
    engine = paged("plain")
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 97, 10)] for _ in range(3)]
    penalties = [{}, dict(presence_penalty=1.5, repetition_penalty=1.3), dict(frequency_penalty=0.7)]
    before = engine.stats()["preemptions"]
    with engine:
        with engine._lock:
            requests = [engine.submit(p, max_new_tokens=30, **s) for p, s in zip(prompts, penalties)]
        outputs = [r.result(timeout=300) for r in requests]
    assert outputs == [_alone(target, p, 30, (), **s) for p, s in zip(prompts, penalties)]
    assert engine.stats()["preemptions"] > before
    assert engine.stats()["free_pages"] == 7


def test_the_pool_is_sized_from_a_byte_budget(pair, monkeypatch):
    """kv_cache_bytes: as many pages as the bytes hold, every cache's share of a page counted
    (the target's and the draft model's), the null page included, at most what every slot at
    max_len holds; "auto" from the device's free memory less the programs' temporaries (a CPU
    reports none: refused); too small a budget, or both sizes, refused with the numbers."""
    from specjax.serve import sizing

    target, drafts, _ = pair
    engine = specjax.Engine(target, draft=drafts["near"], slots=SLOTS, max_len=MAX_LEN, kv_cache_bytes="96KiB",
                            page_size=PAGE)
    per_page = sum(2 * m.config.num_layers * m.config.num_kv_heads * m.config.head_dim * PAGE * 4
                   for m in (target, drafts["near"]))  # float32 keys and values, both models
    stats = engine.stats()
    assert stats["kv_pages"] == 96 * 1024 // per_page - 1 and stats["kv_cache_bytes"] == per_page * (stats["kv_pages"] + 1)
    assert engine.programs.paging == (stats["kv_pages"] + 1, PAGE)
    big = specjax.Engine(target, slots=SLOTS, max_len=MAX_LEN, kv_cache_bytes=2 ** 30, page_size=PAGE)
    assert big.stats()["kv_pages"] == SLOTS * big.programs.table_width  # no more than the rows can hold
    with pytest.raises(ValueError, match=r"device \(cpu\) does not report: give kv_cache_bytes in bytes"):
        specjax.Engine(target, slots=SLOTS, max_len=MAX_LEN, kv_cache_bytes="auto")
    with pytest.raises(ValueError, match=r"kv_cache_bytes='1KiB' leaves 1.0 KiB for pages of .* not one page"):
        specjax.Engine(target, slots=SLOTS, max_len=MAX_LEN, kv_cache_bytes="1KiB")
    with pytest.raises(ValueError, match="give kv_pages or kv_cache_bytes"):
        specjax.Engine(target, slots=SLOTS, max_len=MAX_LEN, kv_pages=4, kv_cache_bytes="1MiB")
    monkeypatch.setattr(sizing.memory, "device_free_bytes", lambda mesh=None: 4 * 2 ** 20)
    auto = specjax.Engine(target, slots=1, max_len=32, kv_cache_bytes="auto", page_size=PAGE)
    stats = auto.stats()
    temporaries = stats["kv_budget_temporary_bytes"]
    assert 0 < temporaries < 4 * 2 ** 20 and stats["kv_budget_free_bytes"] == 4 * 2 ** 20
    per_page = 2 * target.config.num_layers * target.config.num_kv_heads * target.config.head_dim * PAGE * 4
    rest = auto.programs.state_bytes() - per_page * (stats["kv_pages"] + 1)
    assert stats["kv_pages"] == min((int(0.9 * 4 * 2 ** 20) - rest - temporaries) // per_page - 1,
                                    auto.programs.table_width)


@pytest.mark.slow  # the suite's time on 2 cores (test_exact holds generate's deterministic bits)
def test_deterministic_pages_give_generate_s_bits(pair):
    """Deterministic mode over pages (its passes read their own keys back through the table):
    sampled requests, a draft model at K=2, on a pool small enough that they wait and are
    preempted, each the same bits as generate's deterministic run alone with its seed."""
    target, drafts, _ = pair
    engine = specjax.Engine(target, draft=drafts["near"], slots=2, max_len=MAX_LEN, num_draft_tokens=2,
                            deterministic=True, steps_per_call=2, kv_pages=7, page_size=PAGE)
    settings = dict(max_new_tokens=20, temperature=0.8, top_k=20)  # 3 pages each at first, 4 at last
    prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 97, 7)] for i in range(3)]  # one shape: one compile
    with engine:
        with engine._lock:
            submitted = [engine.submit(p, seed=i, **settings) for i, p in enumerate(prompts)]
        got = [r.result(timeout=300) for r in submitted]
    for i, (prompt, tokens) in enumerate(zip(prompts, got)):
        out = specjax.generate(target, *specjax.pad_prompts([prompt]), key=jax.random.key(i), deterministic=True,
                               draft=drafts["near"], num_draft_tokens=2, **settings)
        assert tokens == [int(t) for t in np.asarray(out.tokens[0])], i
    assert engine.stats()["free_pages"] == 7 and engine.stats()["preemptions"] > 0


def test_pages_larger_than_a_bucket_round_the_buckets_up(pair):
    """Pages of 32 (a multiple of 16, as a TPU kernel wants larger pages): the prompt buckets
    start at a page and the last rounds max_len up to whole pages; requests still give what
    generate gives them alone. A page of 24 (neither divides 16 nor is a multiple) is refused."""
    target = pair[0]
    engine = specjax.Engine(target, slots=2, max_len=MAX_LEN, kv_pages=4, page_size=32, steps_per_call=4)
    assert engine.programs.buckets == (32, 64) and engine.programs.cache_len >= 64
    chosen = [REQUESTS[4], REQUESTS[2]]  # 30 + 15 tokens (2 pages), 3 + 20
    with engine:
        got = [r.result(timeout=300) for r in [engine.submit(p, max_new_tokens=b, stop_token_ids=s)
                                                for p, b, s in chosen]]
    assert got == [_alone(target, *r) for r in chosen]
    with pytest.raises(ValueError, match="page_size must divide 16 or be a multiple of it"):
        specjax.Engine(target, slots=2, max_len=MAX_LEN, kv_pages=4, page_size=24)


SHARED = [int(t) for t in np.random.default_rng(7).integers(3, 97, 26)]  # 3 full pages of 8, and 2 tokens


@pytest.mark.parametrize("name", [pytest.param("plain", marks=pytest.mark.slow), "draft", "eagle3",
                                  pytest.param("tree", marks=pytest.mark.slow)])
def test_a_cached_prefix_gives_what_a_fresh_prefill_gives(pair, paged, name):
    """Prefix caching (on by default where paged): a request whose context begins with an
    earlier one's takes its 3 full pages of every cache (the target's, the draft model's or
    EAGLE-3's layer's) and prefills the rest: the same output as generate alone, and the
    same drafts accepted as its fresh prefill (the drafter's cached pages are right too).
    After a request that needs every page evicts them, the same prompt is prefilled whole,
    as right. Idle, every page is held by no one."""
    target = pair[0]
    engine = paged(name)
    other = [int(t) for t in np.random.default_rng(8).integers(3, 97, 37)]
    asked = [SHARED + [5, 9, 13], SHARED + [5, 9, 13], SHARED + [44, 2, 71, 8, 30, 12, 6, 19, 3],
             other, SHARED + [5, 9, 13]]  # (the 4th's 37 + 12 tokens and those in flight take all 7 pages)
    before = engine.stats()
    outputs, cached, accepted = [], [], []
    with engine:
        for prompt in asked:
            start = engine.stats()["accepted"]
            request = engine.submit(prompt, max_new_tokens=12)
            outputs.append(request.result(timeout=300))
            cached.append(request.cached_tokens)
            accepted.append(engine.stats()["accepted"] - start)
    assert outputs == [_alone(target, p, 12, ()) for p in asked]
    assert cached == [0, 24, 24, 0, 0], cached
    if name != "plain":
        assert accepted[1] == accepted[0] == accepted[4], accepted
    stats = engine.stats()
    assert stats["prefix_cache_queries"] - before["prefix_cache_queries"] == sum(map(len, asked))
    assert stats["prefix_cache_hits"] - before["prefix_cache_hits"] == 48
    assert stats["free_pages"] == 7 and stats["cached_pages"] > 0
    assert engine.pages.owners() == []
    engine.pages.check()  # every page's holders back to zero
    if name == "draft":  # the server's counters, under vLLM's names
        from prometheus_client import generate_latest

        from specjax.serve.metrics import Metrics
        scraped = generate_latest(Metrics(engine, "m").registry).decode()
        assert f'specjax:prefix_cache_hits_total{{model_name="m"}} {float(stats["prefix_cache_hits"])}' in scraped
        assert f'specjax:prefix_cache_queries_total{{model_name="m"}} {float(stats["prefix_cache_queries"])}' in scraped


@pytest.mark.parametrize("name", [pytest.param("plain", marks=pytest.mark.slow), "draft",
                                  pytest.param("eagle3", marks=pytest.mark.slow),
                                  pytest.param("draft_off", marks=pytest.mark.slow),  # (the next test's contents)
                                  pytest.param("tree", marks=pytest.mark.slow)])
def test_a_conversation_s_next_turn_takes_the_pages_its_reply_wrote(pair, paged, name):
    """A finished request's pages are cached up to where every cache of its row holds its
    tokens (`Drafter.held`): its reply's too, not its prompt's alone. A next turn that
    resends prompt and reply takes 4 full pages (32 tokens; its prompt's own were 3), and
    gives what generate alone gives it, with the same drafts accepted as when the pages are
    evicted first and it is prefilled whole."""
    target = pair[0]
    engine = paged(name)
    other = [int(t) for t in np.random.default_rng(8).integers(3, 97, 37)]
    with engine:
        reply = engine.submit(SHARED, max_new_tokens=12).result(timeout=300)
        turn = SHARED + reply + [17, 4, 60]
        runs = []
        for prompt, budget in ((turn, 6), (other, 12), (turn, 6)):  # the second takes every page
            start = engine.stats()["accepted"]
            request = engine.submit(prompt, max_new_tokens=budget)
            runs.append((request.result(timeout=300), request.cached_tokens, engine.stats()["accepted"] - start))
    (cached_out, cached, cached_accepted), _, (fresh_out, fresh, fresh_accepted) = runs
    assert cached == 32 and fresh == 0, (cached, fresh)
    assert cached_out == fresh_out == _alone(target, turn, 6, ())
    assert cached_accepted == fresh_accepted, (cached_accepted, fresh_accepted)
    assert engine.pages.owners() == []
    engine.pages.check()


@pytest.mark.parametrize("name", ["draft", "eagle3", "draft_off", pytest.param("tree", marks=pytest.mark.slow)])
def test_the_pages_a_finished_row_caches_hold_what_a_prefill_writes(pair, paged, name, monkeypatch):
    """`Drafter.held` claims no more than the drafter's cache holds: every page a finished
    row cached (its reply's among them) holds, in every cache, what a prefill of the same
    tokens writes into it. A drafter's cache may lag its row when it finishes (a draft
    model's by the tokens it has not fed, an EAGLE layer's by its last pass): such pages
    stay out, or a later request would read junk (with the drafter's lag ignored, this
    test fails at a page 4 that the drafter had not finished). A draft model that never
    drafted (K = 0: its cache holds the prompt alone) is fed the row's tokens as it ends
    (`Programs.catch_up`), and every full page is cached."""
    engine = paged(name)
    held = {}
    end = engine._end  # (a finished row's request, and where its caches hold it before any catch-up)
    monkeypatch.setattr(engine, "_end", lambda slot, r, h: (held.setdefault(r, h), end(slot, r, h))[1])

    def pages_by_key():  # key -> the page's entries in every cache (the engine stopped)
        pools = loop.caches(engine.runner.state)
        return {key: [np.asarray(x[page]) for cache in pools for x in cache.k + cache.v]
                for key, page in engine.pages.cached().items()}

    other = [int(t) for t in np.random.default_rng(8).integers(3, 97, 37)]
    lagged = 0
    for budget in range(14, 19):
        with engine:
            request = engine.submit(SHARED, max_new_tokens=budget)
            context = SHARED + request.result(timeout=300)
        decoded = pages_by_key()
        with engine:  # every page taken, then the same tokens prefilled whole (and one more)
            engine.submit(other, max_new_tokens=12).result(timeout=300)
            again = engine.submit(context + [17], max_new_tokens=1)
            again.result(timeout=300)
        assert again.cached_tokens == 0
        prefilled = pages_by_key()
        mine = page_keys(context, PAGE, engine.scheduler.salt, len(context))  # every full page followed by a token
        fed = len(context) - 1 if engine.programs.catches_up else held[request]  # a lagging draft caught up first
        assert sum(k in decoded for k in mine) == fed // PAGE >= 4, (budget, held[request])
        lagged += held[request] // PAGE < (len(context) - 1) // PAGE
        for j, key in enumerate(mine):
            if key in decoded:
                for got, want in zip(decoded[key], prefilled[key]):
                    np.testing.assert_allclose(got, want, atol=1e-4, err_msg=f"page {j}")
    assert lagged, "no row finished with its drafter's cache a page behind its own: the test shows nothing"
    if engine.programs.catches_up:  # a lag within the row's last page loses no page: nothing is fed
        untouched = object()
        assert engine.programs.catch_up(untouched, list(range(20)), 17, []) == (untouched, 17)  # 17 // 8 == 19 // 8


@pytest.mark.slow  # the suite's time on 2 cores (the test above holds greedy's)
def test_a_deterministic_next_turn_on_its_reply_s_pages_gives_generate_s_bits(pair):
    """Deterministic mode: a reply's pages, written by verification passes (and the draft's
    catch-ups and chains), hold what a prefill of those tokens writes, bit for bit: a sampled
    next turn that takes them gives generate's deterministic tokens with its seed."""
    target, drafts, _ = pair
    engine = specjax.Engine(target, draft=drafts["near"], slots=2, max_len=MAX_LEN, num_draft_tokens=2,
                            deterministic=True, steps_per_call=2, kv_pages=7, page_size=PAGE)
    settings = dict(temperature=0.8, top_k=20)
    with engine:
        reply = engine.submit(SHARED, max_new_tokens=12, seed=3, **settings).result(timeout=300)
        turn = SHARED + reply + [17, 4, 60]
        request = engine.submit(turn, max_new_tokens=8, seed=4, **settings)
        got = request.result(timeout=300)
    assert request.cached_tokens == 32
    out = specjax.generate(target, *specjax.pad_prompts([turn]), key=jax.random.key(4), deterministic=True,
                           draft=drafts["near"], num_draft_tokens=2, max_new_tokens=8, **settings)
    assert got == [int(t) for t in np.asarray(out.tokens[0])]


def test_prefix_caching_off_and_refused_without_pages(pair):
    """Engine(prefix_caching=False) shares nothing (every request prefilled whole); asking for
    it without pages is refused by name."""
    target = pair[0]
    engine = specjax.Engine(target, slots=2, max_len=MAX_LEN, kv_pages=7, page_size=PAGE, prefix_caching=False)
    with engine:
        got = [engine.submit(SHARED + [5, 9, 13], max_new_tokens=4) for _ in range(2)]
        outputs = [r.result(timeout=300) for r in got]
    assert outputs[0] == outputs[1] == _alone(target, SHARED + [5, 9, 13], 4, ())
    assert [r.cached_tokens for r in got] == [0, 0]
    stats = engine.stats()
    assert stats["prefix_caching"] is False and stats["prefix_cache_hits"] == 0 and stats["cached_pages"] == 0
    with pytest.raises(ValueError, match="prefix_caching shares pages of the KV cache: give kv_pages or kv_cache"):
        specjax.Engine(target, slots=2, max_len=MAX_LEN, prefix_caching=True)


def test_a_long_prompt_is_prefilled_in_chunks_while_a_row_streams(pair):
    """prefill_chunk=16: a 45-token prompt submitted while another request streams is
    prefilled 16 tokens a call (2 chunks, then admitted with its last 13): the streaming row
    gets a call between each (never paused for more than one call and one chunk), and both
    give what generate gives them alone."""
    target = pair[0]
    engine = specjax.Engine(target, slots=2, max_len=MAX_LEN, kv_pages=14, page_size=PAGE, prefill_chunk=20,
                            steps_per_call=2)
    assert engine.programs.chunk == 16 and "prefill a chunk [1, 16]" in engine.stats()["programs"]
    assert engine.programs.sizes == ((1, 16), (2, 16))  # nothing admitted past a chunk
    long_prompt = [int(t) for t in np.random.default_rng(9).integers(3, 97, 45)]
    chunks = []
    real = engine.programs.prefill_chunk
    engine.programs.prefill_chunk = lambda *a: chunks.append((a[3], engine.load()[0])) or real(*a)
    with engine:
        streaming = engine.submit([4, 5, 6], max_new_tokens=60)
        while not streaming.tokens:
            time.sleep(0.01)
        long = engine.submit(long_prompt, max_new_tokens=8)
        outputs = [streaming.result(timeout=300), long.result(timeout=300)]
    assert outputs == [_alone(target, [4, 5, 6], 60, ()), _alone(target, long_prompt, 8, ())]
    assert [start for start, _ in chunks] == [0, 16] and all(running == 2 for _, running in chunks)
    first = long.chunk_times[0][0]
    between = [t for t, _ in streaming.chunk_times if long.submitted < t < first]
    assert len(between) >= 2, (len(between), streaming.chunk_times)  # a call of its own around each chunk
    assert long.prefilled == 32 and long.cached_tokens == 0 and engine.stats()["free_pages"] == 14


def _alone_scored(target, prompt, budget):
    """`prompt` alone through greedy `generate` with logprobs: (its tokens, each one's log-probability)."""
    prompts, lengths = specjax.pad_prompts([prompt])
    out = specjax.generate(target, prompts, lengths, max_new_tokens=budget, logprobs=0)
    n = int(out.num_tokens[0])
    return [int(t) for t in np.asarray(out.tokens[0, :n])], np.asarray(out.logprobs.chosen[0, :n])


def _checked_every_turn(engine):
    """The engine's rules asserted after every turn (the scheduler's) and before every run
    call (the runner's: the device's table is the host's, a row not live is done); -> the
    errors seen on the engine's thread (an assertion there would only fail its requests)."""
    errors = []

    def check(engine):
        try:
            engine.scheduler.check()
        except AssertionError as e:
            errors.append(e)

    engine.turn_hook, engine.runner.check = check, True
    return errors


def test_chunked_prompts_beside_running_and_finishing_rows_equal_generate_alone(pair):
    """Issue 77's load: 3 slots, pages of 8, prompts over 16 tokens prefilled 16 a call;
    short requests, requests sharing a cached prefix and 60-100 token prompts arriving with
    random gaps while others run, finish and are cancelled; greedy, logprobs on. Each
    request's tokens and log-probabilities are `generate`'s on it alone (a cancelled one's,
    those it got). Before the runner sent the table before
    every run (and a done row wrote only to the null page), a slot whose request had
    finished still named its pages on the device, and its frozen row wrote into them after
    a chunk of another prompt had (19 of 22 equal at 53bdaf5)."""
    target = pair[0]
    engine = specjax.Engine(target, slots=3, max_len=128, steps_per_call=4, kv_pages=40, page_size=PAGE,
                            prefill_chunk=16, max_logprobs=0)
    errors = _checked_every_turn(engine)
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(3, 97, 40)]
    asked = []
    for _ in range(22):
        kind = rng.integers(3)
        prompt = ([int(t) for t in rng.integers(3, 97, rng.integers(2, 12))] if kind == 0 else
                  shared + [int(t) for t in rng.integers(3, 97, rng.integers(1, 8))] if kind == 1 else
                  [int(t) for t in rng.integers(3, 97, rng.integers(60, 100))])
        asked.append((prompt, int(rng.integers(4, 20)), float(rng.uniform(0, 0.05))))
    submitted = []

    def cancelled_at_its_second_chunk(i):  # (a listener: on the engine's thread)
        chunks = []

        def listener(tokens):
            if tokens:
                chunks.append(tokens)
                if len(chunks) == 2:
                    submitted[i].cancel()
        return listener

    with engine:
        for i, (prompt, budget, gap) in enumerate(asked):  # every fifth cancelled
            listener = cancelled_at_its_second_chunk(i) if i % 5 == 3 else None
            submitted.append(engine.submit(prompt, max_new_tokens=budget, logprobs=0, listener=listener))
            time.sleep(gap)
        outputs = [r.result(timeout=300) for r in submitted]
    wrong = []
    for (prompt, budget, _), request, got in zip(asked, submitted, outputs):
        tokens, chosen = _alone_scored(target, prompt, budget)
        n = len(got) if request.finish_reason == "cancelled" else len(tokens)  # a cancelled one: what it got
        scores = np.array([score for score, _ in request.scores])
        if got != tokens[:n] or len(scores) != n or not np.allclose(scores, chosen[:n], atol=1e-4):
            wrong.append(len(prompt))
    assert wrong == [] and errors == [], (wrong, errors)
    assert sum(r.finish_reason == "cancelled" for r in submitted) >= 2
    assert engine.stats()["free_pages"] == 40 and engine.pages.owners() == []
    assert engine.pages.stats()["prefix_cache_hits"] > 0  # the shared prefix was found


def test_a_64_slot_engine_s_programs_do_not_grow_with_its_groups_and_it_serves(pair):
    """An admission's program writes its n rows with one scatter an array, not n unrolled
    updates (at 53bdaf5 its size grew with n: a 64-slot engine of the tiny pair compiled in
    186 s and left 37,745 memory mappings, 105 s and 22,644 now: docs/bench/engine_slots.txt).
    A burst of 64 requests then goes in one admission and each gives what generate gives it
    alone."""
    target = pair[0]
    engine = specjax.Engine(target, slots=64, max_len=MAX_LEN, kv_pages=130, page_size=PAGE, steps_per_call=4)
    programs = engine.programs
    layout = programs.state_shapes()

    def updates(n):
        text = programs.lower_admission(layout, n, 16)[0].as_text()
        return text.count("dynamic_update_slice") + text.count("scatter")

    assert (64, 16) in programs.sizes and updates(64) == updates(8)
    dense = specjax.Engine(target, slots=64, max_len=MAX_LEN).programs  # unpaged: an insert, likewise (not a TPU's)

    def inserts(n):
        rows = jax.eval_shape(lambda: dense.prefill(*dense.dummy_prompts(n, 16)))
        text = insert_rows.lower(dense.state_shapes(), jax.ShapeDtypeStruct((n,), np.int32), rows, dense.deepest,
                                 None, mesh=None, rules=None, unrolled=dense.unrolled_inserts).as_text()
        return text.count("dynamic_update_slice") + text.count("scatter")

    assert not dense.unrolled_inserts and inserts(64) == inserts(8)
    rng = np.random.default_rng(13)
    prompts = [[int(t) for t in rng.integers(3, 97, 3 + i % 9)] for i in range(64)]
    with engine:
        with engine._lock:  # all wait together: one group
            submitted = [engine.submit(p, max_new_tokens=6) for p in prompts]
        outputs = [r.result(timeout=300) for r in submitted]
    for prompt, got in list(zip(prompts, outputs))[::9]:
        assert got == _alone(target, prompt, 6, ())
    assert engine.stats()["free_pages"] == 130


@pytest.mark.parametrize("call, nth", [("run", 2), ("admit", 2), ("prefill_chunk", 2), ("set_table", 1),
                                       ("release", 1), ("catch_up", 1), ("sync", 1)])
def test_no_request_is_lost_when_a_device_call_fails(pair, paged, monkeypatch, call, nth):
    """Each kind of device call a paged engine makes, failing once mid-load (a step, an
    admission into pages, a chunk of a long prompt, a table update, a preempted row's
    release, a finished row's draft catching up before its pages are cached, the draft's
    sync after calls at K = 0): the requests in the state then fail with the error (a
    finished row's request keeps its tokens), every other one is served as generate serves
    it alone, none is left waiting, and every page comes back (the cache forgotten: the new
    state's pages hold nothing). The nth call of its kind fails. The rules are checked
    every turn (`_checked_every_turn`)."""
    target = pair[0]
    engine = paged("draft")
    real, calls = getattr(engine.programs, call), []

    def failing(*args, **kwargs):
        calls.append(call)
        if len(calls) == nth:
            raise RuntimeError(f"injected {call} failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.programs, call, failing)
    monkeypatch.setattr(engine, "turn_hook", None)  # (the module's engine: undone after)
    monkeypatch.setattr(engine.runner, "check", False)
    errors = _checked_every_turn(engine)
    long_prompt = [int(t) for t in np.random.default_rng(11).integers(3, 97, 40)]  # 3 chunks of 16
    asked = [(REQUESTS[5][0], 44), (long_prompt, 6), (REQUESTS[2][0], 10), (REQUESTS[3][0], 9)]
    if call == "sync":  # K = 0 with one live row, 3 with more: the draft syncs as a second row joins
        monkeypatch.setattr(engine.policy, "table", (0, 3, 3))
        asked = [(REQUESTS[2][0], 12), (REQUESTS[5][0], 8), (REQUESTS[3][0], 6)]  # (they fit the pool together)
    failures = engine.failures
    outputs = []
    with engine:
        submitted = []
        if call == "sync":  # the first runs alone (K = 0); at its first tokens, on the engine's thread, the rest come
            rest = lambda tokens: tokens and len(submitted) == 1 and submitted.extend(  # noqa: E731
                engine.submit(p, max_new_tokens=b) for p, b in asked[1:])
            submitted.append(engine.submit(asked[0][0], max_new_tokens=asked[0][1], listener=rest))
            while len(submitted) < len(asked):
                time.sleep(0.01)
        for prompt, budget in asked if call != "sync" else ():  # (release: the first cancelled at its first tokens)
            cancel = (lambda tokens: tokens and submitted[0].cancel()) if call == "release" and not submitted else None
            submitted.append(engine.submit(prompt, max_new_tokens=budget, listener=cancel))
            time.sleep(0.02)
        for request in submitted:
            try:
                outputs.append(request.result(timeout=300))
            except RuntimeError as e:
                assert f"injected {call} failure" in str(e), e
                outputs.append(None)
        after = engine.submit(REQUESTS[3][0], max_new_tokens=9).result(timeout=300)  # the engine serves on
    assert len(calls) >= nth, calls  # the call failed
    assert engine.failures == failures + 1
    if call in ("run", "admit", "prefill_chunk", "set_table"):  # (a release or catch-up may find no row running)
        assert None in outputs
    for (prompt, budget), got, request in zip(asked, outputs, submitted):
        want = _alone(target, prompt, budget, ())
        assert got is None or got == (want[:len(got)] if request.finish_reason == "cancelled" else want), call
    assert after == _alone(target, REQUESTS[3][0], 9, ())
    assert engine.stats()["free_pages"] == 7 and engine.pages.owners() == [] and not engine.scheduler.chunking
    assert errors == []


def test_a_group_compiled_in_the_background_runs_without_compiling_again(pair):
    """A group's admission that `compile_group` compiled ahead of time (in the background,
    against the state's layout) is what its first admission runs: nothing is compiled then.
    Through jit's own path the first such call in a process compiled the program again
    (docs/bench/serve_first_group.txt)."""
    target, drafts, _ = pair
    # Sizes no other test uses, so that no program of theirs is in jax's caches.
    engine = specjax.Engine(target, draft=drafts["near"], slots=3, max_len=40, num_draft_tokens=2, kv_pages=9,
                            page_size=PAGE)
    programs = engine.programs
    n, b = programs.groups()[0]
    state = programs.set_table(programs.empty(), np.zeros((3, programs.table_width), np.int32))
    layout = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    programs.compile_group(n, b, layout)
    compiles = []

    def count(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    prompts = [np.arange(3, 3 + b - i, dtype=np.int32) for i in range(n)]
    table = np.arange(3 * programs.table_width, dtype=np.int32).reshape(3, -1) % 9
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        state = programs.admit(state, list(range(n)), prompts, [0] * n, [len(p) + 4 for p in prompts],
                               [Settings()] * n, np.full((n, programs.stop_width), -1, np.int32), [0] * n, table)
        assert np.asarray(state.length)[:n].tolist() == [len(p) for p in prompts]  # the rows admitted
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiles == []
