"""Attention sinks (gpt-oss): a learned logit per query head joins each of its queries'
softmax as one more column, of value zero (transformers' gpt-oss `eager_attention_forward`).
Every attention path with sinks against a numpy reference written from that formula: dense
and blockwise `attention`, `cached_attention` (one softmax, blocks, a GPU's loops, a sliding
window, a tree, a paged cache, the Pallas prefix kernels in their interpreter), the exact
pass, and a model's full pass against its cached and paged decoding. Sinks of magnitude 1-3,
so that they move the outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.backend import Backend
from specjax.cache import KVCache
from specjax import models
from specjax.models import apply
from specjax.models import attention as attn
from tests.test_long_context import _split_case
from tests.test_paged_kernels import _pool, _table

CPU, GPU_PORTABLE = Backend("cpu"), Backend("gpu", portable=True)
SINKS = jnp.asarray([2.5, -1.0, 1.5, -3.0], jnp.float32)  # 4 query heads


def _reference(q, k, v, mask, scale, sinks, heads_first=False):
    """transformers' formula in float64: scores masked to -inf, the head's sink a last
    column, softmax, the column dropped. q [B, T, H, D], k/v [B, S, G, D] (heads_first:
    [B, G, S, D]), mask [B, T, S] -> [B, T, H, D]."""
    q, k, v, mask = (np.asarray(x, np.float64) if x.dtype != bool else np.asarray(x) for x in (q, k, v, mask))
    if heads_first:
        k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
    H, G = q.shape[2], k.shape[2]
    k, v = np.repeat(k, H // G, axis=2), np.repeat(v, H // G, axis=2)  # transformers' repeat_kv
    scores = np.einsum("bthd,bshd->bhts", q, k) * scale
    scores = np.where(mask[:, None], scores, -np.inf)
    sink = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (*scores.shape[:-1], 1))
    logits = np.concatenate([scores, sink], axis=-1)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True))[..., :-1]
    return np.einsum("bhts,bshd->bthd", probs, v)


@pytest.mark.parametrize("kind", ["causal", "window", "blind"])
def test_attention_with_sinks_is_transformers_formula(kind):
    """Dense and blockwise (blocks of 4, 7, 16 over 37 slots), a CPU's and a GPU's loops; a
    query that sees nothing (blind) gets zeros, all its weight on the sink."""
    rng = np.random.RandomState(0)
    B, T, S, H, G, D = 2, 5, 37, 4, 2, 8
    q, k, v = (jnp.asarray(rng.randn(*shape), jnp.float32) for shape in ((B, T, H, D), (B, S, G, D), (B, S, G, D)))
    positions = np.array([[20, 21, 22, 23, 24], [3, 4, 5, 6, 7]])[:, :, None]
    slots = np.arange(S)[None, None, :]
    mask = slots <= positions
    if kind == "window":
        mask &= positions - slots < 6
    mask = np.broadcast_to(mask, (B, T, S)).copy()
    if kind == "blind":
        mask[1, 2] = False
    want = _reference(q, k, v, mask, 0.3, SINKS)
    if kind == "blind":
        assert np.all(want[1, 2] == 0)
    mask = jnp.asarray(mask)
    for block in (4, 7, 16, S):
        for backend in (CPU, GPU_PORTABLE):
            got = jax.jit(lambda *a: attn.attention(*a, 0.3, block=block, backend=backend, sinks=SINKS))(q, k, v, mask)
            np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0, err_msg=f"{block} {backend}")
    without = attn.attention(q, k, v, mask, 0.3, block=S, backend=CPU)
    assert np.abs(np.asarray(without) - want).max() > 0.05  # the sinks matter here


@pytest.mark.parametrize("kind", ["causal", "window", "tree"])
def test_cached_attention_with_sinks_is_transformers_formula(kind):
    """A cached pass (the committed prefix in place, the in-flight keys under their own
    mask, merged) with sinks: in one softmax, in blocks (a CPU's, a GPU's fixed-length
    loop; 7 slots, the last block slid back), a GPU's pass of few queries over its whole
    cache, and over a paged cache (blocks of two pages, and one softmax)."""
    args, _ = _split_case(kind, None, S=37, D=8)
    q, k, v, mask, cache_k, cache_v, prefix, floor, scale, cap = args
    B, T, S = q.shape[0], q.shape[1], cache_k.shape[2]
    # The whole mask over the written cache, as _split_case builds it for its own reference.
    whole = np.zeros((B, T, S), bool)
    start = np.asarray(prefix)
    for b in range(B):
        whole[b, :, : start[b]] = True
        if floor is not None:
            whole[b] &= np.arange(S)[None, :] > np.asarray(floor)[b][:, None]
        whole[b][:, start[b]:start[b] + T] = np.asarray(mask)[b]
    want = _reference(q, cache_k, cache_v, whole, scale, SINKS, heads_first=True)
    for block in (7, 64):
        for backend in (CPU, GPU_PORTABLE):
            got = jax.jit(lambda *a: attn.cached_attention(*a, block=block, backend=backend, sinks=SINKS))(*args)
            np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0, err_msg=f"{block} {backend}")
    with pytest.MonkeyPatch.context() as patch:  # a GPU's one softmax over the whole cache, past 5 slots
        patch.setattr(attn, "GPU_SCORES_OVER_CACHE", 10.0)
        got = jax.jit(lambda *a: attn.cached_attention(*a, block=5, backend=GPU_PORTABLE, sinks=SINKS))(*args)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)
    args, _ = _split_case(kind, None, S=40, D=8)  # pages of 8 slots, shuffled
    q, k, v, mask, cache_k, cache_v, prefix, floor, scale, cap = args
    want = attn.cached_attention(*args, block=64, backend=CPU, sinks=SINKS)
    table = _table(2, 5, 12, seed=3)
    pools = [_pool(c, table, 12, 8) for c in (cache_k, cache_v)]
    for block in (16, 64):
        got = jax.jit(lambda *a: attn.cached_attention(*a, scale, cap, block, backend=CPU, pages=table, sinks=SINKS))(
            q, k, v, mask, *pools, prefix, floor)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0, err_msg=f"paged {block}")


def test_prefix_kernels_take_sinks_and_splash_and_cudnn_do_not(monkeypatch):
    """The Pallas prefix kernels return the online softmax's state, which the sinks join
    where it is normalised: interpreted (a GPU's, over row buffers and over pages) they give
    the portable path's output. cuDNN and splash return normalised outputs: never chosen
    for a model with sinks."""
    args, _ = _split_case("causal", None, S=64, D=128)
    q, k, v, mask, cache_k, cache_v, prefix, floor, scale, cap = args
    want = attn.cached_attention(*args, backend=CPU, sinks=SINKS)
    got = jax.jit(lambda *a: attn.cached_attention(*a, scale, cap, backend=Backend("gpu"), kernels=True,
                                                   interpret=True, sinks=SINKS))(*args[:-2])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    table = _table(2, 4, 10, seed=1)
    pools = [_pool(c, table, 10, 16) for c in (cache_k, cache_v)]
    fn = jax.jit(lambda *a: attn.cached_attention(*a, scale, cap, backend=Backend("gpu"), kernels=True,
                                                  interpret=True, pages=table, sinks=SINKS))
    traced = fn.trace(q, k, v, mask, *pools, prefix, floor)
    assert "specjax_paged_prefix_attention" in str(traced.jaxpr)
    np.testing.assert_allclose(np.asarray(traced.lower().compile()(q, k, v, mask, *pools, prefix, floor)),
                               np.asarray(want), atol=2e-5, rtol=0)
    monkeypatch.setattr(attn, "_cudnn_available", lambda: True)
    assert attn.choose(Backend("gpu"), jnp.bfloat16, 1, 1024, 64, None) == "cudnn"
    assert attn.choose(Backend("gpu"), jnp.bfloat16, 1, 1024, 64, None, sinks=True) == "portable"
    assert attn.choose(Backend("tpu"), jnp.bfloat16, 512, 1024, 128, None, sinks=True) == "portable"


SINK_LLAMA = specjax.ModelConfig(model_type="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4,
                                 num_kv_heads=2, head_dim=8, intermediate_size=48, max_position_embeddings=64,
                                 norm_eps=1e-5, tie_word_embeddings=False, attn_sinks=True, sliding_window=4,
                                 layer_types=("sliding_attention", "full_attention"))


def test_a_model_with_sinks_decodes_as_its_full_pass():
    """A Llama with sinks (and a window of 4 on its first layer): one full pass, the exact
    pass, prefill then one token at a time into row buffers and into a paged cache: the
    same logits; and the sinks change them."""
    model = models.init(SINK_LLAMA, jax.random.key(0), jnp.float32)
    params = jax.tree.map(lambda x: x * 5.0, model.params)  # weights far from uniform
    for i, layer in enumerate(params["layers"]):
        layer["attn"]["sinks"] = SINKS * (1 + i)
    model = model.replace(params=params)
    B, P, N = 2, 6, 5
    tokens = np.random.RandomState(0).randint(0, 97, (B, P + N))
    positions = np.broadcast_to(np.arange(P + N), (B, P + N))
    step = jax.jit(apply)
    full = np.asarray(step(model, tokens, positions)[0])
    np.testing.assert_allclose(np.asarray(step(model.replace(exact=True), tokens, positions)[0]), full, atol=1e-4,
                               rtol=0)
    zero = jax.tree.map(lambda x: x, params)
    for layer in zero["layers"]:
        layer["attn"]["sinks"] = jnp.zeros_like(SINKS)
    assert np.abs(np.asarray(step(model.replace(params=zero), tokens, positions)[0]) - full).max() > 0.05
    paged = KVCache.init_paged(SINK_LLAMA, B, 9, 4, 4)
    paged = paged.replace(pages=jnp.asarray([[1, 3, 5, 7], [2, 4, 6, 8]], jnp.int32))
    for cache in (KVCache.init(SINK_LLAMA, B, 16), paged):
        logits, _, cache = step(model, tokens[:, :P], positions[:, :P], cache)
        np.testing.assert_allclose(np.asarray(logits), full[:, :P], atol=1e-4, rtol=0)
        for t in range(P, P + N):
            logits, _, cache = step(model, tokens[:, t:t + 1], positions[:, t:t + 1], cache)
            np.testing.assert_allclose(np.asarray(logits[:, 0]), full[:, t], atol=1e-4, rtol=0)
