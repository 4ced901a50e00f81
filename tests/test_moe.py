"""Mixtures of experts (models/moe.py): every form of the experts' computation against a
per-token reference, speculative decoding over MoE targets equal to transformers' greedy
decoding, the deterministic mode's bits, the paged engine, and experts split over devices.
(Parity of each family's logits is tests/test_models.py's.)"""

import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.models import moe
from tests import children, tiny
from tests.test_engine import _alone, _staggered

MAX_NEW = 12


def _reference(x, weights, experts, gate, up, down):
    """Each token, each of its experts, one after another (float64)."""
    x, weights, gate, up, down = (np.asarray(a, np.float64) for a in (x, weights, gate, up, down))
    out = np.zeros_like(x)
    for n, (row, chosen) in enumerate(zip(x, np.asarray(experts))):
        for j, e in enumerate(chosen):
            g, u = row @ gate[e], row @ up[e]
            out[n] += weights[n, j] * ((g / (1 + np.exp(-g))) * u) @ down[e]
    return out


@pytest.mark.parametrize("form", moe.FORMS)
def test_every_form_computes_each_token_s_experts(form):
    """17 tokens, top 3 of 6 experts (some experts chosen by none): each form equals the
    per-token sum, on one device and as the sum of two devices' halves of the experts."""
    rng = np.random.RandomState(0)
    N, k, E, X, I = 17, 3, 8, 6, 5
    x = jnp.asarray(rng.randn(N, E), jnp.float32)
    gate, up = (jnp.asarray(rng.randn(X, E, I) * 0.5, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.randn(X, I, E) * 0.5, jnp.float32)
    weights = jnp.asarray(rng.rand(N, k), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice([0, 1, 3, 4], k, replace=False) for _ in range(N)]), jnp.int32)
    expected = _reference(x, weights, experts, gate, up, down)
    whole = jax.jit(lambda *a: moe.experts_out(*a, form=form))(x, weights, experts, gate, up, down)
    np.testing.assert_allclose(np.asarray(whole), expected, rtol=1e-5, atol=1e-4)
    halves = sum(moe.experts_out(x, weights, experts, gate[s:s + 3], up[s:s + 3], down[s:s + 3], form, first=s)
                 for s in (0, 3))
    np.testing.assert_allclose(np.asarray(halves), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("form", moe.FORMS)
def test_every_form_computes_int8_experts(form):
    """Experts in int8 (a scale per expert per output channel): each form, on one device and
    as two devices' halves, computes what its weights dequantised compute (to float32's
    rounding), and what the float weights compute within int8's error; with gpt-oss's biases
    and clamp too. A scale applied to the wrong expert's rows, or to the wrong channels, would
    miss both."""
    from specjax.quant import CONTRACTED, quantize_array

    rng = np.random.RandomState(0)
    N, k, E, X, I = 5, 3, 8, 6, 5  # 15 assignments: the sliced form's size of pass
    x = jnp.asarray(rng.randn(N, E), jnp.float32)
    scales = rng.choice([0.1, 1.0, 10.0], (X, 1, 1))  # experts of different magnitudes: per-expert scales matter
    gate, up = (jnp.asarray(rng.randn(X, E, I) * scales, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.randn(X, I, E) * scales, jnp.float32)
    weights = jnp.asarray(rng.rand(N, k), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice([0, 1, 3, 4, 5], k, replace=False) for _ in range(N)]), jnp.int32)
    q = tuple(quantize_array(w, CONTRACTED[n], jnp.float32)
              for w, n in zip((gate, up, down), ("experts_gate", "experts_up", "experts_down")))
    dq = tuple(w.dequantize() for w in q)
    bias = tuple(jnp.asarray(rng.randn(X, n), jnp.float32) for n in (I, I, E))
    act = functools.partial(moe.clamped_swiglu, limit=2.0, alpha=1.702)
    run = jax.jit(lambda s, w, b: moe.experts_out(x, weights, experts, *w, form=form, first=s, bias=b, act=act))
    want = np.asarray(run(0, dq, bias))
    bound = dict(rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(run(0, q, bias)), want, **bound)
    halves = sum(run(s, *jax.tree.map(lambda v: v[s:s + 3], (q, bias))) for s in (0, 3))
    np.testing.assert_allclose(np.asarray(halves), want, **bound)
    exact = _reference(x, weights, experts, gate, up, down)
    err = np.abs(np.asarray(jax.jit(moe.experts_out, static_argnums=6)(x, weights, experts, *q, form)) - exact).max()
    assert 0 < err < 0.02 * np.abs(exact).max()


