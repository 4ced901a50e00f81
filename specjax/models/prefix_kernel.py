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

A paged cache (cache.py: pools [P, G, page, D] and a page table [B, W]) is read by the same
kernels through the table (`pages=`), with the same contract and results, reading only each
row's live pages: on a GPU a program's loop gathers a step's pages from its split of the
row's table (BLOCK slots a step, or one larger page) and stops at the row's prefix; on a
TPU a program is one page ([G, page, D], fetched by the scalar-prefetched table), pages
past the row's prefix mapping to its last live page. One page a TPU block: no manual DMA
gathers several pages into one block yet, so small pages make many short steps. The pools'
layout is specjax's own (jax's paged kernels want K/V interleaved or [G, P, page, D]: a copy
of the pool a pass; ../shared/notes/kernels.md).

Status: no kernel has run on its hardware, dense or paged; models/attention.py says when a
program takes them (opt-in: Model.attention="kernels"). The dense ones are tested in
Pallas' interpret mode on CPU against the portable path (tests/test_long_context.py), under
shard_map on 8 CPU devices (tests/sharded_check.py), and compiled for a TPU here
(tests/test_aot.py); the paged ones in interpret mode against the dense kernels and the
portable paged path (tests/test_paged_kernels.py, on 4 CPU devices under shard_map in its
slow case), lowered for a GPU (Triton) and compiled for a v5e in a paged engine's call
(tests/test_aot.py). A sharded program runs them under shard_map
(`attention._prefix_kernel`): they see one device's rows and kv heads. They know nothing
about models, positions, trees or meshes.
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
TPU_PAGE_TILE = 16  # a paged TPU program's page: a multiple of this many slots (`applies`)
SPLITS = 8  # programs per (row, kv head) along the cache, at most
PROGRAMS = 256  # enough programs to fill a GPU (an H100 has 132 SMs): rows x kv heads x splits
_NEG = float(jnp.finfo(jnp.float32).min)


def applies(platform: str, S: int, G: int, D: int, page: int | None = None) -> bool:
    """Whether `platform`'s kernel takes a pass over S cache slots of G kv heads of head dim D:
    Triton's matmuls want D a power of two >= 16; on a TPU, D a multiple of 128, where XLA
    lays the cache out as the kernel reads it (compiled here for a v5e: with D = 64 it lays
    a cache buffer out otherwise and copies every layer's around the kernel, each pass; with
    G = 1 it did so while the cache lay token-major, not since it lies head-major); both,
    the cache a whole number of blocks.

    page: a paged cache's page size (S is then a row's slots: page x table width, any
    width): the GPU's kernel wants it a power of two (a loop step gathers BLOCK / page pages,
    or reads one page of more slots); the TPU's, a multiple of TPU_PAGE_TILE (a block is one
    page, [G, page, D]: its slots whole sublane tiles of bfloat16 keys)."""
    if platform == "gpu":
        whole = S % BLOCK == 0 if page is None else page > 0 and page & (page - 1) == 0
        return D >= 16 and D & (D - 1) == 0 and whole
    whole = S % TPU_BLOCK == 0 if page is None else page % TPU_PAGE_TILE == 0
    return platform == "tpu" and D % 128 == 0 and whole


