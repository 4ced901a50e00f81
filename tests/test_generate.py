"""The jitted loop: greedy exactness against autoregressive decoding and transformers,
statistics, compile-once, per-row EOS, and clear errors for bad requests."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.loop import generate_loop
from tests import tiny

MAX_NEW = 12


def _prompts(batch, seed=0):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(2, tiny.VOCAB, n)) for n in rng.randint(1, 14, batch)]


def _transformers_greedy(torch_model, prompt, eos):
    return tiny.transformers_greedy(torch_model, prompt, MAX_NEW, eos)


_rows = tiny.rows


# Batches of 3 and 4 (and 1), the shapes the other tests here use too: each shape compiles once.
# (the suite's time on 2 cores: the others with -m slow)
@pytest.mark.parametrize("K, batch", [(1, 1), (2, 3), pytest.param(4, 3, marks=pytest.mark.slow), (7, 4),
                                      pytest.param(4, 4, marks=pytest.mark.slow)])
def test_greedy_speculative_equals_autoregressive_and_transformers(pair, K, batch):
    target, drafts, torch_model = pair
    prompts = _prompts(batch, seed=K + batch)
    padded, lengths = specjax.pad_prompts(prompts, bucket=16)
    plain = specjax.generate(target, padded, lengths, max_new_tokens=MAX_NEW)
    # EOS: a token the first row emits mid-way, so at least that row stops early.
    eos = int(plain.tokens[0, 3])
    for eos_id in (None, eos):
        auto = specjax.generate(target, padded, lengths, max_new_tokens=MAX_NEW, eos_token_id=eos_id)
        expected = [_transformers_greedy(torch_model, p, eos_id) for p in prompts]
        assert _rows(auto) == expected
        for name, draft in drafts.items():
            spec = specjax.generate(target, padded, lengths, draft=draft, max_new_tokens=MAX_NEW,
                                    num_draft_tokens=K, eos_token_id=eos_id)
            assert _rows(spec) == expected, (name, eos_id)
            np.testing.assert_array_equal(spec.tokens, auto.tokens)  # padding after the end too
        if eos_id is not None:
            first = int(np.argmax(np.asarray(plain.tokens[0]) == eos))
            assert auto.num_tokens[0] == first + 1 and auto.tokens[0, first] == eos


def test_several_stop_ids_equal_transformers(pair):
    """eos_token_id=[a, b]: each row stops after the first of either, as transformers does,
    autoregressive and speculative, on a ragged batch."""
    target, drafts, torch_model = pair
    prompts = _prompts(4, seed=21)
    padded, lengths = specjax.pad_prompts(prompts, bucket=16)
    plain = specjax.generate(target, padded, lengths, max_new_tokens=MAX_NEW)
    a, b = int(plain.tokens[0, 2]), int(plain.tokens[1, 4])  # rows 0 and 1 stop on different ids
    stops = [a, b]
    expected = [tiny.transformers_greedy(torch_model, p, MAX_NEW, stops) for p in prompts]
    for row, t in zip(expected, np.asarray(plain.tokens)):  # the rule itself: first of any
        hits = [i for i, x in enumerate(t) if x in stops]
        assert len(row) == (hits[0] + 1 if hits else MAX_NEW)
    assert len(expected[0]) <= 3 and len(expected[1]) <= 5 and expected[1][-1] in stops
    assert _rows(specjax.generate(target, padded, lengths, max_new_tokens=MAX_NEW,
                                  eos_token_id=stops)) == expected
    for name, draft in drafts.items():
        spec = specjax.generate(target, padded, lengths, draft=draft, max_new_tokens=MAX_NEW,
                                num_draft_tokens=4, eos_token_id=stops)  # shapes of [4-4] above
        assert _rows(spec) == expected, name


def test_stream_receives_exactly_the_output(pair):
    """The callback sees each row's tokens in order, once, and they concatenate to the
    output; streaming compiles once whatever the function, and changes no result."""
    target, drafts, _ = pair
    padded, lengths = specjax.pad_prompts(_prompts(3, seed=13), bucket=16)
    kwargs = dict(draft=drafts["far"], max_new_tokens=MAX_NEW, num_draft_tokens=4)
    plain = specjax.generate(target, padded, lengths, **kwargs)
    stops = [int(plain.tokens[1, 6])]

    def collect(**kw):
        got, calls = [[] for _ in range(3)], []

        def stream(tokens, counts):
            calls.append(counts.copy())
            for b in range(3):
                got[b] += tokens[b, : counts[b]].tolist()

        out = specjax.generate(target, padded, lengths, **kwargs, **kw, stream=stream)
        return out, got, calls

    out, got, calls = collect(eos_token_id=stops)
    assert got == _rows(out)
    np.testing.assert_array_equal(out.tokens, specjax.generate(target, padded, lengths, **kwargs,
                                                               eos_token_id=stops).tokens)
    assert len(calls) == int(out.stats.steps.max())  # one call per step of the loop
    assert out.num_tokens[1] < MAX_NEW  # a row stopped early: counts 0 after it is done
    assert calls[-1][1] == 0 or out.stats.steps[1] == len(calls)
    before = generate_loop._cache_size()
    out2, got2, _ = collect(eos_token_id=[5, 6, 7], key=jax.random.key(3))
    assert got2 == _rows(out2)
    assert generate_loop._cache_size() == before, "another stream function or stop list recompiled"


def test_compile_generate_runs_what_generate_runs(pair):
    target, drafts, _ = pair
    padded, lengths = specjax.pad_prompts(_prompts(3, seed=14), bucket=16)
    kwargs = dict(draft=drafts["near"], max_new_tokens=MAX_NEW, num_draft_tokens=2, eos_token_id=[4, 9])
    run = specjax.compile_generate(target, padded, lengths, **kwargs)
    np.testing.assert_array_equal(run().tokens, specjax.generate(target, padded, lengths, **kwargs).tokens)


def test_both_paths_run(pair):
    """The near draft is mostly accepted, the far one mostly rejected: both paths are tested."""
    target, drafts, _ = pair
    padded, lengths = specjax.pad_prompts(_prompts(4, seed=11), bucket=16)
    rates = {}
    for name, draft in drafts.items():
        s = specjax.generate(target, padded, lengths, draft=draft, max_new_tokens=MAX_NEW,
                             num_draft_tokens=4).stats
        rates[name] = s.accepted.sum() / s.drafted.sum()
    assert rates["near"] > 0.6 and rates["far"] < 0.3, rates
    assert rates["far"] > 0, "the far draft should still be accepted sometimes"


def test_gpt2_speculative_greedy(hf_folder):
    folder, torch_model = hf_folder("gpt2")
    target = specjax.load_model(folder)
    prompts = _prompts(3, seed=5)
    padded, lengths = specjax.pad_prompts(prompts, bucket=16)
    out = specjax.generate(target, padded, lengths, draft=tiny.noisy(target, 0.05, 3),
                           max_new_tokens=MAX_NEW, num_draft_tokens=3)
    assert _rows(out) == [_transformers_greedy(torch_model, p, None) for p in prompts]


@pytest.mark.parametrize("arch", tiny.NEW_FAMILIES + ["gpt_oss"])
def test_new_families_speculative_greedy_equals_transformers(arch, hf_folder):
    """Gemma 2/3, Qwen3, Phi-3, gpt-oss with a noisy copy as draft, decoding past their
    sliding windows (4 to 6): prompts of up to 11 tokens and 12 new ones."""
    folder, torch_model = hf_folder(arch)
    target = specjax.load_model(folder)
    rng = np.random.RandomState(8)
    prompts = [list(rng.randint(2, tiny.VOCAB, n)) for n in (11, 4, 8)]
    padded, lengths = specjax.pad_prompts(prompts, bucket=16)
    out = specjax.generate(target, padded, lengths, draft=tiny.noisy(target, 0.015, 1),
                           max_new_tokens=MAX_NEW, num_draft_tokens=3)
    assert _rows(out) == [_transformers_greedy(torch_model, p, None) for p in prompts]
    assert 0 < out.stats.accepted.sum() < out.stats.drafted.sum()  # both paths ran


def test_draft_equal_to_target_accepts_everything(pair):
    target, _, _ = pair
    padded, lengths = specjax.pad_prompts(_prompts(3, seed=7), bucket=16)
    K, N = 3, 14  # 14 = 3 full steps of K+1 = 4 tokens, then a step cut to 2 tokens
    out = specjax.generate(target, padded, lengths, draft=target, max_new_tokens=N, num_draft_tokens=K)
    np.testing.assert_array_equal(out.num_tokens, N)
    np.testing.assert_array_equal(out.stats.steps, 4)
    np.testing.assert_array_equal(out.stats.drafted, 4 * K)
    np.testing.assert_array_equal(out.stats.accepted, 3 * K + 2)  # the cut step emits d_1, d_2
    # K + 1 tokens per target pass: each uncut step adds the target's own token to K drafts.
    np.testing.assert_array_equal(N - out.stats.accepted, 3)


def test_draft_equal_to_target_with_eos_cut(pair):
    target, _, _ = pair
    padded, lengths = specjax.pad_prompts(_prompts(3, seed=8), bucket=16)
    plain = specjax.generate(target, padded, lengths, max_new_tokens=MAX_NEW)
    eos = int(plain.tokens[0, 5])
    first = int(np.argmax(plain.tokens[0] == eos))
    out = specjax.generate(target, padded, lengths, draft=target, max_new_tokens=MAX_NEW,
                           num_draft_tokens=4, eos_token_id=eos)
    assert out.num_tokens[0] == first + 1
    steps = first // 5 + 1  # K + 1 = 5 tokens per step until the step that emits EOS
    last = first + 1 - 5 * (steps - 1)  # tokens of that step, EOS included
    assert out.stats.steps[0] == steps
    assert out.stats.accepted[0] == 4 * (steps - 1) + min(last, 4)


def test_compiles_once_per_sampling_kind(pair):
    """Other prompts of the bucket, other keys, temperatures, top-k/p and EOS: one program per
    sampling kind (greedy, sampled, filtered: each holds only what its rows need), and no
    recompile within a kind."""
    target, drafts, _ = pair

    def run(seed, **kw):  # max_new_tokens no other test of this module uses: these shapes compile here
        padded, lengths = specjax.pad_prompts(_prompts(3, seed=seed), bucket=16)
        specjax.generate(target, padded, lengths, draft=drafts["near"], key=jax.random.key(seed),
                         max_new_tokens=MAX_NEW + 1, num_draft_tokens=4, **kw)

    run(0)
    first = generate_loop._cache_size()
    run(1, temperature=0.8)
    run(2, temperature=1.3, top_k=5)
    before = generate_loop._cache_size()
    assert before - first == 2, "one program each for the sampled and the filtered kind"
    run(3, temperature=0.5, top_p=0.9, eos_token_id=3)
    run(4, eos_token_id=[3, 5, 7])  # up to 4 stop ids share one shape
    run(5)
    run(6, temperature=0.3)
    assert generate_loop._cache_size() == before, "a call of the same shapes and kind recompiled generate"


def test_vocabulary_padding_is_accepted(pair):
    """A draft whose embedding table is padded by a few rows still yields the target's output."""
    target, drafts, _ = pair
    d = drafts["near"]
    params = dict(d.params)
    params["embedding"] = jnp.pad(d.params["embedding"], ((0, 3), (0, 0)))
    params["lm_head"] = jnp.pad(d.params["lm_head"], ((0, 0), (0, 3)), constant_values=5.0)
    padded_draft = specjax.Model(_with_vocab(d.config, tiny.VOCAB + 3), params)
    padded, lengths = specjax.pad_prompts(_prompts(3, seed=9), bucket=16)
    a = specjax.generate(target, padded, lengths, max_new_tokens=MAX_NEW)
    b = specjax.generate(target, padded, lengths, draft=padded_draft, max_new_tokens=MAX_NEW)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert b.stats.accepted.sum() > 0


