"""min_p and logit_bias: warped as transformers warps (the bias added to the raw logits
first), exact under speculation (chi-square against the enumerated joint, for a chain, a
sampled tree and a reduced draft vocabulary, through generate; the engine's in
test_engine.py), greedy
output equal to plain decoding with the same bias for every drafter, and bad values
refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.sampling import Sampling, check_logit_bias, warp
from tests.test_sampling import PROMPT, ROWS, V, _chi_square_p, _exact_joint, _tiny, _transformers_probs

BIAS = {2: 1.5, 4: -100.0, 6: -2.0}  # token 4 all but banned, 2 favoured


@pytest.fixture(scope="module")
def tiny_pair():
    target = _tiny(0, 0.6)
    return target, _tiny(1, 0.15, base=target)


def test_min_p_and_logit_bias_match_transformers_per_row():
    """Rows of one batch each with their own settings (some off, a greedy one biased) warp
    as transformers' processors do; a program built for rows without them (greedy or
    sampled) carries the arrays and leaves them out."""
    rng = np.random.RandomState(5)
    logits = (rng.randn(6, 300) * 2).astype(np.float32)
    rows = [  # (temperature, top_k, top_p, min_p, bias)
        (1.0, 0, 1.0, 0.1, None), (0.7, 20, 1.0, 0.05, {3: 2.0, 7: -100.0}), (1.3, 0, 0.9, 0.2, None),
        (1.0, 0, 1.0, 0.0, {int(logits[3].argmin()): 100.0}), (0.0, 0, 1.0, 0.0, {int(logits[4].argmin()): 100.0}),
        (1.0, 0, 1.0, 1.0, None)]
    t, k, p, m, b = zip(*rows)
    sampling = Sampling.make(np.array(t), np.array(k), np.array(p), len(rows), min_p=np.array(m),
                             logit_bias=[x or {} for x in b])
    assert sampling.kind == "filtered" and sampling.bias_ids.shape == (6, 8)
    ours = np.asarray(jax.jit(warp)(jnp.asarray(logits), sampling))
    for row, (t, k, p, m, b) in enumerate(rows):
        if t == 0:  # greedy: the argmax of the biased logits
            np.testing.assert_array_equal(ours[row], np.eye(300)[int(logits[row].argmin())])
            continue
        np.testing.assert_allclose(ours[row], _transformers_probs(logits[row], t, k, p, m, b), atol=1e-6,
                                   err_msg=str(rows[row]))
    assert (ours[5] > 0).sum() == 1  # min_p = 1 keeps the top token alone
    assert Sampling.make(0.0, min_p=0.5).kind == "greedy"  # min_p keeps the argmax: nothing to filter
    assert Sampling.make(1.0, min_p=0.5).kind == "filtered"
    assert Sampling.make(0.0, logit_bias={1: 1.0}).kind == "filtered"


def test_a_reduced_vocabulary_moves_each_bias_to_its_index():
    sampling = Sampling.make(1.0, logit_bias={0: 1.0, 3: 2.0, 5: -1.0, 9: 4.0})
    over = sampling.over(jnp.array([0, 2, 5, 9], jnp.int32))
    np.testing.assert_array_equal(np.asarray(over.bias_ids)[:4], [0, -1, 2, 3])


def _joint(tokens):
    return np.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V).reshape(V, V)


def _check(observed, expected):
    assert observed[expected == 0].sum() == 0
    assert _chi_square_p(observed, expected) > 1e-3


DRAFTERS = {
    "chain": lambda d: specjax.DraftModel(d),
    "sampled_tree": lambda d: specjax.DraftModel(d, specjax.Tree.from_paths([(0,), (1,), (0, 0), (1, 0)], "sampled")),
    "reduced_vocab_chain": lambda d: specjax.DraftModel(d, specjax.Tree.chain(2, "sampled")).with_vocab(
        [0, 2, 3, 4, 6]),
}
SETTINGS = {
    "min_p": dict(temperature=1.2, min_p=0.15),
    "logit_bias": dict(temperature=0.9, bias=BIAS),
    "both_and_top_p": dict(temperature=1.0, top_p=0.9, min_p=0.1, bias={1: 1.0, 5: -3.0}),
}


@pytest.mark.parametrize("drafter, setting", [  # (the suite's time on 2 cores: three with -m slow)
    pytest.param("chain", "min_p", marks=pytest.mark.slow), pytest.param("chain", "logit_bias", marks=pytest.mark.slow),
    ("sampled_tree", "both_and_top_p"), pytest.param("reduced_vocab_chain", "logit_bias", marks=pytest.mark.slow)])
def test_speculation_is_exact_under_min_p_and_logit_bias(tiny_pair, drafter, setting):
    target, draft = tiny_pair
    settings = dict(SETTINGS[setting])
    temperature, bias = settings.pop("temperature"), settings.pop("bias", None)
    prompts = np.tile(np.array(PROMPT, np.int32), (ROWS, 1))
    out = specjax.generate(target, prompts, np.full(ROWS, len(PROMPT), np.int32), draft=DRAFTERS[drafter](draft),
                           key=jax.random.key(3), max_new_tokens=2, temperature=temperature, logit_bias=bias,
                           **settings)
    _check(_joint(np.asarray(out.tokens)), _exact_joint(target, temperature, bias=bias, **settings))


def test_rows_of_one_call_take_their_own_logit_bias(tiny_pair):
    """generate(logit_bias=[one per row]): biased rows beside unbiased ones, each half
    distributed as its own settings say."""
    target, draft = tiny_pair
    half = ROWS // 2
    prompts = np.tile(np.array(PROMPT, np.int32), (2 * half, 1))
    out = specjax.generate(target, prompts, np.full(2 * half, len(PROMPT), np.int32), draft=draft,
                           key=jax.random.key(4), max_new_tokens=2, num_draft_tokens=2, temperature=1.0,
                           logit_bias=[BIAS] * half + [None] * half)
    tokens = np.asarray(out.tokens)
    _check(_joint(tokens[:half]), _exact_joint(target, 1.0, bias=BIAS))
    _check(_joint(tokens[half:]), _exact_joint(target, 1.0))


def _greedy_reference(target, prompt, n, bias):
    """Plain greedy decoding of n tokens by the argmax of forward's logits plus the bias."""
    seq = list(prompt)
    for _ in range(n):
        logits = np.array(specjax.forward(target, np.array([seq], np.int32))[0, -1])
        for token, b in bias.items():
            logits[token] += b
        seq.append(int(logits.argmax()))
    return seq[len(prompt):]


