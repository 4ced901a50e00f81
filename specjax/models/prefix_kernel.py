"""Pallas kernels for the committed prefix of a cached pass, on a GPU (Triton) and a TPU
(Mosaic): each row's queries against the cache's slots below its own prefix length, read in
place.

`attention.cached_attention` splits a cached pass's attention into the committed prefix and
the in-flight keys, merged by their log-sum-exp. This kernel computes the prefix's part
(the online softmax's running max, sum and output, before normalising) as the GPU runs it:
a grid over (row, kv head, split of the cache), so that a decode step at batch 1 still fills
the device; each program reads its split of one kv head's keys and values where they lie in
the head-major [B, G, S, D] cache (contiguous slots; no transposed copy of a layer's cache)
and stops at the row's prefix, so a row reads only its live slots; every query head of the
group and every in-flight query of the row share one read of each key (they are the rows
of one matmul). The splits are merged by their log-sum-exp outside the kernel.

On a TPU (`tpu_prefix_state`) a program is one (row, block of the cache) and holds every kv
head of the row: a block [G, block, D] is G (block, D) tiles as they lie. The row's blocks
run in order, accumulating into its output, and blocks past the row's prefix map to its
last live block, which the pipeline does not fetch again, so a row reads only its live
slots (the ragged trick of JAX's TPU paged attention kernels).

Status: neither kernel has run on its hardware; models/attention.py says when a program
takes them (opt-in: Model.attention="kernels"). Both are tested in Pallas' interpret mode
on CPU against the portable path (tests/test_long_context.py), under shard_map on 8 CPU
devices (tests/sharded_check.py), and compiled for a TPU here (tests/test_aot.py). A sharded
program runs them under shard_map (`attention._prefix_kernel`): they see one device's rows
and kv heads. They know nothing about models, positions, trees or meshes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

BLOCK = 64  # key slots per step of a GPU program's loop (a power of two: Triton's blocks are)
TPU_BLOCK = 128  # key slots per TPU program
SPLITS = 8  # programs per (row, kv head) along the cache, at most
PROGRAMS = 256  # enough programs to fill a GPU (an H100 has 132 SMs): rows x kv heads x splits
_NEG = float(jnp.finfo(jnp.float32).min)


def applies(platform: str, S: int, G: int, D: int) -> bool:
    """Whether `platform`'s kernel takes a pass over S cache slots of G kv heads of head dim D:
    Triton's matmuls want D a power of two >= 16; on a TPU, D a multiple of 128, where XLA
    lays the cache out as the kernel reads it (compiled here for a v5e: with D = 64 it lays
    a cache buffer out otherwise and copies every layer's around the kernel, each pass; with
    G = 1 it did so while the cache lay token-major, not since it lies head-major); both,
    the cache a whole number of blocks."""
    if platform == "gpu":
        return D >= 16 and D & (D - 1) == 0 and S % BLOCK == 0
    return platform == "tpu" and D % 128 == 0 and S % TPU_BLOCK == 0


def _split(S: int, pairs: int) -> int:
    """Slots per program along the cache for `pairs` (row, kv head) pairs: a whole number of
    blocks, as few programs per pair as fill the device (each split's partial output is
    written out and merged: more cost traffic), at most SPLITS."""
    blocks = S // BLOCK
    return BLOCK * -(-blocks // max(1, min(SPLITS, blocks, -(-PROGRAMS // pairs))))


def state(platform: str, qg, cache_k, cache_v, prefix, floor, scale: float, cap: float | None,
          interpret: bool = False):
    """`platform`'s kernel ("gpu" or "tpu"; see `applies`): `prefix_state` or `tpu_prefix_state`."""
    run = prefix_state if platform == "gpu" else tpu_prefix_state
    return run(qg, cache_k, cache_v, prefix, floor, scale, cap, interpret=interpret)


