"""The pieces a decoder layer is made of: norms, rotary embedding, attention, MLPs.

Each weight is declared once, with its shape in the axis letters of DESIGN.md
(E residual width, H query heads, G key/value heads, D head dim, F MLP width). The
modules compute in the parameters' dtype, with norms, softmax and rotary angles in
float32. They know nothing about checkpoints, caches' bookkeeping or decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from specjax.config import ModelConfig, rope_inv_freq

init = nn.initializers.normal(stddev=0.02)


class Norm(nn.Module):
    """LayerNorm with bias (GPT-2) or RMSNorm (Llama family), computed in float32."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x):  # [B, T, E]
        E = self.config.hidden_size
        scale = self.param("scale", nn.initializers.ones, (E,))
        x32 = x.astype(jnp.float32)
        if self.config.family == "gpt2":
            bias = self.param("bias", nn.initializers.zeros, (E,))
            mean = x32.mean(-1, keepdims=True)
            var = jnp.square(x32 - mean).mean(-1, keepdims=True)
            y = (x32 - mean) * jax.lax.rsqrt(var + self.config.norm_eps)
            return (y * scale + bias).astype(x.dtype)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.config.norm_eps)
        return scale * y.astype(x.dtype)  # HF casts back before scaling


def rotary(x, positions, config: ModelConfig):
    """Rotary embedding with split halves (transformers' rotate_half).

    x [B, T, N, D] (N heads), positions int32 [B, T]."""
    inv_freq = jnp.asarray(rope_inv_freq(config), jnp.float32)  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads over a key/value sequence that the
    caller supplies (fresh keys, or a cache buffer the new keys were written into)."""

    config: ModelConfig

    def setup(self):
        c = self.config
        E, H, G, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.q_kernel = self.param("q_kernel", init, (E, H, D))
        self.k_kernel = self.param("k_kernel", init, (E, G, D))
        self.v_kernel = self.param("v_kernel", init, (E, G, D))
        self.o_kernel = self.param("o_kernel", init, (H, D, E))
        if c.qkv_bias:
            self.q_bias = self.param("q_bias", nn.initializers.zeros, (H, D))
            self.k_bias = self.param("k_bias", nn.initializers.zeros, (G, D))
            self.v_bias = self.param("v_bias", nn.initializers.zeros, (G, D))
        if c.out_bias:
            self.o_bias = self.param("o_bias", nn.initializers.zeros, (E,))

    def project_qkv(self, x, positions):
        """x [B, T, E] -> q [B, T, H, D], k [B, T, G, D], v [B, T, G, D] (rotary applied)."""
        c = self.config
        q = jnp.einsum("bte,ehd->bthd", x, self.q_kernel)
        k = jnp.einsum("bte,egd->btgd", x, self.k_kernel)
        v = jnp.einsum("bte,egd->btgd", x, self.v_kernel)
        if c.qkv_bias:
            q, k, v = q + self.q_bias, k + self.k_bias, v + self.v_bias
        if c.family == "llama":
            q, k = rotary(q, positions, c), rotary(k, positions, c)
        return q, k, v

    def attend(self, q, k, v, mask):
        """q [B, T, H, D], k/v [B, S, G, D], mask bool [B, T, S] -> [B, T, E]."""
        c = self.config
        B, T, H, D = q.shape
        G = c.num_kv_heads
        q = q.reshape(B, T, G, H // G, D)  # [B, T, G, R, D], R query heads per kv head
        scores = jnp.einsum("btgrd,bsgd->bgrts", q, k, preferred_element_type=jnp.float32)
        scores = scores / np.sqrt(D)
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bgrts,bsgd->btgrd", probs, v).reshape(B, T, H, D)
        out = jnp.einsum("bthd,hde->bte", out, self.o_kernel)
        return out + self.o_bias if c.out_bias else out


class MLP(nn.Module):
    """SwiGLU (Llama family) or a gelu_new MLP with biases (GPT-2)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x):  # [B, T, E] -> [B, T, E]
        c = self.config
        E, F = c.hidden_size, c.intermediate_size
        zeros = nn.initializers.zeros
        if c.family == "gpt2":
            h = x @ self.param("fc_kernel", init, (E, F)) + self.param("fc_bias", zeros, (F,))
            h = jax.nn.gelu(h, approximate=True)  # gelu_new
            return h @ self.param("proj_kernel", init, (F, E)) + self.param("proj_bias", zeros, (E,))
        gate = x @ self.param("gate_kernel", init, (E, F))
        up = x @ self.param("up_kernel", init, (E, F))
        down = self.param("down_kernel", init, (F, E))
        if c.mlp_bias:
            gate = gate + self.param("gate_bias", zeros, (F,))
            up = up + self.param("up_bias", zeros, (F,))
        out = (jax.nn.silu(gate) * up) @ down
        return out + self.param("down_bias", zeros, (E,)) if c.mlp_bias else out
