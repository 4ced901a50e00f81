"""int8 weight-only quantisation: size, closeness to float32, exact speculative decoding
with respect to the int8 target, and what it writes back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.memory import nbytes
from specjax.models import layers
from specjax.quant import CONTRACTED, Int8, quantize_array
from tests import tiny

# Mixtures of experts: softmax routing and a dense middle layer; gpt-oss's biased, clamped
# experts; GLM-4.5's grouped sigmoid router and shared expert.
MOE_ARCHS = ["qwen3_moe", "gpt_oss", "glm4_moe"]
ARCHS = ["llama"] + tiny.NEW_FAMILIES
EXPERTS = ("experts_gate", "experts_up", "experts_down")


def _int8_leaves(params):
    return [x for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Int8)) if isinstance(x, Int8)]


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_is_small_and_agrees_with_float32(arch, hf_folder):
    folder, _ = hf_folder(arch)
    f32 = specjax.load_model(folder, dtype=jnp.float32)
    bf16 = specjax.load_model(folder, dtype=jnp.bfloat16)
    q = specjax.load_model(folder, dtype=jnp.float32, quantize="int8")
    # Every matmul weight and the embedding are int8; nothing else is.
    names = {path[-1].key for path, x in jax.tree_util.tree_flatten_with_path(
        q.params, is_leaf=lambda x: isinstance(x, Int8))[0] if isinstance(x, Int8)}
    assert names == set(CONTRACTED) & {path[-1].key for path, _ in
                                       jax.tree_util.tree_flatten_with_path(f32.params)[0]}
    assert all(x.value.dtype == jnp.int8 for x in _int8_leaves(q.params))
    # Even with float32 scales and norms, int8 takes at most 0.6x the bytes of bfloat16.
    assert nbytes(q.params) <= 0.6 * nbytes(bf16.params)
    # Top-1 agreement with float32 at random positions of random sequences.
    tokens = np.random.RandomState(5).randint(0, tiny.VOCAB, (8, 48))
    a, b = (np.asarray(specjax.forward(m, tokens)) for m in (f32, q))
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.95
    assert not np.allclose(a, b, atol=1e-3), "int8 weights should not be lossless"


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_int8_experts_are_small_and_agree_with_float32(arch, hf_folder):
    """Each sparse layer's experts are int8 with scales [X, 1, I] (gate, up) and [X, 1, E]
    (down): together at most 0.3x their float32 bytes (0.6x bfloat16's) even with float32
    scales; the router stays float (its logits choose the experts). The int8 model computes
    what its weights dequantised compute, and follows float32: a token whose expert choice a
    near-tie flips differs by more than a dense model's would, so its top-1 agreement is
    bounded at 0.93, not 0.95 (tiny models' 0.95 to 0.97 measured), and its mean error small."""
    folder, _ = hf_folder(arch)
    f32 = specjax.load_model(folder, dtype=jnp.float32)
    q = specjax.load_model(folder, dtype=jnp.float32, quantize="int8")
    c = q.config
    X, E, I = c.moe.num_experts, c.hidden_size, c.moe.expert_size
    names = {path[-1].key for path, x in jax.tree_util.tree_flatten_with_path(
        q.params, is_leaf=lambda x: isinstance(x, Int8))[0] if isinstance(x, Int8)}
    assert names == set(CONTRACTED) & {path[-1].key for path, _ in jax.tree_util.tree_flatten_with_path(f32.params)[0]}
    assert set(EXPERTS) <= names
    sparse = [i for i in range(c.num_layers) if c.sparse(i)]
    assert sparse
    for i in sparse:
        moe = q.params["layers"][i]["moe"]
        assert not isinstance(moe["router"], Int8)
        for name, out in zip(EXPERTS, (I, I, E)):
            w = moe[name]
            assert isinstance(w, Int8) and w.value.dtype == jnp.int8 and w.scale.shape == (X, 1, out)
            np.testing.assert_allclose(np.asarray(w.dequantize()), np.asarray(f32.params["layers"][i]["moe"][name]),
                                       atol=float(np.max(np.asarray(w.scale))) / 2 + 1e-7)
    q_bytes, f32_bytes = (nbytes([m.params["layers"][i]["moe"][n] for i in sparse for n in EXPERTS]) for m in (q, f32))
    assert q_bytes <= 0.3 * f32_bytes
    tokens = np.random.RandomState(5).randint(0, tiny.VOCAB, (8, min(48, c.max_position_embeddings)))
    dequantised = specjax.Model(c, jax.tree.map(layers.dequantize, q.params, is_leaf=lambda x: isinstance(x, Int8)))
    a, b, d = (np.asarray(specjax.forward(m, tokens)) for m in (f32, q, dequantised))
    np.testing.assert_allclose(b, d, atol=1e-4, rtol=0)
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.93
    assert np.abs(a - b).mean() <= 0.05 * a.std()
    assert not np.allclose(a, b, atol=1e-3), "int8 weights should not be lossless"


def test_quantize_array_is_symmetric_per_output_channel():
    w = np.random.RandomState(0).randn(2, 3, 4, 6).astype(np.float32)  # [G, R+2, D, E]
    w[1, 0, 0, :] = 0.0  # an all-zero channel keeps a finite scale
    q = quantize_array(w, CONTRACTED["qkv_kernel"], jnp.float32)
    assert q.value.dtype == np.int8 and q.scale.shape == (2, 3, 4, 1)
    assert np.abs(q.value).max() == 127 and q.value.min() >= -127
    hits = np.abs(q.value).max(axis=-1) == 127  # each channel's max hits 127 (but the all-zero one)
    assert hits.sum() == hits.size - 1 and not hits[1, 0, 0]
    assert np.all(np.isfinite(q.scale)) and np.all(q.value[1, 0, 0, :] == 0)
    err = np.abs(np.asarray(q.dequantize()) - w)
    assert np.all(err <= np.asarray(q.scale) / 2 + 1e-7)  # round to nearest
    e = quantize_array(np.arange(12, dtype=np.float32).reshape(3, 4), CONTRACTED["embedding"], jnp.float32)
    assert e.scale.shape == (3, 1)  # one scale per row (token)
    np.testing.assert_allclose(np.asarray(e.rows(np.array([[2, 0]]))), np.asarray(e.dequantize())[[[2, 0]]])


def test_quantize_equals_load_with_quantize(hf_folder):
    folder, _ = hf_folder("gemma2")
    loaded = specjax.load_model(folder, quantize="int8")
    later = specjax.quantize(specjax.load_model(folder))
    a, b = (_int8_leaves(m.params) for m in (loaded, later))
    assert len(a) == len(b) == 4 * loaded.config.num_layers + 1  # qkv o gate_up down per layer, the (tied) embedding
    for x, y in zip(a, b):  # host (numpy) and device (XLA) arithmetic: equal up to an ulp
        np.testing.assert_allclose(np.asarray(x.scale), np.asarray(y.scale), rtol=1e-6)
        diff = np.abs(np.asarray(x.value, np.int32) - np.asarray(y.value, np.int32))
        assert diff.max() <= 1 and diff.mean() < 1e-3
    with pytest.raises(ValueError, match="unknown quantize='int4'"):
        specjax.load_model(folder, quantize="int4")


@pytest.mark.parametrize("arch", ["gemma2", "qwen3_moe"])
def test_speculative_equals_autoregressive_on_the_int8_target(hf_folder, arch):
    """Exactness holds with respect to the quantised target; the draft is quantised on its
    own. Over int8 experts (qwen3_moe: the sliced form for steps and verification, the
    grouped one for prefill) too."""
    folder, _ = hf_folder(arch)
    target = specjax.load_model(folder, quantize="int8")
    draft = specjax.quantize(tiny.noisy(specjax.load_model(folder), 0.02 if arch == "gemma2" else 0.015, 4))
    rng = np.random.RandomState(6)
    padded, lengths = specjax.pad_prompts([list(rng.randint(2, tiny.VOCAB, n)) for n in (12, 3, 7)], bucket=16)
    auto = specjax.generate(target, padded, lengths, max_new_tokens=14)
    spec = specjax.generate(target, padded, lengths, draft=draft, max_new_tokens=14, num_draft_tokens=3)
    np.testing.assert_array_equal(spec.tokens, auto.tokens)
    np.testing.assert_array_equal(spec.num_tokens, auto.num_tokens)
    assert 0 < spec.stats.accepted.sum() < spec.stats.drafted.sum()  # both paths ran


def test_int8_model_saves_dequantised(hf_folder, tmp_path):
    """What save_model writes of an int8 model loads (in float) to the same function."""
    folder, _ = hf_folder("qwen3_tied")
    q = specjax.load_model(folder, quantize="int8")
    specjax.save_model(q, tmp_path)
    back = specjax.load_model(tmp_path)
    tokens = np.random.RandomState(7).randint(0, tiny.VOCAB, (2, 12))
    np.testing.assert_allclose(np.asarray(specjax.forward(back, tokens)),
                               np.asarray(specjax.forward(q, tokens)), atol=1e-5, rtol=0)