def test_the_form_follows_the_pass():
    assert moe.choose_form("cpu", 8) == moe.choose_form("tpu", moe.SLICED) == "sliced"
    assert moe.choose_form("gpu", moe.SLICED + 1) == "grouped"
    assert moe.choose_form("tpu", 512) == "ragged_dot"


def test_router_renormalises_only_where_the_config_says(hf_folder):
    """Qwen3-MoE (norm_topk_prob) sums its k weights to one; Qwen2-MoE does not."""
    logits = jnp.asarray(np.random.RandomState(1).randn(5, 6), jnp.float32)
    for arch, normed in (("qwen3_moe", True), ("qwen2_moe", False)):
        config = specjax.load_model(hf_folder(arch)[0]).config
        weights, experts = moe.route(config, logits[:, :config.moe.num_experts])
        assert weights.shape == experts.shape == (5, config.moe.top_k)
        assert np.allclose(np.asarray(weights.sum(-1)), 1.0) == normed


@pytest.mark.parametrize("arch,tree", [("qwen3_moe", None), ("mixtral", specjax.Tree(3, 2, 6)), ("glm4_moe", None),
                                       pytest.param("qwen2_moe", None, marks=pytest.mark.slow)])
def test_speculative_greedy_over_a_moe_target_equals_transformers(arch, tree, hf_folder):
    """A noisy copy drafting a chain (K=3) or a tree for a MoE target: transformers' greedy rows."""
    folder, torch_model = hf_folder(arch)
    target = specjax.load_model(folder)
    rng = np.random.RandomState(8)
    prompts = [list(rng.randint(2, tiny.VOCAB, n)) for n in (11, 4, 8)]
    padded, lengths = specjax.pad_prompts(prompts, bucket=16)
    draft = tiny.noisy(target, 0.015, 1)
    out = specjax.generate(target, padded, lengths, draft=draft if tree is None else specjax.DraftModel(draft, tree),
                           max_new_tokens=MAX_NEW, num_draft_tokens=3 if tree is None else None)
    rows = [out.tokens[b, :out.num_tokens[b]].tolist() for b in range(len(prompts))]
    assert rows == [tiny.transformers_greedy(torch_model, p, MAX_NEW) for p in prompts]
    assert 0 < out.stats.accepted.sum() < out.stats.drafted.sum()  # both paths ran


def test_eagle3_over_a_moe_target_equals_plain_greedy(hf_folder):
    """An EAGLE-3 head (reading three of the target's layers' states, experts among them)
    drafting chains for a MoE target: the target's own greedy rows."""
    target = specjax.load_model(hf_folder("qwen3_moe")[0])
    rng = np.random.RandomState(9)
    padded, lengths = specjax.pad_prompts([list(rng.randint(2, tiny.VOCAB, n)) for n in (9, 5)], bucket=16)
    plain = specjax.generate(target, padded, lengths, max_new_tokens=MAX_NEW)
    out = specjax.generate(target, padded, lengths, draft=specjax.Eagle3.init(target, jax.random.key(2)),
                           max_new_tokens=MAX_NEW, num_draft_tokens=3)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.num_tokens, plain.num_tokens)


def test_a_moe_token_gets_the_same_bits_from_every_pass(hf_folder):
    """deterministic=True over a MoE target in bfloat16: a step, a verification pass, a row
    alone, a full pass and a longer cache give the same bits (test_exact's check)."""
    from tests.test_exact import test_a_token_gets_the_same_bits_from_every_pass as check

    check(specjax.load_model(hf_folder("qwen3_moe")[0], dtype=jnp.bfloat16))


