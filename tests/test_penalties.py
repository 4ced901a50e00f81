"""presence_penalty, frequency_penalty and repetition_penalty: applied as vLLM's
`apply_penalties` and transformers' RepetitionPenaltyLogitsProcessor do (repetition over the
prompt and output, frequency and presence over the output), per row, exact under
speculation (chi-square against the enumerated joint, where the second token is penalized
by the first: a draft node counts its path as emitted), greedy output equal to plain
penalized decoding for every drafter, and bad values refused by name. The engine's (a
preempted request resumes with its output still counted as output) in test_engine_pages.py,
its chi-square in test_engine.py, the server's in test_serve.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

import specjax
from specjax.sampling import History, Sampling, check_penalties, penalize
from tests.test_sampling import PROMPT, ROWS, V, _tiny, _transformers_probs
from tests.test_sampling_params import GREEDY_CASES, GREEDY_DRAFTERS, _check, _joint

PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.5, repetition_penalty=1.7)


@pytest.fixture(scope="module")
def tiny_pair():
    target = _tiny(0, 0.6)
    return target, _tiny(1, 0.15, base=target)


def _reference(logits, seq, prompt_len, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0):
    """logits [V] after the tokens seq (its first prompt_len the prompt): transformers'
    repetition processor over the whole sequence, then vLLM's frequency and presence over
    the output."""
    x = torch.as_tensor(np.array(logits, np.float32)[None])
    x = RepetitionPenaltyLogitsProcessor(repetition_penalty)(torch.tensor([list(seq)]), x).numpy()[0]
    counts = np.bincount(np.array(seq[prompt_len:], np.int64), minlength=x.size)
    return x - frequency_penalty * counts - presence_penalty * (counts > 0)


def test_penalize_matches_transformers_and_vllm_per_row_and_path():
    """Rows with their own penalties (one off), each position's own path of draft tokens
    counted as emitted: what the references give for prompt + output + that path."""
    rng = np.random.RandomState(0)
    B, T, Vb = 3, 3, 12
    logits = rng.randn(B, T, Vb).astype(np.float32) * 2
    tokens = np.array([[1, 2, 3, 3, 5, 0, 0], [4, 4, 4, 7, 8, 9, 0], [0, 1, 2, 3, 4, 5, 6]], np.int32)
    prompt_len, length = np.array([2, 3, 7]), np.array([5, 6, 7])
    path = np.array([[[-1, -1], [3, -1], [3, 11]], [[-1, -1], [4, -1], [4, 4]], [[-1, -1], [0, -1], [0, 9]]], np.int32)
    settings = [(0.6, 0.5, 1.7), (-0.3, 0.2, 0.8), (0.0, 0.0, 1.0)]
    sampling = Sampling.make(batch=B, presence_penalty=np.array([s[0] for s in settings]),
                             frequency_penalty=np.array([s[1] for s in settings]),
                             repetition_penalty=np.array([s[2] for s in settings]))
    assert sampling.kind == "filtered"
    history = History.of(jnp.asarray(tokens), jnp.asarray(prompt_len), jnp.asarray(length), Vb)
    ours = np.asarray(jax.jit(penalize)(jnp.asarray(logits), sampling, history.at(jnp.asarray(path))))
    for b, (presence, frequency, repetition) in enumerate(settings):
        for t in range(T):
            seq = list(tokens[b, :length[b]]) + [int(i) for i in path[b, t] if i >= 0]
            np.testing.assert_allclose(ours[b, t], _reference(logits[b, t], seq, prompt_len[b], presence, frequency,
                                                              repetition), rtol=1e-6, atol=1e-6, err_msg=f"{b},{t}")
    np.testing.assert_array_equal(ours[2], logits[2])  # off: untouched
    # warp leaves them out where no row asks (the program's kind) or no history is given
    assert Sampling.make(1.0, presence_penalty=0.0).kind == "sampled"
    assert Sampling.make(0.0, repetition_penalty=1.1).kind == "filtered"


def _exact_joint(target, temperature, top_k=0, top_p=1.0, min_p=0.0, bias=None, **penalties):
    """P(t1, t2 | prompt) [V, V], enumerated: each position's logits biased, penalized by the
    references for the prompt and the output so far, then warped as transformers does."""
    seqs = np.array([PROMPT + [t1] for t1 in range(V)])
    logits = np.array(specjax.forward(target, seqs))  # [V, T, V]
    for token, b in (bias or {}).items():
        logits[..., token] += b

    def probs(row, seq):
        return _transformers_probs(_reference(row, seq, len(PROMPT), **penalties), temperature, top_k, top_p, min_p)

    p1 = probs(logits[0, len(PROMPT) - 1], PROMPT)
    p2 = np.stack([probs(logits[t1, len(PROMPT)], PROMPT + [t1]) for t1 in range(V)])
    return p1[:, None] * p2


DRAFTERS = {
    "chain": lambda d: specjax.DraftModel(d),
    "sampled_tree": lambda d: specjax.DraftModel(d, specjax.Tree.from_paths([(0,), (1,), (0, 0), (1, 0)], "sampled")),
    "reduced_vocab_chain": lambda d: specjax.DraftModel(d, specjax.Tree.chain(2, "sampled")).with_vocab(
        [0, 2, 3, 4, 6]),
}


@pytest.mark.parametrize("drafter", ["chain", pytest.param("sampled_tree", marks=pytest.mark.slow),
                                     pytest.param("reduced_vocab_chain", marks=pytest.mark.slow)])
def test_speculation_is_exact_under_penalties(tiny_pair, drafter):
    """Rows with penalties beside rows without, in one call: each half distributed as plain
    decoding under its own settings (the second token penalized by the first)."""
    target, draft = tiny_pair
    half = ROWS // 2
    prompts = np.tile(np.array(PROMPT, np.int32), (2 * half, 1))
    per_row = {name: np.array([value] * half + [0.0 if name != "repetition_penalty" else 1.0] * half)
               for name, value in PENALTIES.items()}
    out = specjax.generate(target, prompts, np.full(2 * half, len(PROMPT), np.int32), draft=DRAFTERS[drafter](draft),
                           key=jax.random.key(6), max_new_tokens=2, num_draft_tokens=None if drafter != "chain" else 2,
                           temperature=1.1, **per_row)
    tokens = np.asarray(out.tokens)
    _check(_joint(tokens[:half]), _exact_joint(target, 1.1, **PENALTIES))
    _check(_joint(tokens[half:]), _exact_joint(target, 1.1))


def _greedy_reference(target, prompt, n, **penalties):
    """Plain greedy decoding of n tokens by the argmax of forward's penalized logits."""
    seq = list(prompt)
    for _ in range(n):
        logits = np.array(specjax.forward(target, np.array([seq], np.int32))[0, -1])
        seq.append(int(_reference(logits, seq, len(prompt), **penalties).argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("drafter", GREEDY_CASES)
def test_greedy_with_penalties_equals_plain_penalized_decoding(tiny_pair, drafter):
    target, draft = tiny_pair
    prompts = [PROMPT, PROMPT[::-1] + [7]]
    padded, lengths = specjax.pad_prompts(prompts)
    out = specjax.generate(target, padded, lengths, draft=GREEDY_DRAFTERS[drafter](draft), max_new_tokens=10,
                           **PENALTIES)
    plain = specjax.generate(target, padded, lengths, max_new_tokens=10)
    for row, prompt in enumerate(prompts):
        assert list(np.asarray(out.tokens[row])) == _greedy_reference(target, prompt, 10, **PENALTIES), drafter
    assert not np.array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))  # the penalties changed the text


