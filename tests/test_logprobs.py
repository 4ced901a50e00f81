"""generate's logprobs: each new token's log-probability and top alternatives come from the
verification pass at the position that scored it, so they equal what a plain pass over
the whole output gives there, for every drafter, greedy or sampled ("raw": within 1e-4 in
float32; bit for bit against plain decoding in deterministic mode), and "processed" gives
the distribution the token was sampled from."""

import jax
import numpy as np
import pytest

import specjax
from specjax.sampling import Sampling, warp
from tests.test_sampling import PROMPT, _tiny

MAX_NEW = 12
DRAFTERS = {
    "plain": lambda d: None,
    "chain": lambda d: specjax.DraftModel(d),
    "tree": lambda d: specjax.DraftModel(d, specjax.Tree(depth=3, top_k=2, nodes=6)),
    "prompt_lookup": lambda d: specjax.PromptLookup(2, 1),
}


@pytest.fixture(scope="module")
def tiny_pair():
    target = _tiny(0, 0.6)
    return target, _tiny(1, 0.15, base=target)


def _prompts():
    return [PROMPT * 2, PROMPT[::-1] + [7, 7], [3]]


def _reference(target, prompt, tokens):
    """log_softmax of a plain pass over prompt + tokens at the positions that scored tokens."""
    seq = np.array([list(prompt) + list(tokens)], np.int32)
    logits = np.asarray(specjax.forward(target, seq))[0, len(prompt) - 1: len(prompt) - 1 + len(tokens)]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1)), logits


def _check_against_plain_passes(target, prompts, out, top):
    for row, prompt in enumerate(prompts):
        n = int(out.num_tokens[row])
        tokens = np.asarray(out.tokens[row, :n])
        want, _ = _reference(target, prompt, tokens)
        lp = out.logprobs
        np.testing.assert_allclose(np.asarray(lp.chosen[row, :n]), want[np.arange(n), tokens], atol=1e-4)
        top_ids = np.asarray(lp.top_ids[row, :n])
        np.testing.assert_allclose(np.asarray(lp.top[row, :n]), np.take_along_axis(want, top_ids, 1), atol=1e-4)
        np.testing.assert_array_equal(np.sort(want, 1)[:, ::-1][:, :top] - np.asarray(lp.top[row, :n]) < 1e-4, True)
        assert (np.asarray(lp.chosen[row, n:]) == 0).all()


@pytest.mark.parametrize("drafter", [d if d in ("plain", "tree") else pytest.param(d, marks=pytest.mark.slow)
                                     for d in DRAFTERS])  # (the chain and prompt lookup with -m slow)
def test_greedy_and_sampled_logprobs_are_a_plain_pass_s(tiny_pair, drafter):
    """Greedy rows beside sampled ones (two calls): every emitted token's logprob and top-3
    are the plain pass's at its position, whatever the drafter accepted."""
    target, draft = tiny_pair
    prompts = _prompts()
    padded, lengths = specjax.pad_prompts(prompts)
    for temperature in (0.0, 1.0):
        out = specjax.generate(target, padded, lengths, draft=DRAFTERS[drafter](draft), key=jax.random.key(1),
                               max_new_tokens=MAX_NEW, temperature=temperature, logprobs=3)
        assert out.logprobs.top_ids.shape == (3, MAX_NEW, 3)
        _check_against_plain_passes(target, prompts, out, 3)
    assert specjax.generate(target, padded, lengths, max_new_tokens=2).logprobs is None