def _with_vocab(config, vocab):
    import dataclasses

    return dataclasses.replace(config, vocab_size=vocab)


# ---- bad requests ----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_draft_tokens=0), "num_draft_tokens must be an int >= 1"),
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    (dict(max_new_tokens=200), "exceeds the llama model's max_position_embeddings"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must lie in \(0, 1\]"),
    (dict(top_k=-1), r"top_k must be an int in \[0, 2\*\*31\)"),
    (dict(top_k=2**63), "top_k must be an int in"),
    (dict(eos_token_id=tiny.VOCAB), "eos_token_id"),
    (dict(eos_token_id=[3, tiny.VOCAB]), f"eos_token_id {tiny.VOCAB} is outside"),
    (dict(eos_token_id=[[3]]), "eos_token_id must be None, an int or a list of ints"),
])
def test_bad_requests(pair, kwargs, message):
    target, drafts, _ = pair
    padded, lengths = specjax.pad_prompts([[3, 4, 5]], bucket=16)
    with pytest.raises(ValueError, match=message):
        specjax.generate(target, padded, lengths, draft=drafts["near"], **kwargs)


def test_num_draft_tokens_without_a_draft_is_refused(pair):
    """A K with nothing to draft it is refused (as the Engine refuses it), not ignored; None
    and 0 mean plain decoding, as before."""
    target, _, _ = pair
    padded, lengths = specjax.pad_prompts([[3, 4, 5]], bucket=16)
    with pytest.raises(ValueError, match="^num_draft_tokens=3 needs a draft$"):
        specjax.generate(target, padded, lengths, num_draft_tokens=3)
    plain = [specjax.generate(target, padded, lengths, max_new_tokens=4, num_draft_tokens=K).tokens for K in (None, 0)]
    np.testing.assert_array_equal(*plain)


