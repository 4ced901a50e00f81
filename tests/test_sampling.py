"""Sampling is exact: warping matches transformers' processors, and the speculative joint
distribution of the first two tokens matches the target's, by a chi-square test that
fails when the acceptance rule is broken."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tr
from scipy import stats

import specjax
from specjax import acceptance
from specjax.sampling import Sampling, argmax, warp

SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.7, 4, 1.0),
    (1.3, 0, 0.8),
    (1.5, 5, 0.9),
]


def _transformers_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0, bias=None):
    """transformers' warpers in its order (min-p after top-p) over logits [..., V] plus the
    bias ({token id: bias}, added first)."""
    logits = np.array(logits, np.float32)
    for token, b in (bias or {}).items():
        logits[..., token] += b
    procs = tr.LogitsProcessorList()
    if temperature != 1.0:
        procs.append(tr.TemperatureLogitsWarper(temperature))
    if top_k > 0:
        procs.append(tr.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(tr.TopPLogitsWarper(top_p))
    if min_p > 0:
        procs.append(tr.MinPLogitsWarper(min_p))
    scores = procs(None, torch.as_tensor(logits.reshape(-1, logits.shape[-1])))
    return torch.softmax(scores, dim=-1).numpy().reshape(logits.shape)


@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS + [(0.5, 1, 1.0), (1.0, 0, 0.3)])
def test_warp_matches_transformers(temperature, top_k, top_p):
    logits = np.random.RandomState(0).randn(6, 50).astype(np.float32) * 2
    ours = warp(jnp.asarray(logits), Sampling.make(temperature, top_k, top_p))
    np.testing.assert_allclose(np.asarray(ours), _transformers_probs(logits, temperature, top_k, top_p),
                               atol=1e-6)


def _kept_whole_at_ties(logits, temperature, top_k, top_p):
    """transformers' top-k then top-p by a sort, except that a tie at the top-p cut is kept
    whole (transformers removes some of its members, in whatever order its sort leaves them)."""
    scores = logits / temperature
    if top_k:
        scores = np.where(scores < np.sort(scores)[-top_k], -np.inf, scores)
    if top_p < 1.0:
        ascending = np.sort(scores)
        probs = np.exp(ascending - ascending[-1])
        cumulative = np.cumsum(probs / probs.sum())
        cutoff = ascending[np.sum(cumulative[:-1] <= 1.0 - top_p)]
        scores = np.where(scores < cutoff, -np.inf, scores)
    probs = np.exp(scores - scores.max())
    return probs / probs.sum()


@pytest.mark.parametrize("ties", [False, True])
def test_filters_match_transformers_per_row(ties):
    """Rows of one batch with their own top-k/top-p (off in some), -inf entries (ids a draft
    vocabulary lacks), a vocabulary of 5,000: the sort-free cuts keep what transformers'
    warpers keep, row by row; with many ties, what its rule keeps when a tie at the top-p cut
    is kept whole (specjax's rule: tied scores are never split)."""
    rng = np.random.RandomState(3)
    logits = (rng.randn(8, 5000) * 2).astype(np.float32)
    if ties:
        logits = np.round(logits, 1)  # ~100 distinct values
    logits[:, rng.rand(5000) < 0.3] = -np.inf
    settings = [(1.0, 0, 1.0), (0.7, 50, 1.0), (1.3, 0, 0.9), (1.0, 7, 0.5), (0.9, 4999, 0.99),
                (1.0, 1, 1.0), (2.0, 0, 0.05), (1.0, 3000, 0.7)]
    temperature, top_k, top_p = (np.array(x) for x in zip(*settings))
    ours = np.asarray(jax.jit(warp)(jnp.asarray(logits), Sampling.make(temperature, top_k, top_p)))
    for row, (t, k, p) in enumerate(settings):
        want = (_kept_whole_at_ties(logits[row], t, k, p) if ties else
                _transformers_probs(logits[row:row + 1], t, k, p)[0])
        np.testing.assert_allclose(ours[row], want, atol=1e-6, err_msg=str((t, k, p)))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_extreme_settings_act_as_their_limits(jit):
    """Logits far from 0 (|x| ~ 100, as a real model's can be) at temperatures down to a
    subnormal 1e-45 act as greedy (one-hot on the argmax; ties shared), never NaN (a NaN row
    drew token 0 at 02042b0); huge temperatures give the uniform distribution; top_p near 0
    keeps the top token; a top_k beyond the vocabulary keeps every one."""
    rng = np.random.RandomState(4)
    logits = (rng.randn(4, 50) * 100).astype(np.float32)
    logits[1, 7] = logits[1].max() + 50  # a clear winner
    logits[2, :5] = -np.inf
    one_hot = np.eye(50)[logits.argmax(-1)]
    f = jax.jit(warp) if jit else warp
    for t in (1e-45, 1e-40, float(np.finfo(np.float32).tiny), 1e-37, 1e-30, 1e-6):
        for k, p in ((0, 1.0), (3, 1.0), (0, 0.5), (2, 0.9)):
            probs = np.asarray(f(jnp.asarray(logits), Sampling.make(t, k, p, batch=4)))
            np.testing.assert_array_equal(probs, one_hot, err_msg=str((t, k, p)))
    for t in (1e30, 3e38):
        probs = np.asarray(f(jnp.asarray(logits), Sampling.make(t, 0, 1.0, batch=4)))
        want = np.where(np.isinf(logits), 0.0, 1.0)
        np.testing.assert_allclose(probs, want / want.sum(-1, keepdims=True), atol=1e-6)
    for p in (1e-30, 1e-10, 1e-7):
        probs = np.asarray(f(jnp.asarray(logits), Sampling.make(1.0, 0, p, batch=4)))
        np.testing.assert_array_equal(probs, one_hot, err_msg=str(p))
    probs = np.asarray(f(jnp.asarray(logits), Sampling.make(1.0, 2**31 - 1, 1.0, batch=4)))
    np.testing.assert_allclose(probs, _transformers_probs(logits, 1.0, 0, 1.0), atol=1e-6)


def test_greedy_is_one_hot_argmax():
    logits = np.random.RandomState(1).randn(4, 30).astype(np.float32)
    probs = np.asarray(warp(jnp.asarray(logits), Sampling.make(0.0, 3, 0.5)))
    np.testing.assert_array_equal(probs, np.eye(30)[logits.argmax(-1)])


def test_argmax_is_jnp_argmax():
    """The first index of the maximum, ties, NaN (counted as largest, first of them), rows
    of -inf and +inf included, jitted and not, along the last axis of any rank."""
    x = np.random.RandomState(2).randn(3, 7, 300).astype(np.float32)
    x = np.round(x, 1)  # many ties
    x[0, 0, [5, 9]] = 99.0
    x[0, 1, [4, 8]] = np.nan
    x[0, 2] = -np.inf
    x[0, 3, 11] = np.inf
    for f in (argmax, jax.jit(argmax)):
        got = np.asarray(f(jnp.asarray(x)))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert list(np.asarray(argmax(jnp.asarray(x)))[0, :4]) == [5, 4, 0, 11]


# ---- the joint distribution of the first two tokens -------------------------------------

V, ROWS, PROMPT = 8, 6000, [1, 2, 3, 1, 2]


def _tiny(seed, std, base=None, moe=None):
    config = specjax.ModelConfig(
        model_type="llama" if moe is None else "qwen3_moe", vocab_size=V, hidden_size=16, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=8, intermediate_size=24, max_position_embeddings=64,
        norm_eps=1e-6, tie_word_embeddings=False, moe=moe)
    model = specjax.models.init(config, jax.random.key(seed), jnp.float32)
    rng = np.random.RandomState(seed)
    base = model.params if base is None else base.params
    params = jax.tree.map(lambda b, x: b + jnp.asarray(rng.randn(*x.shape) * std, jnp.float32)
                          if x.ndim > 1 else b, base, model.params)
    return specjax.Model(config, params)


@pytest.fixture(scope="module")
def tiny_pair():
    """A target and a draft that accepts about three tokens in four (sum min(p, q) = 0.75)."""
    target = _tiny(0, 0.6)
    return target, _tiny(1, 0.15, base=target)


def _exact_joint(target, temperature, top_k=0, top_p=1.0, **more):
    """P(t1, t2 | prompt) [V, V], enumerated with transformers' processors (more: min_p,
    bias: `_transformers_probs`')."""
    seqs = np.array([PROMPT + [t1] for t1 in range(V)])
    logits = np.asarray(specjax.forward(target, seqs))  # [V, T, V]
    p1 = _transformers_probs(logits[:1, len(PROMPT) - 1], temperature, top_k, top_p, **more)[0]
    p2 = _transformers_probs(logits[:, len(PROMPT)], temperature, top_k, top_p, **more)
    return p1[:, None] * p2


def _sampled_joint(target, draft, seed, temperature, top_k, top_p, K=2):
    prompts = np.tile(np.array(PROMPT, np.int32), (ROWS, 1))
    lengths = np.full(ROWS, len(PROMPT), np.int32)
    out = specjax.generate(target, prompts, lengths, draft=draft, key=jax.random.key(seed),
                           max_new_tokens=2, num_draft_tokens=K, temperature=temperature,
                           top_k=top_k, top_p=top_p)
    t = np.asarray(out.tokens)
    return np.bincount(t[:, 0] * V + t[:, 1], minlength=V * V).reshape(V, V)


def _chi_square_p(observed, expected_probs):
    """p-value of observed counts under expected probabilities; bins with expected < 5 merged."""
    expected = expected_probs.ravel() * observed.sum()
    observed = observed.ravel()
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
def test_speculative_sampling_is_exact(tiny_pair, temperature, top_k, top_p):
    target, draft = tiny_pair
    _check_exact(target, draft, temperature, top_k, top_p)


@pytest.mark.parametrize("drafter", [specjax.EarlyExit(1), specjax.PromptLookup(2, 1)],
                         ids=["early_exit", "prompt_lookup"])
def test_sampling_is_exact_with_other_drafters(tiny_pair, drafter):
    _check_exact(tiny_pair[0], drafter, *SETTINGS[3])


def test_sampling_is_exact_over_a_moe_target():
    """A mixture of experts (4 experts, top 2, renormalised) as the target, a noisy copy
    drafting: the first two tokens' joint distribution is the target's."""
    from specjax.config import Moe

    moe = Moe(num_experts=4, top_k=2, expert_size=12, norm_topk=True)
    target = _tiny(3, 0.6, moe=moe)
    _check_exact(target, _tiny(4, 0.15, base=target, moe=moe), *SETTINGS[3])


def _check_exact(target, draft, temperature, top_k, top_p):
    expected = _exact_joint(target, temperature, top_k, top_p)
    observed = _sampled_joint(target, draft, 0, temperature, top_k, top_p)
    # Tokens outside top-k/top-p are never drawn.
    assert observed[expected == 0].sum() == 0
    assert _chi_square_p(observed, expected) > 1e-3


def test_autoregressive_sampling_is_exact(tiny_pair):
    target, _ = tiny_pair
    expected = _exact_joint(target, 1.0, 0, 1.0)
    observed = _sampled_joint(target, None, 1, 1.0, 0, 1.0, K=None)
    assert _chi_square_p(observed, expected) > 1e-3


def test_a_tiny_temperature_decodes_greedily(tiny_pair):
    """A target whose logits reach +-100s at temperature 1e-37 (logits / T overflows):
    plain and speculative decoding give the greedy tokens (token 0 over and over at 02042b0)."""
    target, draft = tiny_pair
    loud = target.replace(params={**target.params, "lm_head": target.params["lm_head"] * 300})
    prompts = np.array([PROMPT, PROMPT[::-1]], np.int32)
    lengths = np.full(2, len(PROMPT), np.int32)
    run = lambda d, t: np.asarray(specjax.generate(  # noqa: E731
        loud, prompts, lengths, draft=d, key=jax.random.key(0), max_new_tokens=6,
        num_draft_tokens=None if d is None else 2, temperature=t).tokens)
    assert np.abs(np.asarray(specjax.forward(loud, prompts))).max() > 100
    greedy = run(None, 0.0)
    np.testing.assert_array_equal(run(None, 1e-37), greedy)
    np.testing.assert_array_equal(run(draft, 1e-37), greedy)


def _accept_all(key, tokens, parents, valid, q, p, max_depth, platform=None):
    """Broken: every draft of the chain accepted, so the draft's distribution leaks through."""
    B, N = tokens.shape
    path = jnp.broadcast_to(jnp.arange(1, max_depth + 1, dtype=jnp.int32), (B, max_depth))
    return jnp.full((B,), N, jnp.int32), path, specjax.sampling.sample(key, p[:, N])


def _keep_p_after_rejection(r, q, x):
    """Broken: the right acceptance test, but after a rejection draws from p, not p - q."""
    return r


@pytest.mark.parametrize("target_name, broken", [("accept", _accept_all),
                                                 ("remove_rejected", _keep_p_after_rejection)])
def test_broken_acceptance_fails_the_test(tiny_pair, monkeypatch, target_name, broken):
    """Proof that the chi-square test has teeth."""
    target, draft = tiny_pair
    monkeypatch.setattr(acceptance, target_name, broken)
    jax.clear_caches()
    try:
        observed = _sampled_joint(target, draft, 0, 1.0, 0, 1.0)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert _chi_square_p(observed, _exact_joint(target, 1.0, 0, 1.0)) < 1e-6


def test_residual_distribution_is_guarded():
    """q == p everywhere (p - q <= 0): no division by zero, no NaN, a valid token."""
    p = jnp.full((2, 2, 5), 0.2)
    q = jnp.full((2, 1, 5), 0.2)
    drafts = jnp.array([[1], [4]], jnp.int32)
    valid = jnp.ones((2, 1), bool)
    n, path, extra = acceptance.accept(jax.random.key(0), drafts, np.zeros(1, np.int32), valid, q, p, 1)
    assert n.tolist() == [1, 1] and path.tolist() == [[1], [1]] and ((extra >= 0) & (extra < 5)).all()
    # a rejection where the residual is all zeros up to rounding
    left = acceptance.remove_rejected(jnp.full((2, 5), 0.2), jnp.full((2, 5), 0.2), jnp.array([1, 4]))
    np.testing.assert_allclose(left, 0.2)
    q0 = jnp.zeros((2, 1, 5)).at[:, :, 0].set(1.0)
    p0 = jnp.zeros((2, 2, 5)).at[:, :, 0].set(1.0)
    n, _, extra = acceptance.accept(jax.random.key(1), jnp.array([[0], [0]], jnp.int32),
                                    np.zeros(1, np.int32), valid, q0, p0, 1)
    assert n.tolist() == [1, 1] and extra.tolist() == [0, 0]


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_acceptance_is_the_general_rule_at_temperature_0(with_q):
    """accept_greedy (argmax comparisons, what `verify` runs at temperature 0) keeps the same
    path and extra token as `accept` with warp's one-hot p, on random trees of 3-way ties and
    drafts that often match; with q drawn from the one-hot draft distribution or deterministic."""
    rng = np.random.default_rng(0)
    B, N, V, D = 64, 7, 6, 4
    parents = np.array([0, 0, 1, 1, 2, 4, 3], np.int32)  # nodes after their parents, depth <= 4
    logits = jnp.asarray(rng.integers(0, 3, (B, N + 1, V)), jnp.float32)  # many ties
    best = jnp.argmax(logits, axis=-1)
    parent_best = np.asarray(best)[:, np.concatenate([[0], parents])[1:]]
    tokens = jnp.asarray(np.where(rng.random((B, N)) < 0.6, parent_best, rng.integers(0, V, (B, N))), jnp.int32)
    valid = jnp.asarray(rng.random((B, N)) < 0.9)
    q = jax.nn.one_hot(tokens, V) if with_q else None
    greedy = Sampling.make(0.0)
    general = acceptance.accept(jax.random.key(1), tokens, parents, valid, q, warp(logits, greedy), D)
    fast = acceptance.accept_greedy(tokens, parents, valid, best, D)
    through_verify = acceptance.verify(jax.random.key(1), tokens, parents, valid, q, logits, greedy, D)
    for a, b, c in zip(general, fast, through_verify):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert 0 < int((general[0] > 0).sum()) < B  # some rows accept, some do not
    assert int(general[0].max()) >= 2


def test_deterministic_candidates_walk_without_a_vocabulary_sized_distribution():
    """A tree of deterministic candidates (q None: top-k siblings, prompt lookup) walks by
    p(R), the rejected mass, and draws once at the stop (`_accept_deterministic`): the same
    path and token as the walk over r [B, V] with q one-hot, the rule it stands for, on random
    distributions, siblings that repeat a token (a repeat is never accepted) and siblings
    that hold all of p's mass (the last one tried is always accepted)."""
    rng = np.random.default_rng(1)
    B, N, V, D = 256, 8, 5, 4
    parents = np.array([0, 0, 0, 1, 1, 2, 4, 4], np.int32)  # three root children, depth <= 3
    p = jnp.asarray(rng.dirichlet(np.full(V, 0.5), (B, N + 1)), jnp.float32)
    tokens = rng.integers(0, V, (B, N))
    tokens[: B // 4, 1] = tokens[: B // 4, 0]  # a quarter of the rows repeat a root child
    p = p.at[B // 4: B // 2, 0].set(jnp.zeros(V).at[:2].set(0.5))  # and a quarter put all mass on two
    tokens[B // 4: B // 2, :2] = [0, 1]
    tokens = jnp.asarray(tokens, jnp.int32)
    valid = jnp.asarray(rng.random((B, N)) < 0.9)
    for seed in range(3):
        key = jax.random.key(seed)
        walk = acceptance.accept(key, tokens, parents, valid, None, p, D)
        dense = acceptance.accept(key, tokens, parents, valid, jax.nn.one_hot(tokens, V), p, D)
        for a, b in zip(walk, dense):
            np.testing.assert_array_equal(a, b)
    assert 0 < int((walk[0] > 0).sum()) < B and int(walk[0].max()) >= 2


def test_a_node_s_row_is_taken_exactly_on_every_platform():
    """`node_row` (p or q at each row's stop) gives x[b, index[b]] bit for bit, as a gather and,
    in a program for a TPU, as a one-term sum over the node axis, -inf and all."""
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 5, 7)), jnp.float32).at[1, 3, 2].set(-jnp.inf)
    index = jnp.array([0, 3, 4, 2], jnp.int32)
    want = np.asarray(x)[np.arange(4), np.asarray(index)]
    for platform, form in (("cpu", "gather"), ("tpu", "reduce_sum")):
        traced = jax.jit(lambda x, i: acceptance.node_row(x, i, platform)).trace(x, index)  # a new jit: traced anew
        assert form in str(traced.jaxpr), platform
        np.testing.assert_array_equal(np.asarray(traced.lower().compile()(x, index)), want, err_msg=platform)