def prefix_state(qg, cache_k, cache_v, prefix, floor, scale: float, cap: float | None, interpret: bool = False):
    """The online softmax's (max [B, G, R, T], sum [B, G, R, T], output [B, G, R, T, D]),
    float32, of queries qg [B, T, G, R, D] over the cache cache_k/cache_v [B', G, S, D] (rows
    [:B] read): row b's
    slots < prefix[b] (int32 [B]), and, with floor (int32 [B, T]), only those above floor[b, t].
    interpret: run the kernel's Pallas program on any backend (the tests')."""
    B, T, G, R, D = qg.shape
    S = cache_k.shape[2]
    M = max(16, 1 << (T * R - 1).bit_length())  # query rows of a program: t R + r, padded to a power of two
    split = _split(S, B * G)
    splits = -(-S // split)
    q = jnp.pad(qg.transpose(0, 2, 1, 3, 4).reshape(B, G, T * R, D), ((0, 0), (0, 0), (0, M - T * R), (0, 0)))
    hi = jnp.broadcast_to(prefix[:, None], (B, M)).astype(jnp.int32)  # [B, M]
    lo = jnp.full((B, T), -1, jnp.int32) if floor is None else floor.astype(jnp.int32)
    lo = jnp.pad(jnp.repeat(lo, R, axis=1), ((0, 0), (0, M - T * R)), constant_values=-1)  # [B, M]
    kernel = functools.partial(_kernel, split=split, scale=scale, cap=cap)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, G, splits),
        in_specs=[pl.BlockSpec((None, None, M, D), lambda b, g, j: (b, g, 0, 0)),  # q
                  pl.BlockSpec((None, None, split, D), lambda b, g, j: (b, g, j, 0)),  # k, in place
                  pl.BlockSpec((None, None, split, D), lambda b, g, j: (b, g, j, 0)),  # v, in place
                  pl.BlockSpec((None, M), lambda b, g, j: (b, 0)),  # hi
                  pl.BlockSpec((None, M), lambda b, g, j: (b, 0))],  # lo
        out_specs=[pl.BlockSpec((None, None, None, M, D), lambda b, g, j: (j, b, g, 0, 0)),
                   pl.BlockSpec((None, None, None, M), lambda b, g, j: (j, b, g, 0)),
                   pl.BlockSpec((None, None, None, M), lambda b, g, j: (j, b, g, 0))],
        out_shape=[jax.ShapeDtypeStruct((splits, B, G, M, D), jnp.float32),
                   jax.ShapeDtypeStruct((splits, B, G, M), jnp.float32),
                   jax.ShapeDtypeStruct((splits, B, G, M), jnp.float32)],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),  # Triton's, not Mosaic GPU's
        name="specjax_prefix_attention",
    )(q, cache_k, cache_v, hi, lo)
    # The splits merged by their log-sum-exp.
    top = m.max(axis=0)  # [B, G, M]
    weight = jnp.exp(m - top[None])  # [splits, B, G, M]
    l = (l * weight).sum(axis=0)
    o = (o * weight[..., None]).sum(axis=0)  # [B, G, M, D]

    def rows(x):  # [B, G, M, ...] -> [B, G, R, T, ...]
        x = x[:, :, : T * R].reshape(B, G, T, R, *x.shape[3:])
        return jnp.swapaxes(x, 2, 3)

    return rows(top), rows(l), rows(o)