def test_deterministic_logprobs_equal_plain_decoding_s_bit_for_bit(tiny_pair):
    target, draft = tiny_pair
    padded, lengths = specjax.pad_prompts(_prompts())
    run = lambda d: specjax.generate(target, padded, lengths, draft=d, max_new_tokens=MAX_NEW, logprobs=2,  # noqa: E731
                                     deterministic=True)
    plain, spec = run(None), run(specjax.DraftModel(draft, specjax.Tree(depth=3, top_k=2, nodes=6)))
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    for a, b in zip(jax.tree.leaves(spec.logprobs), jax.tree.leaves(plain.logprobs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert spec.stats.accepted.sum() > 0


def test_processed_logprobs_are_the_sampled_distribution_s(tiny_pair):
    """"processed": the log of what the token was drawn from (bias, temperature, top-k):
    finite for every emitted token, -inf for what the filter removed."""
    target, draft = tiny_pair
    prompts = _prompts()
    padded, lengths = specjax.pad_prompts(prompts)
    settings = dict(temperature=0.7, top_k=3, logit_bias={2: 1.0})
    out = specjax.generate(target, padded, lengths, draft=draft, num_draft_tokens=3, key=jax.random.key(2),
                           max_new_tokens=MAX_NEW, logprobs=5, logprobs_mode="processed", **settings)
    sampling = Sampling.make(0.7, 3, 1.0, logit_bias={2: 1.0})
    for row, prompt in enumerate(prompts):
        n = int(out.num_tokens[row])
        tokens = np.asarray(out.tokens[row, :n])
        _, logits = _reference(target, prompt, tokens)
        with np.errstate(divide="ignore"):  # log(0) = -inf for what top-k removed
            want = np.log(np.asarray(warp(logits, sampling)))
        chosen = np.asarray(out.logprobs.chosen[row, :n])
        assert np.isfinite(chosen).all()
        np.testing.assert_allclose(chosen, want[np.arange(n), tokens], atol=1e-4)
        top = np.asarray(out.logprobs.top[row, :n])
        assert np.isfinite(top[:, :3]).all() and np.isneginf(top[:, 3:]).all()  # top-3 kept, the rest removed


@pytest.mark.parametrize("kwargs, message", [
    (dict(logprobs=21), r"logprobs must be None or an int in \[0, 20\]"),
    (dict(logprobs=-1), r"logprobs must be None or an int in \[0, 20\]"),
    (dict(logprobs=True), r"logprobs must be None or an int in \[0, 20\]"),
    (dict(logprobs=2, logprobs_mode="logits"), "logprobs_mode must be one of"),
])
def test_bad_logprobs_are_refused_by_name(tiny_pair, kwargs, message):
    padded, lengths = specjax.pad_prompts(_prompts())
    with pytest.raises(ValueError, match=message):
        specjax.generate(tiny_pair[0], padded, lengths, max_new_tokens=2, **kwargs)


def test_the_engine_scores_the_tokens_of_the_rows_that_ask(tiny_pair):
    """Rows that ask for logprobs (greedy and sampled) share calls with rows that do not:
    theirs equal a plain pass's at each position; the others' calls are the engine's usual."""
    target, draft = tiny_pair
    engine = specjax.Engine(target, draft=draft, slots=4, max_len=32, num_draft_tokens=2, steps_per_call=2,
                            max_logprobs=3)
    prompts = _prompts()
    with engine:
        asked = [engine.submit(p, max_new_tokens=MAX_NEW, temperature=t, seed=i, logprobs=2)
                 for i, (p, t) in enumerate(zip(prompts, (0.0, 1.0, 0.7)))]
        others = [engine.submit(p, max_new_tokens=MAX_NEW) for p in prompts]
        for prompt, request in zip(prompts, asked):
            tokens = request.result(timeout=300)
            want, _ = _reference(target, prompt, tokens)
            assert len(request.scores) == len(tokens)
            for j, (chosen, top) in enumerate(request.scores):
                assert abs(chosen - want[j, tokens[j]]) < 1e-4
                assert [i for i, _ in top] == list(np.argsort(-want[j], kind="stable")[:2])
                np.testing.assert_allclose([lp for _, lp in top], np.sort(want[j])[::-1][:2], atol=1e-4)
        assert all(r.result() and r.scores == [] for r in others)
        with pytest.raises(ValueError, match=r"logprobs must be None or an int in \[0, 3\]"):
            engine.submit(prompts[0], max_new_tokens=2, logprobs=4)
    assert any("with top-3 raw logprobs" in p for p in engine.stats()["programs"])
    plain = specjax.Engine(target, slots=2, max_len=32)
    with plain, pytest.raises(ValueError, match="this engine scores no tokens: Engine.max_logprobs"):
        plain.submit(prompts[0], max_new_tokens=2, logprobs=0)


@pytest.mark.parametrize("drafter", ["plain", "eagle3"])
def test_prompt_logprobs_are_a_plain_pass_s(tiny_pair, drafter):
    """generate(prompt_logprobs=n): each prompt token's log-probability given the tokens
    before it, and the top n there, from the prefill's own pass (a drafter reading the
    target's layers included): a plain pass's; 0 at position 0 and past a row's length."""
    target, _ = tiny_pair
    draft = None if drafter == "plain" else specjax.Eagle3.init(target, jax.random.key(0))
    prompts = _prompts()
    padded, lengths = specjax.pad_prompts(prompts)
    out = specjax.generate(target, padded, lengths, draft=draft, max_new_tokens=2, prompt_logprobs=3)
    scored = out.prompt_logprobs
    assert scored.chosen.shape == padded.shape and scored.top.shape == padded.shape + (3,)
    for row, prompt in enumerate(prompts):
        want = np.asarray(jax.nn.log_softmax(specjax.forward(target, np.array([prompt], np.int32))[0], axis=-1))
        n = len(prompt)
        chosen = np.asarray(scored.chosen[row])
        np.testing.assert_allclose(chosen[1:n], want[np.arange(n - 1), prompt[1:]], atol=1e-4)
        assert chosen[0] == 0 and (chosen[n:] == 0).all()
        top_ids = np.asarray(scored.top_ids[row, 1:n])
        np.testing.assert_allclose(np.asarray(scored.top[row, 1:n]), np.take_along_axis(want[:n - 1], top_ids, 1),
                                   atol=1e-4)
        assert (np.sort(want[:n - 1], 1)[:, ::-1][:, :3] - np.asarray(scored.top[row, 1:n]) < 1e-4).all()


def test_prompt_logprobs_of_a_chunked_prefill_equal_one_pass_s(tiny_pair):
    """models.prefill in chunks (a prompt longer than its chunk) scores every position as
    one pass does."""
    from specjax.cache import KVCache
    from specjax.models import prefill

    target, _ = tiny_pair
    tokens = np.array([PROMPT * 3], np.int32)
    cache = KVCache.init(target.config, 1, 32, target.dtype)
    run = jax.jit(lambda c, chunk: prefill(target, tokens, c, return_hidden=False, chunk=chunk, score=2),
                  static_argnums=1)  # (not op by op: seconds)
    _, _, whole = run(cache, None)
    _, _, chunked = run(cache, 4)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
