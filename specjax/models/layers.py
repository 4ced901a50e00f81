"""The pieces a decoder layer is made of: norms, rotary embedding, attention, MLPs.

Families differ here, each in a named piece: `Norm` (LayerNorm, RMSNorm, Gemma's (1 + w)
RMSNorm), the MLP's activation (gelu_new, SiLU, tanh gelu), attention's score scale and
soft-cap (Gemma), q/k norms (Qwen3, Gemma 3), and Gemma's post-norms, which its attention
and MLP apply to their own outputs.

Each weight is declared once, with its shape in the axis letters of DESIGN.md
(E residual width, H query heads, G key/value heads, D head dim, F MLP width). The
modules compute in the parameters' dtype, with norms, softmax and rotary angles in
float32. They know nothing about checkpoints, caches' bookkeeping or decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from specjax.config import ModelConfig, rope_inv_freq
from specjax.quant import Int8

init = nn.initializers.normal(stddev=0.02)


def dequantize(w):
    """A weight as a float array: int8 weights (`specjax.quant.Int8`) are dequantised here,
    on the fly inside the jitted pass; float weights pass through."""
    return w.dequantize() if isinstance(w, Int8) else w


def softcap(x, cap: float):
    """cap * tanh(x / cap): Gemma 2's smooth bound on attention scores and logits."""
    return cap * jnp.tanh(x / cap)


def rms_norm(x, scale, eps: float):
    """Llama's RMSNorm: normalise in float32, cast back, then scale (as transformers does)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
    return scale * y.astype(x.dtype)


def gemma_rms_norm(x, scale, eps: float):
    """Gemma's RMSNorm: scale by (1 + w), all in float32, then cast. Its w starts at 0."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
    return (y * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)


class Norm(nn.Module):
    """The family's norm over the last axis: LayerNorm with bias (GPT-2), RMSNorm (Llama
    family) or Gemma's (1 + w) RMSNorm. `dim` defaults to E (q/k norms use D)."""

    config: ModelConfig
    dim: int | None = None

    @nn.compact
    def __call__(self, x):  # [..., E] (or [..., D])
        c = self.config
        n = self.dim or c.hidden_size
        if c.family == "gemma":
            return gemma_rms_norm(x, self.param("scale", nn.initializers.zeros, (n,)), c.norm_eps)
        scale = self.param("scale", nn.initializers.ones, (n,))
        if c.family == "llama":
            return rms_norm(x, scale, c.norm_eps)
        bias = self.param("bias", nn.initializers.zeros, (n,))
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + c.norm_eps)
        return (y * scale + bias).astype(x.dtype)


def rotary(x, positions, inv_freq):
    """Rotary embedding with split halves (transformers' rotate_half).

    x [B, T, N, D] (N heads), positions int32 [B, T], inv_freq float32 [D/2]."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads over a key/value sequence that the
    caller supplies (fresh keys, or a cache buffer the new keys were written into).

    Gemma's output is normed (its post-attention norm) before the caller adds it to the
    residual stream."""

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
        if c.qk_norm:
            self.q_norm = Norm(c, dim=D)
            self.k_norm = Norm(c, dim=D)
        if c.family == "gemma":
            self.post_norm = Norm(c)

    def project_qkv(self, x, positions, inv_freq=None):
        """x [B, T, E] -> q [B, T, H, D], k [B, T, G, D], v [B, T, G, D] (rotary applied).

        inv_freq float32 [D/2]: this layer's rotary frequencies (default: the full-attention
        layers'; Gemma 3's sliding layers have their own)."""
        c = self.config
        q = jnp.einsum("bte,ehd->bthd", x, dequantize(self.q_kernel))
        k = jnp.einsum("bte,egd->btgd", x, dequantize(self.k_kernel))
        v = jnp.einsum("bte,egd->btgd", x, dequantize(self.v_kernel))
        if c.qkv_bias:
            q, k, v = q + self.q_bias, k + self.k_bias, v + self.v_bias
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if c.family != "gpt2":
            if inv_freq is None:
                inv_freq = jnp.asarray(rope_inv_freq(c), jnp.float32)
            q, k = rotary(q, positions, inv_freq), rotary(k, positions, inv_freq)
        return q, k, v

    def attend(self, q, k, v, mask):
        """q [B, T, H, D], k/v [B, S, G, D], mask bool [B, T, S] -> [B, T, E]."""
        c = self.config
        B, T, H, D = q.shape
        G = c.num_kv_heads
        q = q.reshape(B, T, G, H // G, D)  # [B, T, G, R, D], R query heads per kv head
        scores = jnp.einsum("btgrd,bsgd->bgrts", q, k, preferred_element_type=jnp.float32)
        scores = scores * (c.gemma.query_pre_attn_scalar if c.gemma else D) ** -0.5
        if c.gemma and c.gemma.attn_softcap is not None:
            scores = softcap(scores, c.gemma.attn_softcap)
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bgrts,bsgd->btgrd", probs, v).reshape(B, T, H, D)
        out = jnp.einsum("bthd,hde->bte", out, dequantize(self.o_kernel))
        if c.out_bias:
            out = out + self.o_bias
        return self.post_norm(out) if c.family == "gemma" else out


class MLP(nn.Module):
    """SwiGLU (Llama family), GeGLU with tanh gelu and a post-norm (Gemma), or a gelu_new
    MLP with biases (GPT-2)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x):  # [B, T, E] -> [B, T, E]
        c = self.config
        E, F = c.hidden_size, c.intermediate_size
        zeros = nn.initializers.zeros
        if c.family == "gpt2":
            h = x @ dequantize(self.param("fc_kernel", init, (E, F)))
            h = jax.nn.gelu(h + self.param("fc_bias", zeros, (F,)), approximate=True)  # gelu_new
            out = h @ dequantize(self.param("proj_kernel", init, (F, E)))
            return out + self.param("proj_bias", zeros, (E,))
        gate = x @ dequantize(self.param("gate_kernel", init, (E, F)))
        up = x @ dequantize(self.param("up_kernel", init, (E, F)))
        down = dequantize(self.param("down_kernel", init, (F, E)))
        if c.mlp_bias:
            gate = gate + self.param("gate_bias", zeros, (F,))
            up = up + self.param("up_bias", zeros, (F,))
        act = jax.nn.gelu(gate, approximate=True) if c.family == "gemma" else jax.nn.silu(gate)
        out = (act * up) @ down
        if c.mlp_bias:
            out = out + self.param("down_bias", zeros, (E,))
        return Norm(c, name="post_norm")(out) if c.family == "gemma" else out