def test_a_draft_that_is_no_drafter_is_named(pair):
    target, drafts, _ = pair
    padded, lengths = specjax.pad_prompts([[3, 4, 5]], bucket=16)
    with pytest.raises(TypeError, match=r"a drafter \(a specjax.drafters.Drafter\), got dict"):
        specjax.generate(target, padded, lengths, draft={"model": drafts["near"]})


def test_bad_prompts(pair):
    target, _, _ = pair
    with pytest.raises(ValueError, match="is empty"):
        specjax.pad_prompts([[1, 2], []])
    with pytest.raises(ValueError, match="lengths"):
        specjax.generate(target, np.ones((2, 4), np.int32), np.array([3]))
    with pytest.raises(ValueError, match="is empty"):
        specjax.generate(target, np.ones((2, 4), np.int32), np.array([3, 0]))
    with pytest.raises(ValueError, match="lengths go up to 5"):
        specjax.generate(target, np.ones((1, 4), np.int32), np.array([5]))
    with pytest.raises(ValueError, match="token ids"):
        specjax.generate(target, np.full((1, 4), tiny.VOCAB), np.array([4]))
    # Values past int32 are checked as given, not after a cast that would wrap them.
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 97\)"):
        specjax.generate(target, np.full((1, 4), 2**32 + 5, np.int64), np.array([4]))
    with pytest.raises(ValueError, match="lengths go up to 4294967300"):
        specjax.generate(target, np.ones((1, 4), np.int64), np.array([2**32 + 4], np.int64))
    with pytest.raises(ValueError, match="token ids"):
        specjax.forward(target, np.full((1, 4), 2**32 + 5, np.int64))