def _split(S: int, pairs: int) -> int:
    """Slots per program along the cache for `pairs` (row, kv head) pairs: a whole number of
    blocks, as few programs per pair as fill the device (each split's partial output is
    written out and merged: more cost traffic), at most SPLITS."""
    blocks = S // BLOCK
    return BLOCK * -(-blocks // _splits(blocks, pairs))


def _splits(steps: int, pairs: int) -> int:
    """Programs per (row, kv head) pair over `steps` loop steps of the cache (see `_split`)."""
    return max(1, min(SPLITS, steps, -(-PROGRAMS // pairs)))


def state(platform: str, qg, cache_k, cache_v, prefix, floor, scale: float, cap: float | None,
          interpret: bool = False, pages=None):
    """`platform`'s kernel ("gpu" or "tpu"; see `applies`): `prefix_state` or `tpu_prefix_state`."""
    run = prefix_state if platform == "gpu" else tpu_prefix_state
    return run(qg, cache_k, cache_v, prefix, floor, scale, cap, interpret=interpret, pages=pages)


def _queries(qg, M: int, floor):
    """The queries of each (row, kv head) as a program's rows, [B, G, M, D] (row t R + r, padded
    to M), and each row's floor int32 [B, M] (-1: none; the padding's too)."""
    B, T, G, R, D = qg.shape
    q = jnp.pad(qg.transpose(0, 2, 1, 3, 4).reshape(B, G, T * R, D), ((0, 0), (0, 0), (0, M - T * R), (0, 0)))
    lo = jnp.full((B, T), -1, jnp.int32) if floor is None else floor.astype(jnp.int32)
    return q, jnp.pad(jnp.repeat(lo, R, axis=1), ((0, 0), (0, M - T * R)), constant_values=-1)


def _rows(x, T: int, R: int):
    """A program's query rows [B, G, M, ...] -> [B, G, R, T, ...]."""
    B, G = x.shape[:2]
    x = x[:, :, : T * R].reshape(B, G, T, R, *x.shape[3:])
    return jnp.swapaxes(x, 2, 3)


def prefix_state(qg, cache_k, cache_v, prefix, floor, scale: float, cap: float | None, interpret: bool = False,
                 pages=None):
    """The online softmax's (max [B, G, R, T], sum [B, G, R, T], output [B, G, R, T, D]),
    float32, of queries qg [B, T, G, R, D] over the cache cache_k/cache_v [B', G, S, D] (rows
    [:B] read): row b's
    slots < prefix[b] (int32 [B]), and, with floor (int32 [B, T]), only those above floor[b, t].
    interpret: run the kernel's Pallas program on any backend (the tests').

    pages: a paged cache's page table int32 [B, W] (cache_k/cache_v then pools [P, G, page,
    D]): the same over row b's slots s < prefix[b] at slot s % page of page pages[b, s //
    page]. A program's loop gathers a step's pages of its split of the row's table (of kv
    head g: entry p G + g of the pool seen as [P G, page, D], a bitcast) and stops at the
    row's prefix: only the row's live pages are read."""
    B, T, G, R, D = qg.shape
    M = max(16, 1 << (T * R - 1).bit_length())  # query rows of a program: t R + r, padded to a power of two
    q, lo = _queries(qg, M, floor)
    hi = jnp.broadcast_to(prefix[:, None], (B, M)).astype(jnp.int32)  # [B, M]
    if pages is None:
        S = cache_k.shape[2]
        split = _split(S, B * G)
        splits, step, extra = -(-S // split), BLOCK, ()
        kv_spec = pl.BlockSpec((None, None, split, D), lambda b, g, j: (b, g, j, 0))  # in place
        cache = (cache_k, cache_v)
    else:
        P, _, page, _ = cache_k.shape
        width = pages.shape[1]
        per_step = max(1, BLOCK // page)  # pages a step gathers (a power of two: `applies`)
        steps = -(-width // per_step)
        split_steps = -(-steps // _splits(steps, B * G))
        splits, split_pages, step = -(-steps // split_steps), split_steps * per_step, per_step * page
        split = split_pages * page
        # Padded with each row's last page (page_blocks' rule): a step past the table reads
        # held slots, masked, never another row's or an unheld page.
        table = jnp.pad(pages.astype(jnp.int32), ((0, 0), (0, splits * split_pages - width)), mode="edge")
        extra = (pl.BlockSpec((None, None, split_pages), lambda b, g, j: (b, j, 0)),)
        kv_spec = pl.BlockSpec((P * G, page, D), lambda b, g, j: (0, 0, 0))  # the whole pool, gathered from
        cache = tuple(pool.reshape(P * G, page, D) for pool in (cache_k, cache_v))
        cache += (table.reshape(B, splits, split_pages),)
    kernel = functools.partial(_kernel, split=split, step=step, scale=scale, cap=cap,
                               heads=None if pages is None else G)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, G, splits),
        in_specs=[pl.BlockSpec((None, None, M, D), lambda b, g, j: (b, g, 0, 0)),  # q
                  pl.BlockSpec((None, M), lambda b, g, j: (b, 0)),  # hi
                  pl.BlockSpec((None, M), lambda b, g, j: (b, 0)),  # lo
                  kv_spec, kv_spec, *extra],  # k, v (, the table)
        out_specs=[pl.BlockSpec((None, None, None, M, D), lambda b, g, j: (j, b, g, 0, 0)),
                   pl.BlockSpec((None, None, None, M), lambda b, g, j: (j, b, g, 0)),
                   pl.BlockSpec((None, None, None, M), lambda b, g, j: (j, b, g, 0))],
        out_shape=[jax.ShapeDtypeStruct((splits, B, G, M, D), jnp.float32),
                   jax.ShapeDtypeStruct((splits, B, G, M), jnp.float32),
                   jax.ShapeDtypeStruct((splits, B, G, M), jnp.float32)],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),  # Triton's, not Mosaic GPU's
        name="specjax_prefix_attention" if pages is None else "specjax_paged_prefix_attention",
    )(q, hi, lo, *cache)
    # The splits merged by their log-sum-exp.
    top = m.max(axis=0)  # [B, G, M]
    weight = jnp.exp(m - top[None])  # [splits, B, G, M]
    l = (l * weight).sum(axis=0)
    o = (o * weight[..., None]).sum(axis=0)  # [B, G, M, D]
    return _rows(top, T, R), _rows(l, T, R), _rows(o, T, R)


def _kernel(q_ref, hi_ref, lo_ref, k_ref, v_ref, *refs, split: int, step: int, scale: float, cap: float | None,
            heads: int | None):
    """One (row, kv head, split) program: q_ref [M, D]; hi_ref/lo_ref [M]; k_ref/v_ref: its
    split of the row's slots [split, D], or (heads: a paged cache's kv heads) the pool [P G,
    page, D] and then refs[0] its split of the row's table [split / page] -> o_ref [M, D],
    m_ref/l_ref [M] (its split's unnormalised state). A loop step reads `step` slots."""
    o_ref, m_ref, l_ref = refs[-3:]
    g, j = pl.program_id(1), pl.program_id(2)
    q = q_ref[...]
    hi, lo = hi_ref[...], lo_ref[...]
    M, D = q.shape
    first = j * split
    steps = jnp.clip((jnp.max(hi) - first + step - 1) // step, 0, split // step)

    def fetch(ref, i):  # [step, D]: slots first + i step ..
        if heads is None:
            return ref[pl.ds(i * step, step), :]
        n = step // ref.shape[1]  # pages a step
        ids = refs[0][pl.ds(i * n, n)] * heads + g  # [n]: kv head g of each page
        return ref[ids].reshape(step, D)

    def body(i, carry):
        o, m, l = carry
        kb, vb = fetch(k_ref, i), fetch(v_ref, i)
        s = pltriton.dot(q, kb, trans_b=True).astype(jnp.float32) * scale  # [M, step]
        if cap is not None:
            s = cap * jnp.tanh(s / cap)
        slots = first + i * step + jnp.arange(step)
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
                     interpret: bool = False, pages=None):
    """`prefix_state` by the TPU kernel: the same arguments and results. Paged (pages int32
    [B, W], the pools [P, G, page, D]), a program is one page of the row's table: its
    block [G, page, D] is fetched by the table, scalar-prefetched with the prefix, and pages
    past the row's prefix map to its last live page (not fetched again). One page a block:
    a small page is a short step (no manual DMA gathers several pages into one block yet)."""
    B, T, G, R, D = qg.shape
    M = -(-T * R // 16) * 16  # query rows of a kv head: t R + r, padded to whole sublane tiles
    q, lo = _queries(qg, M, floor)
    lo = lo[..., None]  # [B, M, 1]
    if pages is None:
        block, blocks, prefetch = TPU_BLOCK, cache_k.shape[2] // TPU_BLOCK, (prefix.astype(jnp.int32),)
    else:
        block, blocks = cache_k.shape[2], pages.shape[1]
        prefetch = (prefix.astype(jnp.int32), pages.astype(jnp.int32).reshape(-1))  # the table flat: [B W]

    def live_block(b, j, prefix_ref, *table_ref):  # past the row's prefix: its last live block (not fetched again)
        live = jax.lax.div(prefix_ref[b] + block - 1, block)  # (prefix >= 0: no floor division's sign test)
        j = jnp.minimum(j, jnp.maximum(live - 1, 0))
        return (b, 0, j, 0) if not table_ref else (table_ref[0][b * blocks + j], 0, 0, 0)

    whole = lambda b, j, *_: (b, 0, 0, 0)  # noqa: E731
    kernel = functools.partial(_tpu_kernel, heads=G, block=block, scale=scale, cap=cap)
    o, m, l = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(B, blocks),
            in_specs=[pl.BlockSpec((None, G, M, D), whole),  # q
                      pl.BlockSpec((None, M, 1), lambda b, j, *_: (b, 0, 0)),  # lo
                      pl.BlockSpec((None, G, block, D), live_block),  # k, as it lies
                      pl.BlockSpec((None, G, block, D), live_block)],  # v
            out_specs=[pl.BlockSpec((None, G, M, D), whole),
                       pl.BlockSpec((None, G, M, 128), whole),
                       pl.BlockSpec((None, G, M, 128), whole)]),
        out_shape=[jax.ShapeDtypeStruct((B, G, M, D), jnp.float32),
                   jax.ShapeDtypeStruct((B, G, M, 128), jnp.float32),  # max and sum, along lanes
                   jax.ShapeDtypeStruct((B, G, M, 128), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="specjax_prefix_attention" if pages is None else "specjax_paged_prefix_attention",
    )(*prefetch, q, lo, cache_k, cache_v)
    return _rows(m[..., 0], T, R), _rows(l[..., 0], T, R), _rows(o, T, R)


def _tpu_kernel(prefix_ref, *refs, heads: int, block: int, scale: float, cap: float | None):
    """One (row, cache block) program (a paged cache's: refs[0] is the table, then as a row
    cache's): q_ref [G, M, D]; lo_ref [M, 1]; k_ref/v_ref [G, block, D] -> o_ref [G, M, D],
    m_ref/l_ref [G, M, 128]: the row's state so far, carried across its blocks in the output
    blocks (they stay resident while the row's blocks run)."""
    q_ref, lo_ref, k_ref, v_ref, o_ref, m_ref, l_ref = refs[-7:]
    b, j = pl.program_id(0), pl.program_id(1)
    hi = prefix_ref[b]
    M = q_ref.shape[1]

    @pl.when(j == 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

    @pl.when(j * block < hi)
    def _():
        slots = j * block + jax.lax.broadcasted_iota(jnp.int32, (M, block), 1)
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
