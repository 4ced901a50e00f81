"""int8 weight-only quantisation: size, closeness to float32, exact speculative decoding
with respect to the int8 target, and what it writes back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.memory import nbytes
from specjax.quant import CONTRACTED, Int8, quantize_array
from tests import tiny

ARCHS = ["llama"] + tiny.NEW_FAMILIES


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


def test_speculative_equals_autoregressive_on_the_int8_target(hf_folder):
    """Exactness holds with respect to the quantised target; the draft is quantised on its own."""
    folder, _ = hf_folder("gemma2")
    target = specjax.load_model(folder, quantize="int8")
    draft = specjax.quantize(tiny.noisy(specjax.load_model(folder), 0.02, 4))
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
