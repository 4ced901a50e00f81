"""A Pallas kernel for the committed prefix of a cached pass on a GPU: each row's queries
against the cache's slots below its own prefix length, read in place.

`layers.cached_attention` splits a cached pass's attention into the committed prefix and
the in-flight keys, merged by their log-sum-exp. This kernel computes the prefix's part
(the online softmax's running max, sum and output, before normalising) as the GPU runs it:
a grid over (row, kv head, split of the cache), so that a decode step at batch 1 still fills
the device; each program reads its split of one kv head's keys and values where they lie in
the [B, S, G, D] cache (no transposed copy of a layer's cache, which `jax.experimental.pallas.
ops.gpu.decode_attention.gqa` makes) and stops at the row's prefix, so a row reads only its
live slots; every query head of the group and every in-flight query of the row share one
read of each key (they are the rows of one matmul). The splits are merged by their
log-sum-exp outside the kernel.

Honest status: it has not run on a GPU. It is tested in Pallas' interpret mode on CPU
against the portable path (tests/test_long_context.py) and taken only by a model that opts
in (Model.attention="kernels"). It knows nothing about models, positions or trees.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK = 64  # key slots per step of a program's loop (a power of two: Triton's blocks are)
SPLITS = 8  # programs per (row, kv head) along the cache, at most
_NEG = float(jnp.finfo(jnp.float32).min)


def applies(T: int, R: int, S: int, D: int) -> bool:
    """Whether the kernel takes a pass of T queries with R query heads per kv head over S cache
    slots of head dim D: Triton's matmuls want D a power of two >= 16, and the cache a whole
    number of blocks."""
    return D >= 16 and D & (D - 1) == 0 and S % BLOCK == 0


def _split(S: int) -> int:
    """Slots per program along the cache: a whole number of blocks, at most SPLITS programs."""
    blocks = S // BLOCK
    return BLOCK * -(-blocks // min(SPLITS, blocks))


def prefix_state(qg, cache_k, cache_v, prefix, floor, scale: float, cap: float | None, interpret: bool = False):
    """The online softmax's (max [B, G, R, T], sum [B, G, R, T], output [B, G, R, T, D]),
    float32, of queries qg [B, T, G, R, D] over the cache cache_k/cache_v [B, S, G, D]: row b's
    slots < prefix[b] (int32 [B]), and, with floor (int32 [B, T]), only those above floor[b, t].
    interpret: run the kernel's Pallas program on any backend (the tests')."""
    B, T, G, R, D = qg.shape
    S = cache_k.shape[1]
    M = max(16, 1 << (T * R - 1).bit_length())  # query rows of a program: t R + r, padded to a power of two
    split = _split(S)
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
                  pl.BlockSpec((None, split, None, D), lambda b, g, j: (b, j, g, 0)),  # k, in place
                  pl.BlockSpec((None, split, None, D), lambda b, g, j: (b, j, g, 0)),  # v, in place
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
