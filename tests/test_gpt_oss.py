"""gpt-oss's experts beyond the MoE core: every form (gathered, grouped tiles, ragged_dot)
computes the same with expert biases and the clamped activation, and the router's top-k of
biased logits then softmax is transformers' GptOssTopKRouter. (Parity of whole models:
tests/test_models.py, test_exact.py, test_generate.py, test_hf.py with tiny.CONFIGS["gpt_oss"].)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch

from specjax.config import ModelConfig
from specjax.models import moe
from tests import tiny


def test_every_expert_form_computes_the_same_with_biases_and_the_clamp():
    rng = np.random.RandomState(0)
    N, k, X, E, I = 11, 2, 4, 8, 6
    x = jnp.asarray(rng.randn(N, E), jnp.float32)
    gate, up = (jnp.asarray(rng.randn(X, E, I), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.randn(X, I, E), jnp.float32)
    bias = (jnp.asarray(rng.randn(X, I), jnp.float32), jnp.asarray(rng.randn(X, I), jnp.float32),
            jnp.asarray(rng.randn(X, E), jnp.float32))
    experts = jnp.asarray(np.stack([rng.choice(X, k, replace=False) for _ in range(N)]), jnp.int32)
    weights = jax.nn.softmax(jnp.asarray(rng.randn(N, k), jnp.float32))
    act = functools.partial(moe.clamped_swiglu, limit=0.8, alpha=1.702)
    # the reference: each token's experts one by one, as transformers' GptOssExperts.forward
    want = np.zeros((N, E))
    for n in range(N):
        for j in range(k):
            e = int(experts[n, j])
            g, u = x[n] @ gate[e] + bias[0][e], x[n] @ up[e] + bias[1][e]
            g, u = np.minimum(g, 0.8), np.clip(u, -0.8, 0.8)
            want[n] += float(weights[n, j]) * (((u + 1) * g / (1 + np.exp(-1.702 * g))) @ down[e] + bias[2][e])
    for form in moe.FORMS:
        got = moe.experts_out(x, weights, experts, gate, up, down, form, bias=bias, act=act)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=1e-5, err_msg=form)
    # a device holding experts 2 and 3 only: the others' assignments add nothing, biases included
    half = moe.experts_out(x, weights, experts, gate[2:], up[2:], down[2:], "grouped", first=2,
                           bias=tuple(b[2:] for b in bias), act=act)
    rest = moe.experts_out(x, weights, experts, gate[:2], up[:2], down[:2], "gathered", first=0,
                           bias=tuple(b[:2] for b in bias), act=act)
    np.testing.assert_allclose(np.asarray(half + rest), want, atol=2e-4, rtol=1e-5)


def test_the_router_is_transformers_top_k_then_softmax():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    hf = tiny.CONFIGS["gpt_oss"]()
    config = ModelConfig.from_hf_config(hf.to_dict())
    torch.manual_seed(0)
    router = GptOssTopKRouter(hf)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
        router.bias.normal_(0, 1.0)
    h = torch.randn(9, hf.hidden_size)
    logits, scores, indices = router(h)
    weights, experts = moe.route(config, jnp.asarray(logits.detach().numpy()))
    np.testing.assert_array_equal(np.asarray(experts), indices.numpy())
    np.testing.assert_allclose(np.asarray(weights), scores.detach().numpy(), atol=1e-6, rtol=0)