def test_processed_logprobs_are_of_the_penalized_distribution(tiny_pair):
    target, draft = tiny_pair
    padded, lengths = specjax.pad_prompts([PROMPT])
    out = specjax.generate(target, padded, lengths, draft=draft, num_draft_tokens=3, max_new_tokens=6,
                           temperature=0.8, key=jax.random.key(1), logprobs=2, logprobs_mode="processed", **PENALTIES)
    seq = list(PROMPT) + [int(t) for t in np.asarray(out.tokens[0])]
    logits = np.asarray(specjax.forward(target, np.array([seq], np.int32)))[0]
    for j in range(6):
        at = len(PROMPT) - 1 + j
        probs = _transformers_probs(_reference(logits[at], seq[:at + 1], len(PROMPT), **PENALTIES), 0.8)
        np.testing.assert_allclose(float(out.logprobs.chosen[0, j]), np.log(probs[seq[at + 1]]), atol=1e-4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(presence_penalty=2.5), r"presence_penalty must be a number in \[-2, 2\]"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be a number in \[-2, 2\]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be a number"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number > 0"),
    (dict(presence_penalty=True), "presence_penalty must be a number"),
])
def test_bad_penalties_are_refused_by_name(tiny_pair, kwargs, message):
    target, _ = tiny_pair
    padded, lengths = specjax.pad_prompts([PROMPT])
    with pytest.raises(ValueError, match=message):
        specjax.generate(target, padded, lengths, max_new_tokens=2, **kwargs)
    with pytest.raises(ValueError, match=message):
        check_penalties(**kwargs)