def test_absurd_shapes_are_refused_before_anything_is_traced(pair, monkeypatch):
    """Shapes past what the model can verify or the memory can hold: a clear refusal before
    the loop is traced (tracing would build tables of N^2 entries; XLA would try to allocate
    hundreds of GiB)."""
    import importlib

    from specjax.memory import InsufficientMemoryError

    loop_module = importlib.import_module("specjax.loop")

    target, drafts, _ = pair
    padded, lengths = specjax.pad_prompts([[3, 4, 5]], bucket=16)
    monkeypatch.setattr(loop_module, "generate_loop", None)  # tracing it would fail with a TypeError
    with pytest.raises(ValueError, match="num_draft_tokens=100000: a step would verify more tokens than the "
                                         "target's max_position_embeddings"):
        specjax.generate(target, padded, lengths, draft=drafts["near"], num_draft_tokens=100_000)
    for tree in (specjax.Tree(depth=100_000, top_k=2, nodes=100_000), specjax.Tree.chain(200)):
        with pytest.raises(ValueError, match=f"a step would verify {tree.nodes + 1} tokens"):
            specjax.generate(target, padded, lengths, draft=specjax.DraftModel(drafts["near"], tree))
    # 4M rows fit the position limit, but their caches alone are hundreds of GiB
    many = np.ones((2**22, 4), np.int32)
    with pytest.raises(InsufficientMemoryError, match=r"needs at least \d+\.\d GiB \(weights .* caches"):
        specjax.generate(target, many, np.full(2**22, 4, np.int32), draft=drafts["near"])
    monkeypatch.undo()
    # a rank past the vocabulary is named (at trace time), not left to XLA's top_k
    with pytest.raises(ValueError, match=f"ranks 0..200\\), but the vocabulary has {tiny.VOCAB} tokens"):
        specjax.generate(target, padded, lengths, max_new_tokens=4,
                         draft=specjax.DraftModel(drafts["near"], specjax.Tree.from_paths([[0], [200]])))


def test_the_shape_bound_is_a_lower_bound_of_xlas_accounting(pair):
    from specjax import budget

    target, drafts, _ = pair
    tree = specjax.Tree(depth=3, top_k=2, nodes=6)
    draft = specjax.DraftModel(drafts["near"], tree)
    c = target.config
    for temperature in (0.0, 1.0):
        bound = budget.shape_bound(target, draft, 2, 16, 32, sampled=temperature > 0)
        estimate = specjax.estimate_memory(target, draft, batch=2, prompt_len=16, max_new_tokens=32,
                                           temperature=temperature)
        assert sum(bound.values()) <= estimate.total, temperature
        assert bound["logits"] == 2 * 7 * c.vocab_size * 4 and bound["caches"] <= estimate.caches
    assert bound["distributions"] == 2 * 7 * c.vocab_size * 4  # p at 7 tokens (top-k siblings: q is one-hot)
    chain = budget.shape_bound(target, specjax.DraftModel(drafts["near"]).resolve(4), 2, 16, 32, sampled=True)
    assert chain["distributions"] == 2 * (5 + 4) * c.vocab_size * 4  # and q at the 4 sampled drafts
    bf16 = budget.shape_bound(target.replace(params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), target.params)),
                              None, 2, 16, 32)
    assert bf16["logits"] == 2 * c.vocab_size * 4  # float32 logits whatever the weights' dtype


