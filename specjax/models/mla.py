"""Multi-head latent attention (DeepSeek-V2/V3), in its absorbed form: every head attends to
one shared latent per token, never to keys and values of its own.

A token's keys and values are compressed into a latent c_kv [r] (kv_a_proj_with_mqa, then
an RMSNorm) and one rotary key k_rope [rope] shared by every head; head h's key would be
[W_UK[h] c_kv ; k_rope] and its value W_UV[h] c_kv (kv_b_proj's two halves). Instead of
expanding them, each head's query is absorbed into the latent's space:

    q_lat[h] = W_UK[h]^T q_nope[h]                     [H, r]
    score[h, s] = q_lat[h] . c_kv[s] + q_rope[h] . k_rope[s]   (= q[h] . key[h, s])
    out[h] = W_UV[h] (softmax(score[h]) . c_kv)        [H, v]

So attention is multi-query attention with one key head (G = 1) whose key is the latent
and the rotary key, [c_kv ; k_rope] (D_k = r + rope), and whose value is that same key:
the attention's output [H, r + rope] keeps its first r lanes (the softmax's average of
c_kv) for W_UV, the rope lanes' average being dropped. A cache holds each token's key
once, r + rope numbers a layer (576 for DeepSeek-V3, against 128 heads x 256 expanded),
and no value buffer at all: its value buffers have zero width, which cache.py and every
attention path read as "the values are the keys" (attention.py). Every pass (a full pass,
a prefill, a step, a tree) computes the absorbed form, so that a cached pass computes
what a full one does.

The queries' rotary lanes: with `rope_interleave` (DeepSeek's checkpoints) the rotary
pairs lie interleaved (x0, x1), (x2, x3), ...; they are de-interleaved before the rotation
(split halves), which is what transformers' apply_rotary_pos_emb_interleave computes, lane
for lane. Queries and keys are permuted alike, so scores are unchanged.

It knows the weights' shapes and the arithmetic; nothing of caches, masks or kernels
(no fused attention kernel takes D_k != D_v: the model's passes stay portable,
transformer.decode), nor of yarn rope (refused by config.py for now).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from specjax.config import ModelConfig
from specjax.models.layers import Norm, heads_out, init, matmul, rotary


def deinterleave(x):
    """[..., 2n] lanes (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class LatentAttention(nn.Module):
    """Latent attention's projections, with `layers.Attention`'s interface (project_qkv,
    scale, cap, project_out), so that a decoder layer attends through any of attention.py's
    paths: its "q" is the absorbed query [B, T, H, r + rope], its "k" the latent key
    [B, T, 1, r + rope], its "v" zero-width [B, T, 1, 0] (the values are the keys).

    Weights (E width, H heads, Q q_lora_rank, r kv_lora_rank, n nope, p rope, v v_head_dim):
    q_kernel [E, H, n + p] (q_lora_rank None), or q_a_kernel [E, Q], q_a_norm, q_b_kernel
    [Q, H, n + p]; kv_a_kernel [E, r + p], kv_a_norm over r; k_b_kernel [H, n, r] and
    v_b_kernel [H, v, r] (kv_b_proj's key and value halves, each head's [out, r] rows);
    o_kernel [H, v, E]."""

    config: ModelConfig

    def setup(self):
        c = self.config
        m = c.mla
        E, H, r = c.hidden_size, c.num_heads, m.kv_lora_rank
        if m.q_lora_rank is None:
            self.q_kernel = self.param("q_kernel", init, (E, H, m.qk_head_dim))
        else:
            self.q_a_kernel = self.param("q_a_kernel", init, (E, m.q_lora_rank))
            self.q_a_norm = Norm(c, dim=m.q_lora_rank)
            self.q_b_kernel = self.param("q_b_kernel", init, (m.q_lora_rank, H, m.qk_head_dim))
        self.kv_a_kernel = self.param("kv_a_kernel", init, (E, m.latent_dim))
        self.kv_a_norm = Norm(c, dim=r)
        self.k_b_kernel = self.param("k_b_kernel", init, (H, m.qk_nope_head_dim, r))
        self.v_b_kernel = self.param("v_b_kernel", init, (H, m.v_head_dim, r))
        self.o_kernel = self.param("o_kernel", init, (H, m.v_head_dim, E))

    def project_qkv(self, x, cos_sin=None, flat: bool = False):
        """x [B, T, E] -> the absorbed query [B, T, H, r + rope], the latent key [B, T, 1, r + rope]
        and a zero-width value [B, T, 1, 0] (rotary applied with cos_sin, `rotary_angles` over
        the rope lanes). flat: unused (Attention's CPU form of its fused q/k/v matmul)."""
        m = self.config.mla
        B, T, _ = x.shape
        if m.q_lora_rank is None:
            q = matmul("bte,ehd->bthd", x, self.q_kernel)  # [B, T, H, n + p]
        else:
            q = matmul("btq,qhd->bthd", self.q_a_norm(matmul("bte,eq->btq", x, self.q_a_kernel)), self.q_b_kernel)
        q_nope, q_rope = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        latent = matmul("bte,ek->btk", x, self.kv_a_kernel)  # [B, T, r + p]
        c_kv, k_rope = self.kv_a_norm(latent[..., :m.kv_lora_rank]), latent[:, :, None, m.kv_lora_rank:]
        if m.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        if cos_sin is not None:
            q_rope, k_rope = rotary(q_rope, cos_sin), rotary(k_rope, cos_sin)
        q_lat = matmul("bthn,hnr->bthr", q_nope, self.k_b_kernel)  # [B, T, H, r]: W_UK[h]^T q_nope[h]
        key = jnp.concatenate([c_kv[:, :, None], k_rope.astype(c_kv.dtype)], axis=-1)  # [B, T, 1, r + p]
        return (jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1), key,
                jnp.zeros((B, T, 1, 0), key.dtype))

    def sink_logits(self):
        """None: latent attention has no attention sinks (`layers.Attention.sink_logits`)."""
        return None

    @property
    def scale(self) -> float:
        """qk_head_dim ** -0.5, times yarn's mscale squared where the rope says (as
        transformers' DeepSeek-V3 does: `RopeScaling.attention_scale`)."""
        return self.config.mla.qk_head_dim ** -0.5 * self.config.rope_scaling.attention_scale()

    @property
    def cap(self) -> None:
        return None

    def project_out(self, out):
        """The attention's output over the latent keys [B, T, H, r + rope] -> [B, T, E]: its
        latent lanes through each head's W_UV, then o_proj."""
        c = self.config
        heads = matmul("bthr,hvr->bthv", out[..., :c.mla.kv_lora_rank], self.v_b_kernel)  # [B, T, H, v]
        return heads_out(heads, self.o_kernel)