def test_the_paged_engine_over_a_moe_target_equals_generate_alone(hf_folder):
    """Staggered requests through the paged engine (prefix caching, chunked prefill, a draft
    model): each row what `generate` gives the prompt alone."""
    target = specjax.load_model(hf_folder("qwen3_moe")[0])
    requests = [(list(np.random.RandomState(n).randint(3, 97, n)), budget, ())
                for n, budget in ((5, 12), (17, 6), (30, 15), (9, 9))]
    engine = specjax.Engine(target, draft=tiny.noisy(target, 0.015, 1), slots=3, max_len=64, num_draft_tokens=2,
                            steps_per_call=4, kv_pages=7, page_size=8, prefill_chunk=16)
    outputs, _ = _staggered(engine, requests)
    for (prompt, budget, stops), got in zip(requests, outputs):
        assert got == _alone(target, prompt, budget, stops)
    assert engine.stats()["free_pages"] == 7


def test_experts_split_over_an_expert_axis_compute_what_one_device_does(hf_folder):
    """On 8 emulated devices, meshes with 8, 2 and 4 expert devices (beside data and model) and
    one without an expert axis (2x1x4: the experts over `model`, whole):
    logits equal one device's, each device holds its share of the experts, and no
    collective moves anything a weight's size (the shares are summed: one [N, E] a layer);
    int8 experts (values and scales each split) on the 2x2x2 mesh alike."""
    folder = hf_folder("qwen3_moe")[0]
    child = Path(__file__).parent / "moe_sharded_check.py"
    result = subprocess.run([sys.executable, str(child), str(folder)], capture_output=True, text=True, timeout=600,
                            env=children.env(PYTHONPATH=str(Path(__file__).parent.parent)))
    assert result.returncode == 0, result.stderr[-3000:]
    findings = json.loads(result.stdout.strip().splitlines()[-1])
    X = 8
    assert "2x2x2 int8" in findings
    for mesh, found in findings.items():
        data, expert, model = (int(n) for n in mesh.split()[0].split("x"))
        experts = expert if expert > 1 else model  # no expert axis: the experts lie over `model`, whole
        assert found["max_diff"] < 1e-5, (mesh, found)
        assert found["experts_per_device"] == X // experts, (mesh, found)
        assert found["largest_collective"] < found["largest_weight"], (mesh, found)


def test_a_moe_verification_is_priced_by_the_experts_it_touches():
    """Qwen3-30B-A3B's shape (128 experts, top 8, 48 layers): one token reads 8 experts a
    layer, a K=4 verification's 5 tokens about 35 (uniform routing); the engine's K policy
    prices a profile's steps by those bytes, so it never speculates deeper than over a dense
    target, and less where the verification's price outruns what acceptance gains."""
    from specjax import theory
    from specjax.config import ModelConfig, Moe
    from specjax.serve.policy import KPolicy, verify_cost

    assert theory.expected_experts(128, 8, 1) == pytest.approx(8)
    assert theory.expected_experts(128, 8, 5) == pytest.approx(128 * (1 - (120 / 128) ** 5))
    assert theory.expected_experts(128, 8, 10_000) == pytest.approx(128)
    moe = ModelConfig(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                      num_kv_heads=4, head_dim=128, intermediate_size=6144, max_position_embeddings=40960,
                      norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True,
                      moe=Moe(num_experts=128, top_k=8, expert_size=768, norm_topk=True))
    assert moe.num_active_params() == pytest.approx(3.35e9, rel=0.01)  # "A3B"
    cost = verify_cost(moe)
    ratios = [cost(1, K) for K in range(9)]
    assert ratios[0] == 1.0 and all(b > a for a, b in zip(ratios, ratios[1:])) and 2.5 < ratios[4] < 3.2
    assert verify_cost(dataclasses.replace(moe, moe=None))(1, 4) == 1.0

    class Chain:  # a drafter as KPolicy sees one
        tree, fixed_shape, wants_features = None, False, False

    profile = theory.CostProfile(batches=(1, 8), step_ms=((10.0, 11, 12, 13, 14), (12.0, 14, 16, 18, 20)),
                                 acceptance=(0.8, 0.7, 0.6, 0.5))
    dense = KPolicy(Chain(), None, profile, 8).table
    sparse = KPolicy(Chain(), None, profile, 8, moe).table
    assert all(s <= d for s, d in zip(sparse, dense)) and sparse != dense, (dense, sparse)