GREEDY_DRAFTERS = {
    "plain": lambda d: None,
    "chain": lambda d: specjax.DraftModel(d),
    "tree": lambda d: specjax.DraftModel(d, specjax.Tree(depth=3, top_k=2, nodes=6)),
    "prompt_lookup": lambda d: specjax.PromptLookup(2, 1),
    "early_exit": lambda d: specjax.EarlyExit(1),
}
# The greedy tests' drafters: a tree and prompt lookup in the suite, the others with -m slow.
GREEDY_CASES = [d if d in ("tree", "prompt_lookup") else pytest.param(d, marks=pytest.mark.slow)
                for d in GREEDY_DRAFTERS]


@pytest.mark.parametrize("drafter", GREEDY_CASES)
def test_greedy_with_a_logit_bias_equals_plain_decoding(tiny_pair, drafter):
    target, draft = tiny_pair
    prompts = [PROMPT, PROMPT[::-1] + [7]]
    padded, lengths = specjax.pad_prompts(prompts)
    bias = {int(np.asarray(specjax.forward(target, np.array([PROMPT], np.int32)))[0, -1].argmax()): -100.0, 3: 0.7}
    out = specjax.generate(target, padded, lengths, draft=GREEDY_DRAFTERS[drafter](draft), max_new_tokens=8,
                           logit_bias=bias, min_p=0.5)
    for row, prompt in enumerate(prompts):
        assert list(np.asarray(out.tokens[row])) == _greedy_reference(target, prompt, 8, bias), drafter


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_p=1.5), "min_p must lie in"),
    (dict(min_p=-0.1), "min_p must lie in"),
    (dict(logit_bias={V: 1.0}), "token id 8 is not an int in"),
    (dict(logit_bias={1: 101.0}), r"logit_bias\[1\] must be a number in \[-100, 100\]"),
    (dict(logit_bias={1: float("nan")}), r"logit_bias\[1\] must be a number"),
    (dict(logit_bias={1.5: 1.0}), "token id 1.5 is not an int"),
    (dict(logit_bias="1:2"), "logit_bias must be None, a .token id: bias. mapping or a list"),
    (dict(logit_bias=[{1: 1.0}] * 3), "a list of 2 of them"),
])
def test_bad_min_p_and_logit_bias_are_refused_by_name(tiny_pair, kwargs, message):
    target, _ = tiny_pair
    padded, lengths = specjax.pad_prompts([PROMPT, PROMPT])
    with pytest.raises(ValueError, match=message):
        specjax.generate(target, padded, lengths, max_new_tokens=2, **kwargs)


def test_a_logit_bias_holds_at_most_openai_s_300_entries():
    with pytest.raises(ValueError, match="logit_bias holds 301 entries; at most 300"):
        check_logit_bias({i: 1.0 for i in range(301)}, 1000)
    assert check_logit_bias({7: 1, 2: -3.5}, 8) == {2: -3.5, 7: 1.0}


def test_the_engine_refuses_bad_values_at_submit(tiny_pair):
    target, _ = tiny_pair
    engine = specjax.Engine(target, slots=2, max_len=16, max_logit_bias=2)
    with engine:
        with pytest.raises(ValueError, match="logit_bias holds 3 entries; at most 2"):
            engine.submit(PROMPT, max_new_tokens=2, logit_bias={1: 1.0, 2: 1.0, 3: 1.0})
        with pytest.raises(ValueError, match="min_p must lie in"):
            engine.submit(PROMPT, max_new_tokens=2, min_p=2.0)
        with pytest.raises(ValueError, match="token id 8 is not an int in"):
            engine.submit(PROMPT, max_new_tokens=2, logit_bias={8: 1.0})
    with pytest.raises(ValueError, match="max_logit_bias must be an int >= 0"):
        specjax.Engine(target, slots=2, max_len=16, max_logit_bias=-1)
