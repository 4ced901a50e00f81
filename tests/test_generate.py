"""The jitted loop: greedy exactness against autoregressive decoding and transformers,
statistics, compile-once, per-row EOS, and clear errors for bad requests."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.generate import _generate
from tests import tiny

MAX_NEW = 12


def _prompts(batch, seed=0):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(2, tiny.VOCAB, n)) for n in rng.randint(1, 14, batch)]


def _transformers_greedy(torch_model, prompt, eos):
    return tiny.transformers_greedy(torch_model, prompt, MAX_NEW, eos)


_rows = tiny.rows


@pytest.mark.parametrize("K, batch", [(1, 1), (2, 2), (4, 3), (7, 5), (4, 4)])
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


def test_both_paths_run(pair):
    """The near draft is mostly accepted, the far one mostly rejected: both paths are tested."""
    target, drafts, _ = pair
    padded, lengths = specjax.pad_prompts(_prompts(5, seed=11), bucket=16)
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


@pytest.mark.parametrize("arch", tiny.NEW_FAMILIES)
def test_new_families_speculative_greedy_equals_transformers(arch, hf_folder):
    """Gemma 2/3, Qwen3, Phi-3 with a noisy copy as draft, decoding past their sliding
    windows (4 to 6): prompts of up to 11 tokens and 12 new ones."""
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
    padded, lengths = specjax.pad_prompts(_prompts(2, seed=8), bucket=16)
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


def test_compiles_once(pair):
    """Other prompts of the bucket, other keys, temperatures, top-k/p and EOS: no recompile."""
    target, drafts, _ = pair
    calls = 0

    def run(seed, **kw):
        nonlocal calls
        padded, lengths = specjax.pad_prompts(_prompts(3, seed=seed), bucket=16)
        specjax.generate(target, padded, lengths, draft=drafts["near"], key=jax.random.key(seed),
                         max_new_tokens=MAX_NEW, num_draft_tokens=4, **kw)
        calls += 1

    run(0)
    before = _generate._cache_size()
    run(1, temperature=0.8)
    run(2, temperature=1.3, top_k=5)
    run(3, temperature=0.5, top_p=0.9, eos_token_id=3)
    run(4)
    assert _generate._cache_size() == before, "a call of the same shapes recompiled generate"


def test_vocabulary_padding_is_accepted(pair):
    """A draft whose embedding table is padded by a few rows still yields the target's output."""
    target, drafts, _ = pair
    d = drafts["near"]
    params = dict(d.params)
    params["embedding"] = jnp.pad(d.params["embedding"], ((0, 3), (0, 0)))
    params["lm_head"] = jnp.pad(d.params["lm_head"], ((0, 0), (0, 3)), constant_values=5.0)
    padded_draft = specjax.Model(_with_vocab(d.config, tiny.VOCAB + 3), params)
    padded, lengths = specjax.pad_prompts(_prompts(2, seed=9), bucket=16)
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
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must lie in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(eos_token_id=tiny.VOCAB), "eos_token_id"),
])
def test_bad_requests(pair, kwargs, message):
    target, drafts, _ = pair
    padded, lengths = specjax.pad_prompts([[3, 4, 5]], bucket=16)
    with pytest.raises(ValueError, match=message):
        specjax.generate(target, padded, lengths, draft=drafts["near"], **kwargs)


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