def _kernel(q_ref, k_ref, v_ref, hi_ref, lo_ref, o_ref, m_ref, l_ref, *, split: int, scale: float,
            cap: float | None):
    """One (row, kv head, split) program: q_ref [M, D]; k_ref/v_ref [split, D]; hi_ref/lo_ref
    [M] -> o_ref [M, D], m_ref/l_ref [M] (its split's unnormalised state)."""
    j = pl.program_id(2)
    q = q_ref[...]
    hi, lo = hi_ref[...], lo_ref[...]
    M, D = q.shape
    first = j * split
    steps = jnp.clip((jnp.max(hi) - first + BLOCK - 1) // BLOCK, 0, split // BLOCK)

    def body(i, carry):
        o, m, l = carry
        kb = k_ref[pl.ds(i * BLOCK, BLOCK), :]  # [BLOCK, D]
        vb = v_ref[pl.ds(i * BLOCK, BLOCK), :]
        s = pltriton.dot(q, kb, trans_b=True).astype(jnp.float32) * scale  # [M, BLOCK]
        if cap is not None:
            s = cap * jnp.tanh(s / cap)
        slots = first + i * BLOCK + jnp.arange(BLOCK)
        seen = (slots[None, :] < hi[:, None]) & (slots[None, :] > lo[:, None])
        s = jnp.where(seen, s, _NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(seen, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        o = o * correction[:, None] + pltriton.dot(p.astype(vb.dtype), vb).astype(jnp.float32)
        return o, m_new, l * correction + p.sum(axis=1)

    init = (jnp.zeros((M, D), jnp.float32), jnp.full((M,), _NEG, jnp.float32), jnp.zeros((M,), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, steps, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def tpu_prefix_state(qg, cache_k, cache_v, prefix, floor, scale: float, cap: float | None,
                     interpret: bool = False):
    """`prefix_state` by the TPU kernel: the same arguments and results."""
    B, T, G, R, D = qg.shape
    S = cache_k.shape[2]
    M = -(-T * R // 16) * 16  # query rows of a kv head: t R + r, padded to whole sublane tiles
    q = jnp.pad(qg.transpose(0, 2, 1, 3, 4).reshape(B, G, T * R, D), ((0, 0), (0, 0), (0, M - T * R), (0, 0)))
    lo = jnp.full((B, T), -1, jnp.int32) if floor is None else floor.astype(jnp.int32)
    lo = jnp.pad(jnp.repeat(lo, R, axis=1), ((0, 0), (0, M - T * R)), constant_values=-1)[..., None]  # [B, M, 1]

    def live_block(b, j, prefix_ref):  # past the row's prefix: its last live block (not fetched again)
        live = jax.lax.div(prefix_ref[b] + TPU_BLOCK - 1, TPU_BLOCK)  # (prefix >= 0: no floor division's sign test)
        return b, 0, jnp.minimum(j, jnp.maximum(live - 1, 0)), 0

    kernel = functools.partial(_tpu_kernel, heads=G, scale=scale, cap=cap)
    o, m, l = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, S // TPU_BLOCK),
            in_specs=[pl.BlockSpec((None, G, M, D), lambda b, j, prefix_ref: (b, 0, 0, 0)),  # q
                      pl.BlockSpec((None, M, 1), lambda b, j, prefix_ref: (b, 0, 0)),  # lo
                      pl.BlockSpec((None, G, TPU_BLOCK, D), live_block),  # k, as it lies
                      pl.BlockSpec((None, G, TPU_BLOCK, D), live_block)],  # v
            out_specs=[pl.BlockSpec((None, G, M, D), lambda b, j, prefix_ref: (b, 0, 0, 0)),
                       pl.BlockSpec((None, G, M, 128), lambda b, j, prefix_ref: (b, 0, 0, 0)),
                       pl.BlockSpec((None, G, M, 128), lambda b, j, prefix_ref: (b, 0, 0, 0))]),
        out_shape=[jax.ShapeDtypeStruct((B, G, M, D), jnp.float32),
                   jax.ShapeDtypeStruct((B, G, M, 128), jnp.float32),  # max and sum, along lanes
                   jax.ShapeDtypeStruct((B, G, M, 128), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="specjax_prefix_attention",
    )(prefix.astype(jnp.int32), q, lo, cache_k, cache_v)

    def rows(x):  # [B, G, M, ...] -> [B, G, R, T, ...]
        x = x[:, :, : T * R].reshape(B, G, T, R, *x.shape[3:])
        return jnp.swapaxes(x, 2, 3)

    return rows(m[..., 0]), rows(l[..., 0]), rows(o)


def _tpu_kernel(prefix_ref, q_ref, lo_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, heads: int, scale: float,
                cap: float | None):
    """One (row, cache block) program: q_ref [G, M, D]; lo_ref [M, 1]; k_ref/v_ref [G, block, D]
    -> o_ref [G, M, D], m_ref/l_ref [G, M, 128]: the row's state so far, carried across its
    blocks in the output blocks (they stay resident while the row's blocks run)."""
    b, j = pl.program_id(0), pl.program_id(1)
    hi = prefix_ref[b]
    M = q_ref.shape[1]

    @pl.when(j == 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

    @pl.when(j * TPU_BLOCK < hi)
    def _():
        slots = j * TPU_BLOCK + jax.lax.broadcasted_iota(jnp.int32, (M, TPU_BLOCK), 1)
        seen = (slots < hi) & (slots > lo_ref[...])  # [M, block]
        for g in range(heads):
            kb = k_ref[g]  # [block, D]: kv head g's slots
            vb = v_ref[g]
            s = jax.lax.dot_general(q_ref[g], kb, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32) * scale  # [M, block]
            if cap is not None:
                s = cap * jnp.tanh(s / cap)
            s = jnp.where(seen, s, _NEG)
            m_prev, l_prev = m_ref[g][:, :1], l_ref[g][:, :1]  # [M, 1]
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            p = jnp.where(seen, jnp.exp(s - m_new), 0.0)
            correction = jnp.exp(m_prev - m_new)
            pv = jax.lax.dot_general(p.astype(vb.dtype), vb, (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)  # [M, D]
            o_ref[g] = o_ref[g] * correction + pv
            m_ref[g] = jnp.broadcast_to(m_new, (M, 128))
            l_ref[g] = jnp.broadcast_to(l_prev * correction + p.sum(axis=1, keepdims=True), (M, 128))
