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

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import Mesh, PartitionSpec

from specjax import sharding
from specjax.config import ModelConfig
from specjax.models import prefix_kernel
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


def qkv_matmul(x, w):
    """x [..., E] times `qkv_kernel` w [G, R+2, D, E] (float or int8) -> [..., G, R+2, D].
    A CPU program multiplies it as a 2-D [G (R+2) D, E] (a reshape of leading axes, free):
    XLA's CPU dot transposes a 4-D weight whose contracted axis is last on every pass. A TPU
    or GPU program reads it as it lies (the reshape would count as a copy in cost analyses).
    The platform is the one being traced for (`target_platform`)."""
    rows = x.reshape(-1, x.shape[-1])  # [N, E]
    if target_platform() == "cpu":
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


def rotary_angles(positions, inv_freq):
    """(cos, sin) float32 [B, T, 1, D] of the rotary angles at positions int32 [B, T] for
    inverse frequencies float32 [D/2]: computed once per pass and shared by its layers."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    return jnp.cos(angles), jnp.sin(angles)


def rotary(x, cos_sin):
    """Rotary embedding with split halves (transformers' rotate_half).

    x [B, T, N, D] (N heads), cos_sin: `rotary_angles` of its positions."""
    cos, sin = cos_sin
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads over a key/value sequence that the
    caller supplies (fresh keys, or a cache buffer the new keys were written into).

    q, k and v are one matmul: `qkv_kernel` [G, R+2, D, E] holds, for each kv head g, its
    R = H/G query heads, then its key head, then its value head (query head h = g R + r
    reads kv head g, as in transformers). Split over kv heads, a device holds whole groups.
    E is last, as in a Linear's [out, in] weight: a TPU tiles (D, E), where [E, G, R+2, D]
    padded R+2 and made XLA keep a relaid copy of every layer's kernel through a speculative
    loop (`qkv_matmul` says how each backend multiplies it).

    Gemma's output is normed (its post-attention norm) before the caller adds it to the
    residual stream."""

    config: ModelConfig

    def setup(self):
        c = self.config
        E, H, G, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.qkv_kernel = self.param("qkv_kernel", init, (G, H // G + 2, D, E))
        self.o_kernel = self.param("o_kernel", init, (H, D, E))
        if c.qkv_bias:
            self.qkv_bias = self.param("qkv_bias", nn.initializers.zeros, (G, H // G + 2, D))
        if c.out_bias:
            self.o_bias = self.param("o_bias", nn.initializers.zeros, (E,))
        if c.qk_norm:
            self.q_norm = Norm(c, dim=D)
            self.k_norm = Norm(c, dim=D)
        if c.family == "gemma":
            self.post_norm = Norm(c)

    def project_qkv(self, x, cos_sin=None):
        """x [B, T, E] -> q [B, T, H, D], k [B, T, G, D], v [B, T, G, D] (rotary applied
        with cos_sin, this layer's `rotary_angles`; None for GPT-2)."""
        c = self.config
        B, T, _ = x.shape
        R = c.num_heads // c.num_kv_heads
        qkv = qkv_matmul(x, self.qkv_kernel)  # [B, T, G, R+2, D]
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

    def project_out(self, out):
        """Attention's per-head output [B, T, H, D] -> [B, T, E] (Gemma's normed)."""
        c = self.config
        B, T, H, D = out.shape
        w = self.o_kernel
        # One [H D, E] matmul (a free reshape of the weight): contracted over (h, d) as two axes,
        # XLA transposed the whole weight on every pass to match the activations' layout, on
        # a CPU, and on a GPU behind cuDNN's head-major output (docs/bench/gpu_compiled.txt);
        # flat, only the activations can move.
        w = (Int8(w.value.reshape(H * D, -1), w.scale.reshape(1, -1)) if isinstance(w, Int8)
             else w.reshape(H * D, -1))
        out = matmul("btk,ke->bte", out.reshape(B, T, H * D), w)
        if c.out_bias:
            out = out + self.o_bias
        return self.post_norm(out) if c.family == "gemma" else out


# Passes over more key slots than this attend blockwise, one key block of this many slots
# at a time; shorter ones (the tests' models, decode steps of short contexts) take the
# dense path. A module constant so that tests can shrink it.
ATTENTION_BLOCK = 512
# A GPU's portable cached pass attends over its whole cache in one softmax where its
# float32 scores are at most this share of a layer's cache bytes (`_whole_cache_on_gpu`):
# a decode or verification pass (with head_dim 128 and 4 query heads per kv head, up to 8 tokens).
GPU_SCORES_OVER_CACHE = 0.25
# A CPU visits a long cache's prefix in blocks of this many slots: rows shorter than the
# cache then read less of it, for a few more loop trips (the engine's 8 slots of 1,024 on
# a 2-core CPU, 8 clients: 954-1,006 output tokens/s with 512, 1,148-1,263 with 256;
# docs/bench/engine_clients.py). Measured only on CPU; other platforms visit
# ATTENTION_BLOCK slots at a time.
CPU_PREFIX_BLOCK = 256
_NEG = float(jnp.finfo(jnp.float32).min)


def attention(q, k, v, mask, scale: float, cap: float | None = None, kv_limit=None, block: int | None = None,
              kernels: bool = False, heads_first: bool = False):
    """Softmax attention with grouped key/value heads: q [B, T, H, D], k/v [B, S, G, D] (a
    pass's own keys; heads_first: [B, G, S, D], a cache's layout), mask bool [B, T, S]
    (True: the query sees the slot) -> [B, T, H, D] in v's dtype.
    Scores are float32 and scaled by `scale`, then soft-capped by `cap` if given (Gemma 2).

    Up to `block` (default ATTENTION_BLOCK) key slots, the scores [B, H, T, S] are
    materialised (the reference computation). Beyond, keys are visited in blocks of `block`
    slots with an online softmax (running max and sum, float32), so no more than
    [B, H, T, block] scores live at once; results agree with the dense path to float32
    rounding, and reverse-mode autodiff differentiates it (a fixed-length loop). kv_limit
    (int32 [B], or None): each row's live key length, which only a kernel reads (the mask
    already hides what lies past it). A query that sees no slot at all gets zeros (the
    dense path's output for it, a uniform average, is equally meaningless).

    With kernels=True (`takes_kernels` of the model's Model.attention), where an accelerator kernel
    applies (`attention_kernel`: cuDNN on GPU, Pallas splash attention on TPU) it computes
    the same thing instead; this jnp code is the default and the fallback. A cached pass
    attends by `cached_attention` unless a kernel takes it.

    It knows nothing about caches or positions: what is visible is the mask's business."""
    B, T, H, D = q.shape
    G, S = (k.shape[1], k.shape[2]) if heads_first else (k.shape[2], k.shape[1])
    kernel = attention_kernel(kernel_platform(), q.dtype, T, S, D, cap) if kernels else "portable"
    if kernel == "cudnn":
        return dot_product_attention(q, k, v, mask, scale, kv_limit, heads_first=heads_first)
    if not heads_first:
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, G, S, D], as the rest reads keys
    if kernel == "splash":
        return splash_attention(q, k, v, mask, scale, cap)
    block = block or ATTENTION_BLOCK
    qg = q.reshape(B, T, G, H // G, D)  # [B, T, G, R, D], R query heads per kv head
    if S <= block:
        scores = jnp.where(mask[:, None, None], _scores(qg, k, scale, cap), _NEG)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return jnp.einsum("bgrts,bgsd->btgrd", probs, v).reshape(B, T, H, D)
    return _normalise(_masked_state(qg, k, v, mask, _empty_state(qg), scale, cap, block), v.dtype)


def cached_attention(q, k, v, mask, cache_k, cache_v, prefix, floor=None, scale: float = 1.0,
                     cap: float | None = None, block: int | None = None, kernels: bool = False,
                     interpret: bool = False, rules=None):
    """Attention of a cached pass, over two key sets merged by their log-sum-exp (one online
    softmax): the committed prefix, read in place from the cache, and the pass's in-flight
    keys, under their own mask. No [B, T, S] mask is built, nor any key copied but the
    in-flight ones.

    q [B, T, H, D]; k/v [B, N, G, D]: the in-flight keys (the pass's own, or a tree's region),
    mask bool [B, T, N]; cache_k/cache_v [B', G, S, D]: the layer's cache, whose first B rows
    are the pass's (B' >= B: see cache.py); prefix int32 [B]:
    every query of row b sees the cache's slots < prefix[b], and, with floor (int32 [B, T]: a
    sliding window's), only those above floor[b, t]. -> [B, T, H, D] in v's dtype.

    Up to `block` slots of cache (and of in-flight keys) the scores are materialised in one
    softmax, and so over any cache on a GPU for a pass of few queries (`_whole_cache_on_gpu`);
    beyond, the in-flight keys are visited first, then the prefix in blocks of `block`
    slots (a CPU's: at most CPU_PREFIX_BLOCK) from the block of the lowest sliding-window floor
    up to the longest row's prefix: blocks outside are not read (traced for a GPU,
    where a loop's data-dependent predicate would wait on the host, the loop is fixed-length
    and re-reads the last live block instead, masked).

    kernels=True (`takes_kernels` of the model's Model.attention): traced for a GPU or a TPU, where it
    applies (`_prefix_kernel`), the prefix goes through that platform's Pallas kernel
    (per-row lengths, read in place; in a sharded program under `shard_map`, by the model's
    `rules`); interpret=True runs it in Pallas' interpreter, on any backend (the tests').

    It knows nothing about positions: what the in-flight keys see is the mask's business."""
    B, T, H, D = q.shape
    G, S, N = cache_k.shape[1], cache_k.shape[2], k.shape[1]
    block = block or ATTENTION_BLOCK
    qg = q.reshape(B, T, G, H // G, D)  # [B, T, G, R, D]
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, G, N, D], as the cache lies
    kernel = _prefix_kernel(B, cache_k.shape, rules, scale, cap, interpret) if kernels else None
    one_softmax = kernel is None and N <= block and (S <= block or _whole_cache_on_gpu(T * (H // G), D))

    def prefix_seen(start, n):  # bool [B, T or 1, n]: which of cache slots start .. start+n-1 each query sees
        slots = start + jnp.arange(n)
        seen = slots[None, None, :] < prefix[:, None, None]
        return seen if floor is None else seen & (slots[None, None, :] > floor[:, :, None])

    if one_softmax:  # over both key sets, without joining them
        cache_k, cache_v = cache_k[:B], cache_v[:B]
        seen = (prefix_seen(0, S)[:, None, None], mask[:, None, None])  # [B, 1, 1, T or 1, S], [.., T, N]
        scores = [jnp.where(m, _scores(qg, keys, scale, cap), _NEG) for m, keys in zip(seen, (cache_k, k))]
        top = jnp.maximum(scores[0].max(axis=-1), scores[1].max(axis=-1, initial=_NEG))[..., None]  # [B, G, R, T, 1]
        p = [jnp.where(m, jnp.exp(s - top), 0.0) for m, s in zip(seen, scores)]
        total = p[0].sum(axis=-1) + p[1].sum(axis=-1)  # [B, G, R, T]
        out = sum(jnp.einsum("bgrts,bgsd->bgrtd", pi.astype(vi.dtype), vi, preferred_element_type=jnp.float32)
                  for pi, vi in zip(p, (cache_v, v)))
        return _normalise((None, total, out), v.dtype)
    if kernel is not None:  # the in-flight keys, then the prefix's state from the kernel, merged
        state = _masked_state(qg, k, v, mask, _empty_state(qg), scale, cap, block)
        return _normalise(_merge(state, kernel(qg, cache_k, cache_v, prefix, floor)), v.dtype)
    # Block by block (a pass of many queries: a prefill chunk), on a GPU with the queries laid
    # out [B, G, R, T, D]: the first matmul's scores then come out [B, G, R, T, n], as the
    # second reads them; from [B, T, G, R, D] queries XLA transposes every float32 score block
    # between the two (an H100's prefill of the 8B shape: docs/bench/gpu_compiled.txt). A TPU's
    # chain loop held more with them so (53.0 -> 58.0 MB, docs/bench/aot.py), and a GPU's pass of
    # few queries, in one softmax, had the cache's keys transposed for it at batch 1.
    layout = "bgrtd" if target_platform() == "gpu" else "btgrd"
    qg = qg.transpose(0, 2, 3, 1, 4) if layout == "bgrtd" else qg
    state = _masked_state(qg, k, v, mask, _empty_state(qg, layout), scale, cap, block, layout)  # in-flight keys first
    if target_platform() == "cpu":
        block = min(block, CPU_PREFIX_BLOCK)
    upto = jnp.clip((jnp.max(prefix) + block - 1) // block, 0, -(-S // block))
    # A sliding window: blocks wholly below every query's floor are not read.
    first = None if floor is None else jnp.clip((jnp.min(floor) + 1) // block, 0, upto)
    state = _visit_blocks(qg, cache_k, cache_v, prefix_seen, state, scale, cap, block, upto, first, layout)
    return _normalise(state, v.dtype)


def _whole_cache_on_gpu(rows: int, head_dim: int) -> bool:
    """Whether a GPU's portable cached pass with `rows` queries per kv head (T R) attends over
    the whole cache in one softmax rather than block by block. A block loop's dynamic slices
    of K and V are written out before the matmuls read them (XLA's GPU gemms read whole
    buffers): three reads of the cache. One softmax's matmuls read it in place, and its
    float32 scores [B, G, R, T, S] hold rows / head_dim of a layer's cache bytes (compiled
    for an H100, batch 8 over 8K, 8B shape: docs/bench/gpu_compiled.txt)."""
    return target_platform() == "gpu" and rows <= GPU_SCORES_OVER_CACHE * head_dim


def _scores(qg, kb, scale: float, cap: float | None, layout: str = "btgrd"):
    """float32 scores [B, G, R, T, n] of queries qg ([B, T, G, R, D], or as `layout` names
    its axes) against keys kb [B, G, n, D]."""
    s = jnp.einsum(f"{layout},bgsd->bgrts", qg, kb, preferred_element_type=jnp.float32) * scale
    return s if cap is None else softcap(s, cap)


def _empty_state(qg, layout: str = "btgrd"):
    """The online softmax's running (max, sum, output) before any key, of queries qg (laid
    out as `layout` names): [B, G, R, T] twice, [B, G, R, T, D], float32."""
    B, T, G, R, D = (dict(zip(layout, qg.shape))[axis] for axis in "btgrd")
    return (jnp.full((B, G, R, T), _NEG, jnp.float32), jnp.zeros((B, G, R, T), jnp.float32),
            jnp.zeros((B, G, R, T, D), jnp.float32))


def _accumulate(state, s, seen, vb):
    """The online softmax's state after n more keys: scores s [B, G, R, T, n] (masked), seen
    bool (broadcasting to s), their values vb [B, G, n, D]."""
    m, l, acc = state
    m_new = jnp.maximum(m, s.max(axis=-1, initial=_NEG))  # (n may be 0: a pass that sees no in-flight key)
    p = jnp.where(seen, jnp.exp(s - m_new[..., None]), 0.0)  # [B, G, R, T, n]
    correction = jnp.exp(m - m_new)
    pv = jnp.einsum("bgrts,bgsd->bgrtd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
    return m_new, l * correction + p.sum(axis=-1), acc * correction[..., None] + pv


def _visit_blocks(qg, k, v, seen_of, state, scale: float, cap: float | None, block: int, upto=None, first=None,
                  layout: str = "btgrd"):
    """The online softmax's state after the keys k/v [B', G, S, D] (rows [:B] read, B the
    queries' rows), visited `block` slots at a time; seen_of(start, n) -> bool [B, T or 1,
    n]: what each query sees of slots start .. start+n-1. upto: None (every block, a
    fixed-length loop), or a traced count of blocks to visit (see `cached_attention` for a
    GPU's); first: None, or the traced index of the first
    block to visit (those before it hold no key any query sees); layout: qg's (`_scores`)."""
    B, S = qg.shape[0], k.shape[2]
    num_blocks = -(-S // block)

    def visit(i, state, live=True):
        # The last block is slid back to fit inside S (no padded copy of k/v); the slots it
        # shares with the previous block are masked out so that none is counted twice.
        start = jnp.minimum(i * block, S - block)
        at, size = (0, 0, start, 0), (B, k.shape[1], block, k.shape[3])
        kb = jax.lax.dynamic_slice(k, at, size)  # [B, G, block, D]
        vb = jax.lax.dynamic_slice(v, at, size)
        seen = seen_of(start, block) & (start + jnp.arange(block) >= i * block) & live
        seen = seen[:, None, None]  # [B, 1, 1, T or 1, block]
        return _accumulate(state, jnp.where(seen, _scores(qg, kb, scale, cap, layout), _NEG), seen, vb)

    if upto is None:
        return jax.lax.fori_loop(0, num_blocks, visit, state)
    if target_platform() == "gpu":
        # A GPU reads a data-dependent loop's predicate back on the host, every pass: the
        # loop visits every block, those past the longest row as its last live block again,
        # all masked (their flops are the price; whether the re-read stays in L2 is not
        # measured yet). TPU and CPU test the predicate where they compute.
        last, first = jnp.maximum(upto - 1, 0), 0 if first is None else first
        return jax.lax.fori_loop(0, num_blocks, lambda i, c: visit(jnp.minimum(first + i, last), c, first + i < upto),
                                 state)
    return jax.lax.fori_loop(0 if first is None else first, upto, visit, state)


def _masked_state(qg, k, v, mask, state, scale: float, cap: float | None, block: int, layout: str = "btgrd"):
    """The online softmax's state after the keys k/v [B, G, N, D] under mask bool [B, T, N]:
    in one step up to `block` keys, else `block` at a time (a fixed-length loop). layout:
    qg's (`_scores`)."""
    if k.shape[2] <= block:
        seen = mask[:, None, None]
        return _accumulate(state, jnp.where(seen, _scores(qg, k, scale, cap, layout), _NEG), seen, v)
    return _visit_blocks(qg, k, v, lambda start, n: jax.lax.dynamic_slice_in_dim(mask, start, n, axis=2), state,
                         scale, cap, block, layout=layout)


def _merge(a, b):
    """One online softmax state from two over disjoint keys (by their log-sum-exp)."""
    m = jnp.maximum(a[0], b[0])
    wa, wb = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
    return m, a[1] * wa + b[1] * wb, a[2] * wa[..., None] + b[2] * wb[..., None]


def _normalise(state, dtype):
    """The online softmax's output [B, T, H, D] in dtype (zeros for a query that saw nothing)."""
    _, l, acc = state
    B, G, R, T, D = acc.shape
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]  # [B, G, R, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, G * R, D).astype(dtype)


# ---- accelerator kernels ---------------------------------------------------------------
#
# Status: on a GPU, cuDNN has run on its hardware: one H200, 2026-11-26 (docs/bench/gpu/
# README.md, "After": 1.2-5x faster than the portable path on 1B and 8B shapes, the same
# greedy tokens), so a model takes the kernels by default there (Model.attention="auto",
# `takes_kernels`). Where cuDNN is installed (jax's CUDA plugin), `attention_kernel` gives it
# every pass it applies to, a cached pass of one or six tokens included (`pass_view` then
# masks the whole cache for it): the Pallas prefix kernel is reached on a GPU only where
# cuDNN does not apply (a soft-cap, head_dim over 128, float32 opting in), so by this
# selection the H200's "kernels" figures are cuDNN's, and the prefix kernel has not run on a
# GPU. (CUDA programs lowered here, without the plugin, hold the prefix kernel instead.)
# The TPU's (splash, the Pallas prefix kernel through Mosaic) have only been compiled here: a model takes them when it
# opts in (Model.attention="kernels"). Their selection, their mask and layout handling and
# the kernels themselves in Pallas' interpret mode are tested on CPU against the portable
# path (tests/test_long_context.py: dot_product_attention through implementation="xla",
# which takes the same arguments as "cudnn"; splash_attention(interpret=True)). The
# constraints below are those the kernels document or check
# (jax._src.cudnn.fused_attention_stablehlo.check_is_flash_attention; the splash kernel's
# 128-lane blocks).

# Where Model.attention="auto" takes the kernels: platforms whose kernels have been measured
# on their hardware, in the dtypes measured there (bfloat16 on the H200). float16 and float32
# attend portably until measured (Triton's float32 dots round to TF32); "kernels" opts in.
MEASURED_KERNELS = {"gpu": (jnp.bfloat16,)}

SPLASH_BLOCK = 128  # splash attention's query and key block (a multiple of the TPU's 128 lanes)
# While tracing a program for a platform (`kernels_for`): (that platform: "cpu", "gpu", "tpu",
# None for the default backend's; whether attention must take the portable path there; the
# mesh a sharded program runs on, or None). Programs built ahead of time for devices this
# host lacks (aot.py) are traced here for their platform, so they hold the kernels and matmul
# forms it runs. A context variable: each thread (the engine's device thread, a caller
# compiling beside it) traces under its own setting.
_tracing_for: contextvars.ContextVar = contextvars.ContextVar("specjax_tracing_for", default=(None, False, None))


@contextlib.contextmanager
def kernels_for(platform: str | None, portable: bool | None = None, mesh: Mesh | None = None):
    """While tracing inside it (in this thread), layers pick the matmul forms, cache writes and
    (where the model opts in: Model.attention) attention kernels of `platform` (a device's
    `.platform`: "cpu", "gpu", "tpu"; "cuda" and "rocm" count as "gpu"), the platform the
    program is built for, which need not be this host's; portable=True makes attention take
    the jnp path on it. mesh: a sharded program's; GSPMD partitions plain XLA ops but not a
    Mosaic, Triton or cuDNN custom call, so there cuDNN and splash give way to the jnp path and
    the prefix kernel runs under `shard_map`, one call per device on its own rows and kv heads
    (`_prefix_kernel`). None leaves each as it was (the default backend's, False and None,
    unless an enclosing context set them). Every program that enters it has them as static
    arguments of its jit (`generate` traces its loop under the platform of the devices its
    arguments live on), so they are part of its key."""
    platform_now, portable_now, mesh_now = _tracing_for.get()
    if platform is not None:
        platform_now = "gpu" if platform in ("cuda", "rocm") else platform
    token = _tracing_for.set((platform_now, portable_now if portable is None else portable,
                              mesh_now if mesh is None else mesh))
    try:
        yield
    finally:
        _tracing_for.reset(token)


def portable_attention(on: bool = True):
    """While tracing inside it, attention takes the portable jnp path whatever the backend."""
    return kernels_for(None, portable=True if on else None)


def target_platform() -> str:
    """The platform the program being traced is built for (see `kernels_for`)."""
    return _tracing_for.get()[0] or jax.default_backend()


def kernel_platform() -> str:
    """The platform whose whole-pass kernels (cuDNN, splash) attention picks now, or
    "portable": under `portable_attention`, and in a sharded program (see `kernels_for`)."""
    _, portable, mesh = _tracing_for.get()
    return "portable" if portable or mesh is not None else target_platform()


def writes_per_row() -> bool:
    """Whether the program being traced writes a pass's cache entries as one slice per row
    (`cache.write`'s consecutive form) rather than one scatter: a TPU's, on one device (a
    sharded program's rows were not measured better)."""
    return kernel_platform() == "tpu"


def takes_kernels(attention: str, dtype) -> bool:
    """Whether a model of Model.attention `attention` (its activations in `dtype`) may take
    the kernels of the platform being traced for: "kernels" anywhere, "auto" where they were
    measured (MEASURED_KERNELS) on one device (a sharded program's kernels have not been),
    "portable" never. Which kernel, if any, applies to a pass is `attention_kernel`'s and
    `_prefix_kernel`'s business."""
    if attention == "auto":
        return _tracing_for.get()[2] is None and jnp.dtype(dtype) in MEASURED_KERNELS.get(target_platform(), ())
    return attention == "kernels"


def _prefix_kernel(B: int, cache_shape: tuple, rules, scale: float, cap: float | None, interpret: bool):
    """The Pallas prefix kernel that takes a cached pass of B rows over a cache of
    cache_shape [B', G, S, D], as a function (qg, cache_k, cache_v, prefix, floor) -> the
    prefix's online-softmax state (`prefix_kernel.state`), or None: the portable path.

    On one device: where the platform being traced for has a kernel that applies
    (`prefix_kernel.applies`). In a sharded program (`kernels_for(mesh=...)`): under
    `shard_map`, each device running it on its own rows and kv heads, the cache split as the
    model's rules lay it (sharding.CACHE_AXES: rows over `data`, kv heads over `model`), so
    that nothing moves between devices; only where a device holds whole rows of whole kv
    heads (the cache's slots and head_dim not split), the pass's rows are all the cache's
    (B = B'), and the model knows its rules (`Model.rules`: `shard_model` sets them)."""
    platform, portable, mesh = _tracing_for.get()
    platform = platform or jax.default_backend()
    _, G, S, D = cache_shape
    if portable or not prefix_kernel.applies(platform, S, G, D):
        return None
    run = functools.partial(prefix_kernel.state, platform, scale=scale, cap=cap, interpret=interpret)
    if mesh is None:
        return run
    if rules is None or cache_shape[0] != B:
        return None
    rows, heads, slots, dims = sharding.spec(cache_shape, sharding.CACHE_AXES, mesh, rules)
    if slots is not None or dims is not None:
        return None
    heads_first = PartitionSpec(rows, heads)  # the cache [B, G, S, D] and the state [B, G, ...]
    q, row = PartitionSpec(rows, None, heads), PartitionSpec(rows)  # qg [B, T, G, R, D]; prefix [B], floor [B, T]

    def sharded(qg, cache_k, cache_v, prefix, floor):
        floors = () if floor is None else (floor,)  # shard_map takes arrays only
        return jax.shard_map(lambda qg, k, v, prefix, *floor: run(qg, k, v, prefix, *(floor or (None,))),
                             mesh=mesh, in_specs=(q, heads_first, heads_first, row) + (row,) * len(floors),
                             out_specs=(heads_first,) * 3, check_vma=False)(qg, cache_k, cache_v, prefix, *floors)
    return sharded


def attention_kernel(backend: str, dtype, T: int, S: int, D: int, cap: float | None) -> str:
    """Which implementation attention over q [B, T, H, D] and S key slots takes, for a model
    that takes kernels (`takes_kernels`; every other model's is portable):

    - "cudnn" (`jax.nn.dot_product_attention(implementation="cudnn")`, flash attention): on
      GPU, for float16/bfloat16, head_dim <= 128 and a multiple of 8, no soft-cap (cuDNN has
      none). The boolean mask becomes an additive bias [B, 1, T, S]; any mask kind works.
    - "splash" (Pallas splash attention, `jax.experimental.pallas.ops.tpu`): on TPU, where
      it imports, for bfloat16/float32, T, S and head_dim multiples of 128 (long prefill
      chunks over caches rounded to 128 slots; decode steps of K+1 tokens do not qualify),
      soft-cap included. The mask is given as a dynamic (traced) mask; blocks it hides
      entirely are skipped, so nothing past the highest visible slot is read.
    - "portable": everything else, CPU always (the jnp code in `attention`), and every
      backend under `portable_attention`.
    backend: the platform the program is built for (`kernel_platform`), or "portable"."""
    dtype = jnp.dtype(dtype)
    if backend == "portable":
        return "portable"
    if (backend == "gpu" and dtype in (jnp.bfloat16, jnp.float16) and D <= 128 and D % 8 == 0
            and cap is None and _cudnn_available()):
        return "cudnn"
    if (backend == "tpu" and dtype in (jnp.bfloat16, jnp.float32) and T % SPLASH_BLOCK == 0
            and S % SPLASH_BLOCK == 0 and D % 128 == 0 and _splash_module() is not None):
        return "splash"
    return "portable"


def _cudnn_available() -> bool:
    """Whether cuDNN's attention can be traced here: jax's CUDA plugin (with cuDNN) is
    installed. Without it a program for a GPU (lowered here for "cuda": aot.py) takes the
    portable path."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    return cudnn.cuda_versions is not None


def _splash_module():
    try:
        from jax.experimental.pallas.ops.tpu import splash_attention
    except ImportError:  # a JAX build without Pallas' TPU ops
        return None
    return splash_attention


def dot_product_attention(q, k, v, mask, scale: float, kv_limit=None, implementation: str = "cudnn",
                          heads_first: bool = False):
    """q [B, T, H, D], k/v [B, S, G, D] (heads_first: [B, G, S, D], a cache's layout), mask
    bool [B, T, S] -> [B, T, H, D] through `jax.nn.dot_product_attention` (grouped heads
    natively); implementation "xla" computes the same on any backend (what the CPU tests
    use). kv_limit int32 [B] (or None): each row's live key length, passed as
    key_value_seq_lengths so that cuDNN's flash attention stops at it instead of reading the
    whole cache; the mask already hides what lies past. Keys heads first go to cuDNN in its
    BNSH layout (jax's cuDNN binding; the public function takes BSNH only, which would be a
    transposed copy of the cache), the queries and output [B, H, T, D] around it."""
    B, T = q.shape[:2]
    lengths = None if kv_limit is None else jnp.broadcast_to(kv_limit, (B,)).astype(jnp.int32)
    if heads_first and implementation == "cudnn":
        from jax._src.cudnn import fused_attention_stablehlo as cudnn

        out = cudnn.dot_product_attention(
            jnp.swapaxes(q, 1, 2), k, v, None, mask[:, None], jnp.full((B,), T, jnp.int32),
            jnp.full((B,), k.shape[2], jnp.int32) if lengths is None else lengths, scale=scale,
            mask_type=cudnn.MaskType.PADDING, qkv_layout="BNTH")
        return jnp.swapaxes(out, 1, 2)
    if heads_first:
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale,
                                        key_value_seq_lengths=lengths, implementation=implementation)


def splash_attention(q, k, v, mask, scale: float, cap: float | None = None, interpret: bool = False):
    """q [B, T, H, D], k/v [B, G, S, D], mask bool [B, T, S] -> [B, T, H, D] through Pallas
    splash attention (interpret=True runs the kernel's Pallas program on any backend).

    Each (row, kv head) pair is one "head" of the multi-head kernel, its R query heads
    stacked along the query axis: q [B G, R T, D] against k/v [B G, S, D] (no copies of
    k/v), with the row's mask tiled over them. q is scaled before the kernel (it has no
    scale of its own); the soft-cap applies after scaling, as in `attention`."""
    sa = _splash_module()
    B, T, H, D = q.shape
    G, S = k.shape[1], k.shape[2]
    R = H // G
    qf = (q * jnp.asarray(scale, q.dtype)).reshape(B, T, G, R, D).transpose(0, 2, 3, 1, 4).reshape(B * G, R * T, D)
    kf, vf = (x.reshape(B * G, S, D) for x in (k, v))
    m = jnp.broadcast_to(mask[:, None, None], (B, G, R, T, S)).reshape(B * G, R * T, S)
    blocks = sa.BlockSizes(block_q=SPLASH_BLOCK, block_kv=SPLASH_BLOCK, block_kv_compute=SPLASH_BLOCK)
    kernel = sa.make_splash_mha_single_device(mask=m, block_sizes=blocks, attn_logits_soft_cap=cap,
                                              interpret=interpret)
    # Built inside jit, the kernel's mask info holds is_dynamic_mask as an array, which its
    # __call__ tests as a Python bool (JAX 0.10): restore the flag it was built with.
    kernel.fwd_mask_info = kernel.fwd_mask_info._replace(is_dynamic_mask=True)
    out = kernel(qf, kf.astype(q.dtype), vf.astype(q.dtype))  # [B G, R T, D]
    return out.reshape(B, G, R, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(v.dtype)


class MLP(nn.Module):
    """SwiGLU (Llama family), GeGLU with tanh gelu and a post-norm (Gemma), or a gelu_new
    MLP with biases (GPT-2). Gate and up are one matmul: `gate_up_kernel` [2, E, F], the pair
    a batch axis of the matmul (a TPU tiles (E, F), where [E, 2, F] padded the 2 and made XLA
    keep a relaid copy through a speculative loop; XLA's CPU backend multiplies it as it lies)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x):  # [B, T, E] -> [B, T, E]
        c = self.config
        E, F = c.hidden_size, c.intermediate_size
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
