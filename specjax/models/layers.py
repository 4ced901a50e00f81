"""The pieces a decoder layer is made of: norms, rotary embedding, attention's projections,
MLPs (attention itself, and the choice of its kernel, is models/attention.py's).

Families differ here, each in a named piece: `Norm` (LayerNorm, RMSNorm, Gemma's (1 + w)
RMSNorm), the MLP's activation (gelu_new, SiLU, tanh gelu), attention's score scale and
soft-cap (Gemma), q/k norms (Qwen3, Gemma 3, GLM-4.5), a rotary over part of each head
(GLM-4.5: `rotary`), and Gemma's post-norms, which its attention and MLP apply to their own
outputs.

Each weight is declared once, with its shape in the axis letters of DESIGN.md
(E residual width, H query heads, G key/value heads, D head dim, F MLP width). The
modules compute in the parameters' dtype, with norms, softmax and rotary angles in
float32. They know nothing about checkpoints, caches' bookkeeping, decoding, or which
platform runs them (a caller that wants a platform's form says so: `qkv_matmul`'s flat).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from specjax.config import ModelConfig
from specjax.quant import Int8

init = nn.initializers.normal(stddev=0.02)


def dequantize(w):
    """A weight as a float array (int8 weights dequantised; float weights pass through).
    The passes do not use it (see `matmul`); exporting does."""
    return w.dequantize() if isinstance(w, Int8) else w


def matmul(subscripts: str, x, w, out_dtype=None):
    """einsum(subscripts, x, w) for a float or int8 weight w. An int8 weight's values go into
    the matmul as they are (converted to x's dtype inside it, exactly: |value| <= 127) and
    its per-output-channel scale multiplies the output, which equals the matmul with the
    dequantised weight up to rounding, without ever writing a dequantised copy. The output's
    axes hold w's uncontracted axes in any order.
    out_dtype: the output's dtype (the matmul accumulates into it; default x's)."""
    if not isinstance(w, Int8):
        return jnp.einsum(subscripts, x, w, preferred_element_type=out_dtype)
    w_axes, out_axes = subscripts.split("->")[0].split(",")[1], subscripts.split("->")[1]
    kept = [a for a in w_axes if a in out_axes]  # the scale's axes that are not contracted
    scale = w.scale.reshape([n for n, a in zip(w.scale.shape, w_axes) if a in out_axes])  # [kept]
    scale = jnp.transpose(scale, [kept.index(a) for a in out_axes if a in kept])  # in the output's order
    tail = out_axes[min(out_axes.index(a) for a in kept):]  # it broadcasts against these
    scale = jnp.expand_dims(scale, [i for i, a in enumerate(tail) if a not in kept])
    out = jnp.einsum(subscripts, x, w.value.astype(x.dtype), preferred_element_type=out_dtype)
    return out * scale.astype(out.dtype)


def qkv_matmul(x, w, flat: bool = False):
    """x [..., E] times `qkv_kernel` w [G, R+2, D, E] (float or int8) -> [..., G, R+2, D].
    flat: multiply it as a 2-D [G (R+2) D, E] (a reshape of leading axes, free), as a CPU
    program should: XLA's CPU dot transposes a 4-D weight whose contracted axis is last on
    every pass. A TPU or GPU program reads it as it lies (there the reshape would count as a
    copy in cost analyses)."""
    rows = x.reshape(-1, x.shape[-1])  # [N, E]
    if flat:
        flat = jax.tree.map(lambda a: a.reshape(-1, a.shape[-1]), w)  # [G (R+2) D, E]
        out = matmul("ne,me->nm", rows, flat)
    else:
        out = matmul("ne,grde->ngrd", rows, w)
    return out.reshape(*x.shape[:-1], *w.shape[:3])


def gate_up_matmul(x, w):
    """x [..., E] times `gate_up_kernel` w [2, E, F] (float or int8) -> [2, ..., F] (gate,
    then up): the pair a batch axis of one matmul, so that every backend reads w as it lies."""
    rows = x.reshape(-1, x.shape[-1])  # [N, E]
    out = matmul("ine,ief->inf", jnp.broadcast_to(rows, (2, *rows.shape)), w)
    return out.reshape(2, *x.shape[:-1], out.shape[-1])


def heads_out(out, w):
    """Per-head outputs [B, T, H, D] times an output projection w [H, D, E] (float or int8)
    -> [B, T, E], as one [H D, E] matmul (a free reshape of the weight): contracted over
    (h, d) as two axes, XLA transposed the whole weight on every pass to match the
    activations' layout, on a CPU, and on a GPU behind cuDNN's head-major output
    (docs/bench/gpu_compiled.txt); flat, only the activations can move."""
    B, T, H, D = out.shape
    w = (Int8(w.value.reshape(H * D, -1), w.scale.reshape(1, -1)) if isinstance(w, Int8)
         else w.reshape(H * D, -1))
    return matmul("btk,ke->bte", out.reshape(B, T, H * D), w)


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
        if c.model_type == "gpt_oss":  # its norms scale in float32, then cast (transformers' GptOssRMSNorm)
            x32 = x.astype(jnp.float32)
            y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + c.norm_eps)
            return (scale.astype(jnp.float32) * y).astype(x.dtype)
        if c.family == "llama":
            return rms_norm(x, scale, c.norm_eps)
        bias = self.param("bias", nn.initializers.zeros, (n,))
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + c.norm_eps)
        return (y * scale + bias).astype(x.dtype)


def rotary_angles(positions, inv_freq, factor: float = 1.0):
    """(cos, sin) float32 [B, T, 1, D'] of the rotary angles at positions int32 [B, T] for
    inverse frequencies float32 [D'/2] (D' the lanes rotated: `ModelConfig.rotary_dim`, D but
    for a partial rotary), both multiplied by factor (YaRN's attention factor:
    `RopeScaling.cos_sin_factor`): computed once per pass and shared by its layers."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D'/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D']
    if factor == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def rotary(x, cos_sin):
    """Rotary embedding with split halves (transformers' rotate_half).

    x [B, T, N, D] (N heads), cos_sin: `rotary_angles` of its positions, [B, T, 1, D'] each.
    A partial rotary (D' < D, GLM-4.5's) rotates the first D' lanes, its halves split within
    them, and passes the other D - D' through unchanged (transformers' apply_rotary_pos_emb
    with rotary_dim = cos.shape[-1])."""
    cos, sin = cos_sin
    d = cos.shape[-1]
    part = x[..., :d].astype(jnp.float32)
    x1, x2 = jnp.split(part, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = (part * cos + rotated * sin).astype(x.dtype)
    return out if d == x.shape[-1] else jnp.concatenate([out, x[..., d:]], axis=-1)


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads over a key/value sequence that the
    caller supplies (fresh keys, or a cache buffer the new keys were written into).

    q, k and v are one matmul: `qkv_kernel` [G, R+2, D, E] holds, for each kv head g, its
    R = H/G query heads, then its key head, then its value head (query head h = g R + r
    reads kv head g, as in transformers). Split over kv heads, a device holds whole groups.
    E is last, as in a Linear's [out, in] weight: a TPU tiles (D, E), where [E, G, R+2, D]
    padded R+2 and made XLA keep a relaid copy of every layer's kernel through a speculative
    loop (`qkv_matmul` says how each platform multiplies it).

    Gemma's output is normed (its post-attention norm) before the caller adds it to the
    residual stream."""

    config: ModelConfig
    in_size: int | None = None  # the width q, k and v are projected from (None: E; a published EAGLE-3 layer's 2E)

    def setup(self):
        c = self.config
        E, H, G, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.qkv_kernel = self.param("qkv_kernel", init, (G, H // G + 2, D, self.in_size or E))
        self.o_kernel = self.param("o_kernel", init, (H, D, E))
        if c.qkv_bias:
            self.qkv_bias = self.param("qkv_bias", nn.initializers.zeros, (G, H // G + 2, D))
        if c.out_bias:
            self.o_bias = self.param("o_bias", nn.initializers.zeros, (E,))
        if c.attn_sinks:  # gpt-oss: one logit per query head in its queries' softmax (attention.py)
            self.sinks = self.param("sinks", nn.initializers.zeros, (H,))
        if c.qk_norm:
            self.q_norm = Norm(c, dim=D)
            self.k_norm = Norm(c, dim=D)
        if c.family == "gemma":
            self.post_norm = Norm(c)

    def project_qkv(self, x, cos_sin=None, flat: bool = False):
        """x [B, T, E] (or in_size) -> q [B, T, H, D], k [B, T, G, D], v [B, T, G, D] (rotary applied
        with cos_sin, this layer's `rotary_angles`; None for GPT-2). flat: `qkv_matmul`'s
        (a CPU program's form)."""
        c = self.config
        B, T, _ = x.shape
        R = c.num_heads // c.num_kv_heads
        qkv = qkv_matmul(x, self.qkv_kernel, flat)  # [B, T, G, R+2, D]
        if c.qkv_bias:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv[:, :, :, :R].reshape(B, T, c.num_heads, c.head_dim), qkv[:, :, :, R], qkv[:, :, :, R + 1]
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos_sin is not None:
            q, k = rotary(q, cos_sin), rotary(k, cos_sin)
        return q, k, v

    @property
    def scale(self) -> float:
        c = self.config
        return (c.gemma.query_pre_attn_scalar if c.gemma else c.head_dim) ** -0.5

    @property
    def cap(self) -> float | None:
        return self.config.gemma.attn_softcap if self.config.gemma else None

    def sink_logits(self):
        """The attention sinks [H] (ModelConfig.attn_sinks), or None: what attention's `sinks` takes."""
        return self.sinks if self.config.attn_sinks else None

    def project_out(self, out):
        """Attention's per-head output [B, T, H, D] -> [B, T, E] (Gemma's normed)."""
        c = self.config
        out = heads_out(out, self.o_kernel)
        if c.out_bias:
            out = out + self.o_bias
        return self.post_norm(out) if c.family == "gemma" else out



class MLP(nn.Module):
    """SwiGLU (Llama family), GeGLU with tanh gelu and a post-norm (Gemma), or a gelu_new
    MLP with biases (GPT-2). Gate and up are one matmul: `gate_up_kernel` [2, E, F], the pair
    a batch axis of the matmul (a TPU tiles (E, F), where [E, 2, F] padded the 2 and made XLA
    keep a relaid copy through a speculative loop; XLA's CPU backend multiplies it as it lies)."""

    config: ModelConfig
    width: int | None = None  # F (None: the config's intermediate_size; a MoE's shared expert's own)

    @nn.compact
    def __call__(self, x):  # [B, T, E] -> [B, T, E]
        c = self.config
        E, F = c.hidden_size, self.width or c.intermediate_size
        zeros = nn.initializers.zeros
        if c.family == "gpt2":
            h = matmul("bte,ef->btf", x, self.param("fc_kernel", init, (E, F)))
            h = jax.nn.gelu(h + self.param("fc_bias", zeros, (F,)), approximate=True)  # gelu_new
            out = matmul("btf,fe->bte", h, self.param("proj_kernel", init, (F, E)))
            return out + self.param("proj_bias", zeros, (E,))
        gate_up = gate_up_matmul(x, self.param("gate_up_kernel", init, (2, E, F)))  # [2, B, T, F]
        if c.mlp_bias:
            gate_up = gate_up + self.param("gate_up_bias", zeros, (2, F))[:, None, None]
        gate, up = gate_up[0], gate_up[1]
        act = jax.nn.gelu(gate, approximate=True) if c.family == "gemma" else jax.nn.silu(gate)
        out = matmul("btf,fe->bte", act * up, self.param("down_kernel", init, (F, E)))
        if c.mlp_bias:
            out = out + self.param("down_bias", zeros, (E,))
        return Norm(c, name="post_norm")(out) if c.family == "gemma" else out