def test_nothing_is_read_back_from_the_device_before_the_loop(pair, monkeypatch):
    """With host prompts, generate checks them in numpy and never waits on the device before
    the loop runs (reading a device array's value is a sync); with device prompts, it reads
    them once, together. Counted where every read of a jax.Array's value goes."""
    from jax._src import array as jax_array

    target, drafts, _ = pair
    padded, lengths = specjax.pad_prompts(_prompts(3, seed=14), bucket=16)
    kwargs = dict(draft=drafts["near"], max_new_tokens=MAX_NEW, num_draft_tokens=2, eos_token_id=[4, 9])
    expected = specjax.generate(target, padded, lengths, **kwargs)
    reads, value = [], jax_array.ArrayImpl._value
    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(lambda a: reads.append(a.shape) or value.fget(a)))
    out = specjax.generate(target, padded, lengths, **kwargs)
    assert reads == []
    specjax.generate(target, jnp.asarray(padded), jnp.asarray(lengths), **kwargs)
    assert sorted(reads) == sorted([padded.shape, lengths.shape])
    monkeypatch.undo()
    np.testing.assert_array_equal(out.tokens, expected.tokens)


def test_vocabulary_mismatch_is_refused(pair, hf_folder):
    target, _, _ = pair
    other = specjax.load_model(hf_folder("gpt2")[0])
    big = specjax.Model(_with_vocab(other.config, 5000), other.params)
    padded, lengths = specjax.pad_prompts([[3, 4, 5]], bucket=16)
    with pytest.raises(ValueError, match="differ by more than padding"):
        specjax.generate(target, padded, lengths, draft=big)


def test_trace_records_tokens_per_step(pair):
    target, drafts, _ = pair
    padded, lengths = specjax.pad_prompts(_prompts(3, seed=12), bucket=16)
    out = specjax.generate(target, padded, lengths, draft=drafts["near"], max_new_tokens=MAX_NEW,
                           num_draft_tokens=4, return_trace=True)
    trace = np.asarray(out.trace)
    np.testing.assert_array_equal(trace.sum(axis=1), out.num_tokens)
    np.testing.assert_array_equal((trace > 0).sum(axis=1), out.stats.steps)
    assert trace.max() <= 5
    assert specjax.generate(target, padded, lengths, max_new_tokens=MAX_NEW).trace is None


@pytest.mark.parametrize("tree", [False, pytest.param(True, marks=pytest.mark.slow)])  # (the tree with -m slow)
def test_programs_traced_for_a_tpu_or_a_gpu_give_the_same_tokens(pair, tree):
    """The loop as a TPU program holds it (each row's cache entries written as one
    consecutive slice, not a point scatter; the 4-D qkv matmul) and as a GPU program (the 4-D
    qkv matmul, attention's fixed-length loop),
    run here on the CPU: the same tokens as the CPU's program, for a chain (and, -m slow, a
    tree). And the two writes agree."""
    from specjax import cache
    from specjax.backend import Backend
    from specjax.generate import _prepared

    target, drafts, _ = pair
    padded, lengths = specjax.pad_prompts(_prompts(3, seed=21), bucket=16)
    draft = specjax.DraftModel(drafts["near"], specjax.Tree(3, 2, 6)) if tree else drafts["near"]
    args, static, _ = _prepared(target, padded, lengths, dict(draft=draft, key=jax.random.key(0), max_new_tokens=MAX_NEW))
    cpu = generate_loop(*args, **dict(static, backend=Backend("cpu")))
    for platform in ("tpu", "gpu"):
        other = generate_loop(*args, **dict(static, backend=Backend(platform)))
        np.testing.assert_array_equal(other.tokens, cpu.tokens, err_msg=platform)
        np.testing.assert_array_equal(other.stats.accepted, cpu.stats.accepted, err_msg=platform)
    rng = np.random.default_rng(0)
    buffer, new = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((3, 2, 20, 4), (3, 5, 2, 4)))
    slots = jnp.asarray([0, 7, 15])[:, None] + jnp.arange(5)[None]
    np.testing.assert_array_equal(cache.write(buffer, new, slots, consecutive=True), cache.write(buffer, new, slots))
