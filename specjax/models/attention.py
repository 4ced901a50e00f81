"""Attention: every path a pass can take, and the rule that chooses among them.

Paths, each with its contract in its docstring, all computing what `attention` computes
densely (the reference: float32 scores, scaled, soft-capped, masked softmax, with gpt-oss's
attention sinks an extra logit per query head in every query's softmax, whose value is zero):

- `attention`: a pass's queries over keys given whole (a full causal pass, or a kernel's
  pass over the whole cache under one mask): dense up to ATTENTION_BLOCK slots, else an
  online softmax block by block;
- `cached_attention`: a cached pass over the committed prefix, read in place, and the
  in-flight keys under their own mask, merged by their log-sum-exp;
- kernels, taken only where `choose` / `_prefix_kernel` say they apply and the model asks
  (`takes_kernels`): cuDNN (`dot_product_attention`, through jax's public API), Pallas splash
  attention on a TPU (`splash_attention`), and the Pallas prefix kernels of prefix_kernel.py
  (a GPU's Triton and a TPU's Mosaic) for a cached pass's prefix, in row buffers or in pages,
  under `shard_map` in a sharded program. cuDNN and splash return normalised outputs, with
  no log-sum-exp to add a sink to: a model with sinks never takes them (`choose`). The
  prefix kernels return the online softmax's state, which the sink joins where it is
  normalised (`_normalise`), so they take a model with sinks.

Every choice reads the program's `Backend` (backend.py), passed in: nothing here asks which
platform it runs on. Tested together against the dense reference in
tests/test_long_context.py (kernels in Pallas' interpret mode, cuDNN's arguments through
implementation="xla"). It knows nothing about caches' bookkeeping, positions or models:
what a query sees is its mask's (and prefix's) business.
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from specjax import sharding
from specjax.backend import Backend
from specjax.cache import page_blocks
from specjax.models import prefix_kernel
from specjax.models.layers import softcap

# Passes over more key slots than this attend blockwise, one key block of this many slots
# at a time; shorter ones (the tests' models, decode steps of short contexts) take the
# dense path. A module constant so that tests can shrink it.
ATTENTION_BLOCK = 512
# A GPU's portable cached pass attends over its whole cache in one softmax where its
# float32 scores are at most this share of a layer's cache bytes (`_whole_cache_on_gpu`):
# a decode or verification pass (with head_dim 128 and 4 query heads per kv head, up to 8 tokens).
GPU_SCORES_OVER_CACHE = 0.25
# A CPU visits a long cache's prefix in blocks of this many slots: rows shorter than the
# cache then read less of it, for a few more loop trips (docs/bench/engine_clients.py
# compares block sizes). Other platforms visit ATTENTION_BLOCK slots at a time.
CPU_PREFIX_BLOCK = 256
_NEG = float(jnp.finfo(jnp.float32).min)


def attention(q, k, v, mask, scale: float, cap: float | None = None, kv_limit=None, block: int | None = None, *,
              backend: Backend, kernels: bool = False, heads_first: bool = False, sinks=None):
    """Softmax attention with grouped key/value heads: q [B, T, H, D], k/v [B, S, G, D] (a
    pass's own keys; heads_first: [B, G, S, D], a cache's layout), mask bool [B, T, S]
    (True: the query sees the slot) -> [B, T, H, D] in v's dtype.
    Scores are float32 and scaled by `scale`, then soft-capped by `cap` if given (Gemma 2).
    Zero-width values (latent attention's) mean the values are the keys (`values`): the
    output is then [B, T, H, D] of k's D.

    Up to `block` (default ATTENTION_BLOCK) key slots, the scores [B, H, T, S] are
    materialised (the reference computation). Beyond, keys are visited in blocks of `block`
    slots with an online softmax (running max and sum, float32), so no more than
    [B, H, T, block] scores live at once; results agree with the dense path to float32
    rounding, and reverse-mode autodiff differentiates it (a fixed-length loop). kv_limit
    (int32 [B], or None): each row's live key length, which only a kernel reads (the mask
    already hides what lies past it). A query that sees no slot at all gets zeros (the
    dense path's output for it, a uniform average, is equally meaningless).
    sinks: None, or attention sinks [H] (gpt-oss's `self_attn.sinks`): head h's sink joins
    each of its queries' softmax as one more logit (unscaled, not soft-capped, never masked)
    whose value is zero, as transformers' gpt-oss concatenates it to the scores; a query that
    sees no slot then gets zeros on every path.

    backend: the program's (backend.py). With kernels=True (`takes_kernels` of the model's
    Model.attention), where an accelerator kernel of its platform applies (`choose`: cuDNN on
    a GPU, Pallas splash attention on a TPU) it computes the same thing instead; this jnp
    code is the default and the fallback. A cached pass attends by `cached_attention` unless
    a kernel takes it.

    It knows nothing about caches or positions: what is visible is the mask's business."""
    B, T, H, D = q.shape
    G, S = (k.shape[1], k.shape[2]) if heads_first else (k.shape[2], k.shape[1])
    v = values(k, v)
    kernel = choose(backend, q.dtype, T, S, D, cap, sinks is not None) if kernels else "portable"
    if kernel == "cudnn":
        return dot_product_attention(q, k, v, mask, scale, kv_limit, heads_first=heads_first)
    if not heads_first:
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, G, S, D], as the rest reads keys
    if kernel == "splash":
        return splash_attention(q, k, v, mask, scale, cap)
    block = block or ATTENTION_BLOCK
    qg = q.reshape(B, T, G, H // G, D)  # [B, T, G, R, D], R query heads per kv head
    if S <= block:
        scores = jnp.where(mask[:, None, None], _scores(qg, k, scale, cap), _NEG)  # [B, G, R, T, S]
        if sinks is None:
            probs = jax.nn.softmax(scores, axis=-1)
        else:  # the sink's column joins the softmax, then is dropped
            sink = jnp.broadcast_to(_sink_logits(sinks, G)[:, :, None, None], (*scores.shape[:-1], 1))
            probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
        return jnp.einsum("bgrts,bgsd->btgrd", probs.astype(v.dtype), v).reshape(B, T, H, D)
    return _normalise(_masked_state(qg, k, v, mask, _empty_state(qg), scale, cap, block), v.dtype, sinks)


def cached_attention(q, k, v, mask, cache_k, cache_v, prefix, floor=None, scale: float = 1.0,
                     cap: float | None = None, block: int | None = None, *, backend: Backend,
                     kernels: bool = False, interpret: bool = False, rules=None, pages=None, sinks=None):
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
    up to the longest row's prefix: blocks outside are not read (on a GPU, where a loop's
    data-dependent predicate would wait on the host, the loop is fixed-length and re-reads
    the last live block instead, masked). The platform is `backend`'s, the program's.
    Zero-width values (v and cache_v [..., 0]: latent attention's) mean the values are the
    keys (`values`).

    kernels=True (`takes_kernels` of the model's Model.attention): on a GPU or a TPU, where it
    applies (`_prefix_kernel`), the prefix goes through that platform's Pallas kernel
    (per-row lengths, read in place; in a sharded program under `shard_map`, by the model's
    `rules`); interpret=True runs it in Pallas' interpreter, on any backend (the tests').
    pages: a paged cache's page table int32 [B, M] (cache_k/cache_v are then the layer's
    pools [P, G, page, D]): the prefix is read page by page through it, the same
    computation over the same slots; with kernels=True, where a paged kernel applies
    (`_prefix_kernel`: the page size `prefix_kernel.applies` takes), by that kernel, which
    reads each row's live pages through its table.
    sinks: None, or attention sinks [H], as `attention` takes them: they join the merged
    state where it is normalised, on every path (the prefix kernels' included).

    It knows nothing about positions: what the in-flight keys see is the mask's business."""
    B, T, H, D = q.shape
    G, S, N = cache_k.shape[1], cache_k.shape[2], k.shape[1]
    v, cache_v = values(k, v), values(cache_k, cache_v)
    block = block or ATTENTION_BLOCK
    if pages is not None:  # pools [P, G, page, D]: S slots a row, read page by page
        page, S = S, S * pages.shape[1]
    qg = q.reshape(B, T, G, H // G, D)  # [B, T, G, R, D]
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, G, N, D], as the cache lies
    kernel = _prefix_kernel(backend, B, cache_k.shape, rules, scale, cap, interpret, pages) if kernels else None
    one_softmax = kernel is None and N <= block and (S <= block or _whole_cache_on_gpu(backend, T * (H // G), D))

    def prefix_seen(start, n):  # bool [B, T or 1, n]: which of cache slots start .. start+n-1 each query sees
        slots = start + jnp.arange(n)
        seen = slots[None, None, :] < prefix[:, None, None]
        return seen if floor is None else seen & (slots[None, None, :] > floor[:, :, None])

    if one_softmax:  # over both key sets, without joining them
        if pages is None:
            cache_k, cache_v = cache_k[:B], cache_v[:B]
        else:  # every page of the row's table, gathered
            cache_k, cache_v = (page_blocks(pool, pages, 0, pages.shape[1]) for pool in (cache_k, cache_v))
        seen = (prefix_seen(0, S)[:, None, None], mask[:, None, None])  # [B, 1, 1, T or 1, S], [.., T, N]
        scores = [jnp.where(m, _scores(qg, keys, scale, cap), _NEG) for m, keys in zip(seen, (cache_k, k))]
        top = jnp.maximum(scores[0].max(axis=-1), scores[1].max(axis=-1, initial=_NEG))[..., None]  # [B, G, R, T, 1]
        p = [jnp.where(m, jnp.exp(s - top), 0.0) for m, s in zip(seen, scores)]
        total = p[0].sum(axis=-1) + p[1].sum(axis=-1)  # [B, G, R, T]
        out = sum(jnp.einsum("bgrts,bgsd->bgrtd", pi.astype(vi.dtype), vi, preferred_element_type=jnp.float32)
                  for pi, vi in zip(p, (cache_v, v)))
        return _normalise((top[..., 0], total, out), v.dtype, sinks)
    if kernel is not None:  # the in-flight keys, then the prefix's state from the kernel, merged
        state = _masked_state(qg, k, v, mask, _empty_state(qg), scale, cap, block)
        return _normalise(_merge(state, kernel(qg, cache_k, cache_v, prefix, floor)), v.dtype, sinks)
    # Block by block (a pass of many queries: a prefill chunk), on a GPU with the queries laid
    # out [B, G, R, T, D]: the first matmul's scores then come out [B, G, R, T, n], as the
    # second reads them; from [B, T, G, R, D] queries XLA transposes every float32 score block
    # between the two (docs/bench/gpu_compiled.txt). Not elsewhere: a TPU's chain loop holds
    # more temporaries with them so (docs/bench/aot.py), and a GPU's pass of few queries, in
    # one softmax, had the cache's keys transposed for it.
    layout = "bgrtd" if backend.platform == "gpu" else "btgrd"
    qg = qg.transpose(0, 2, 3, 1, 4) if layout == "bgrtd" else qg
    state = _masked_state(qg, k, v, mask, _empty_state(qg, layout), scale, cap, block, layout)  # in-flight keys first
    if backend.platform == "cpu":
        block = min(block, CPU_PREFIX_BLOCK)
    if pages is not None:  # the prefix's blocks are whole pages
        block = max(page, min(block, S) // page * page)
    upto = jnp.clip((jnp.max(prefix) + block - 1) // block, 0, -(-S // block))
    # A sliding window: blocks wholly below every query's floor are not read.
    first = None if floor is None else jnp.clip((jnp.min(floor) + 1) // block, 0, upto)
    state = _visit_blocks(qg, cache_k, cache_v, prefix_seen, state, scale, cap, block, upto, first, layout,
                          fixed_length=backend.platform == "gpu", pages=pages)
    return _normalise(state, v.dtype, sinks)


def values(keys, values):
    """The values attention averages: `values`, or, where they have zero width (latent
    attention's: models/mla.py, cache.py), the keys themselves (the same array, read in
    place: no copy)."""
    return keys if values.shape[-1] == 0 else values


def _whole_cache_on_gpu(backend: Backend, rows: int, head_dim: int) -> bool:
    """Whether a GPU's portable cached pass with `rows` queries per kv head (T R) attends over
    the whole cache in one softmax rather than block by block. A block loop's dynamic slices
    of K and V are written out before the matmuls read them (XLA's GPU gemms read whole
    buffers): three reads of the cache. One softmax's matmuls read it in place, and its
    float32 scores [B, G, R, T, S] hold rows / head_dim of a layer's cache bytes
    (docs/bench/gpu_compiled.txt compiles both for a GPU)."""
    return backend.platform == "gpu" and rows <= GPU_SCORES_OVER_CACHE * head_dim


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
                  layout: str = "btgrd", fixed_length: bool = False, pages=None):
    """The online softmax's state after the keys k/v [B', G, S, D] (rows [:B] read, B the
    queries' rows), visited `block` slots at a time; seen_of(start, n) -> bool [B, T or 1,
    n]: what each query sees of slots start .. start+n-1. upto: None (every block, a
    fixed-length loop), or a traced count of blocks to visit; first: None, or the traced
    index of the first block to visit (those before it hold no key any query sees); layout:
    qg's (`_scores`). fixed_length: the loop over `upto` blocks is fixed-length anyway (a
    GPU's: see below). pages: a page table int32 [B, M], k/v then pools [P, G, page, D] and
    `block` a multiple of the page (`cache.page_blocks` reads a block's pages)."""
    B, S = qg.shape[0], k.shape[2] * (1 if pages is None else pages.shape[1])
    num_blocks = -(-S // block)

    def fetch(buffer, start):  # [B, G, block, D]: slots start .. start + block - 1 of the first B rows
        if pages is not None:
            return page_blocks(buffer, pages, start // buffer.shape[2], block // buffer.shape[2])
        return jax.lax.dynamic_slice(buffer, (0, 0, start, 0), (B, buffer.shape[1], block, buffer.shape[3]))

    def visit(i, state, live=True):
        # The last block is slid back to fit inside S (no padded copy of k/v); the slots it
        # shares with the previous block are masked out so that none is counted twice.
        start = jnp.minimum(i * block, S - block)
        kb, vb = fetch(k, start), fetch(v, start)
        seen = seen_of(start, block) & (start + jnp.arange(block) >= i * block) & live
        seen = seen[:, None, None]  # [B, 1, 1, T or 1, block]
        return _accumulate(state, jnp.where(seen, _scores(qg, kb, scale, cap, layout), _NEG), seen, vb)

    if upto is None:
        return jax.lax.fori_loop(0, num_blocks, visit, state)
    if fixed_length:
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


def _normalise(state, dtype, sinks=None):
    """The online softmax's output [B, T, H, D] in dtype (zeros for a query that saw nothing).
    sinks: None, or attention sinks [H]: each head's joins the denominator as exp(sink - max)
    (a sink far above every score the query saw makes its output ~0, as it should)."""
    m, l, acc = state
    B, G, R, T, D = acc.shape
    if sinks is None:
        out = acc / jnp.where(l == 0, 1.0, l)[..., None]  # [B, G, R, T, D]
    else:
        out = acc / (l + jnp.exp(_sink_logits(sinks, G)[:, :, None] - m))[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, G * R, D).astype(dtype)


def _sink_logits(sinks, G: int):
    """Attention sinks [H] -> float32 [G, R], as the queries' heads are grouped."""
    return sinks.astype(jnp.float32).reshape(G, -1)


# ---- kernels --------------------------------------------------------------------------
#
# Status: cuDNN ran on one H200 at 975b50f (docs/bench/gpu/README.md, "After"), before the
# cache became head-major (0618341); since then no kernel has run on a GPU, nor any on a
# TPU (the TPU's are compiled here: tests/test_aot.py). So no platform takes them by default
# (MEASURED_KERNELS is empty: "auto" is portable everywhere) until docs/bench/gpu/run_all.sh's
# attention check has run at a head-major commit; a model opts in with
# Model.attention="kernels". Where cuDNN is installed (jax's CUDA plugin), `choose` gives it
# every pass it applies to, a cached pass of few tokens included (`pass_view` then masks the
# whole cache for it); the Pallas prefix kernel takes the cached passes cuDNN does not (a
# soft-cap, head_dim over 128, float32), and every cached pass of a GPU program lowered here
# without the plugin, and every cached pass over a paged cache (cuDNN and splash read rows; the
# paged prefix kernels never ran either). The constraints below are those the kernels
# document or check (cuDNN's flash attention; the splash kernel's 128-lane blocks).

# Where Model.attention="auto" takes the kernels: {platform: dtypes} whose kernels have been
# measured on their hardware at the code as it stands. Empty: see the status above.
MEASURED_KERNELS: dict = {}
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jaxlib.cuda")  # where jax finds CUDA (and cuDNN)
SPLASH_BLOCK = 128  # splash attention's query and key block (a multiple of the TPU's 128 lanes)


def takes_kernels(attention: str, dtype, backend: Backend) -> bool:
    """Whether a model of Model.attention `attention` (its activations in `dtype`) may take
    the kernels of `backend`'s platform: "kernels" anywhere, "auto" where they were measured
    (MEASURED_KERNELS) on one device (a sharded program's kernels have not been), "portable"
    never; nowhere under backend.portable. Which kernel, if any, applies to a pass is
    `choose`'s and `_prefix_kernel`'s business."""
    if backend.portable:
        return False
    if attention == "auto":
        return backend.mesh is None and jnp.dtype(dtype) in MEASURED_KERNELS.get(backend.platform, ())
    return attention == "kernels"


def _prefix_kernel(backend: Backend, B: int, cache_shape: tuple, rules, scale: float, cap: float | None,
                   interpret: bool, pages=None):
    """The Pallas prefix kernel that takes a cached pass of B rows over a cache of
    cache_shape [B', G, S, D], as a function (qg, cache_k, cache_v, prefix, floor) -> the
    prefix's online-softmax state (`prefix_kernel.state`), or None: the portable path.
    pages: a paged cache's page table int32 [B, M] (cache_shape is then a pool's, [P, G,
    page, D]), which the function reads the pools through (the paged kernel).

    On one device: where backend's platform has a kernel that applies
    (`prefix_kernel.applies`). In a sharded program (backend.mesh): under
    `shard_map`, each device running it on its own rows and kv heads, the cache split as the
    model's rules lay it (sharding.CACHE_AXES: rows over `data`, kv heads over `model`), so
    that nothing moves between devices; only where a device holds whole rows of whole kv
    heads (the cache's slots and head_dim not split), the pass's rows are all the cache's
    (B = B'), and the model knows its rules (`Model.rules`: `shard_model` sets them). A paged
    cache likewise: its pools split as `sharding.cache_axes` lays them (kv heads over `model`,
    their pages whole on every device), its table's rows as the pass's."""
    mesh = backend.mesh
    _, G, S, D = cache_shape
    page = None if pages is None else S
    S = S if pages is None else S * pages.shape[1]
    if backend.portable or not prefix_kernel.applies(backend.platform, S, G, D, page):
        return None
    run = functools.partial(prefix_kernel.state, backend.platform, scale=scale, cap=cap, interpret=interpret)
    if mesh is None:
        return run if pages is None else functools.partial(run, pages=pages)
    if rules is None or (pages is None and cache_shape[0] != B):
        return None
    if pages is None:
        rows, heads, slots, dims = sharding.spec(cache_shape, sharding.CACHE_AXES, mesh, rules)
        cache = PartitionSpec(rows, heads)  # the cache [B, G, S, D]
    else:  # pools [P, G, page, D] as cache_axes lays them; the table [B, M] by its rows
        _, heads, slots, dims = sharding.spec(cache_shape, (None, "kv_heads", None, "head_dim"), mesh, rules)
        rows = sharding.spec(pages.shape, ("batch", None), mesh, rules)[0]
        cache = PartitionSpec(None, heads)
    if slots is not None or dims is not None:
        return None
    heads_first = PartitionSpec(rows, heads)  # the state [B, G, ...]
    q, row = PartitionSpec(rows, None, heads), PartitionSpec(rows)  # qg [B, T, G, R, D]; prefix [B], floor [B, T]
    table = () if pages is None else (pages,)

    def sharded(qg, cache_k, cache_v, prefix, floor):
        floors = () if floor is None else (floor,)  # shard_map takes arrays only

        def local(qg, k, v, prefix, *rest):  # rest: (floor,) then (pages,), where given
            return run(qg, k, v, prefix, rest[0] if floors else None, pages=rest[-1] if table else None)
        return jax.shard_map(local, mesh=mesh, in_specs=(q, cache, cache, row) + (row,) * len(floors) + (row,) * len(
            table), out_specs=(heads_first,) * 3, check_vma=False)(qg, cache_k, cache_v, prefix, *floors, *table)
    return sharded


def choose(backend: Backend, dtype, T: int, S: int, D: int, cap: float | None, sinks: bool = False) -> str:
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
      platform in a sharded program (GSPMD partitions plain XLA ops, not a cuDNN or Mosaic
      custom call) or under backend.portable; and a model with attention sinks (`sinks`:
      gpt-oss), which neither kernel takes (each returns its output normalised, without the
      log-sum-exp a sink would join).
    backend: the program's (backend.py)."""
    dtype = jnp.dtype(dtype)
    if backend.portable or backend.mesh is not None or sinks:
        return "portable"
    if (backend.platform == "gpu" and dtype in (jnp.bfloat16, jnp.float16) and D <= 128 and D % 8 == 0
            and cap is None and _cudnn_available()):
        return "cudnn"
    if (backend.platform == "tpu" and dtype in (jnp.bfloat16, jnp.float32) and T % SPLASH_BLOCK == 0
            and S % SPLASH_BLOCK == 0 and D % 128 == 0 and _splash_module() is not None):
        return "splash"
    return "portable"


def _cudnn_available() -> bool:
    """Whether cuDNN's attention can be traced here: jax's CUDA plugin (with cuDNN) is
    installed (the packages jax itself looks for). Without it a program for a GPU (lowered
    here for "cuda": aot.py) takes the Pallas prefix kernel or the portable path."""
    return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


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
    whole cache; the mask already hides what lies past. Keys heads first are handed to the
    public function as [B, S, G, D] views: XLA may give cuDNN a transposed copy of the cache
    (jax's private cuDNN binding reads BNSH in place, but only the public API is used here;
    whether the copy happens on a GPU is for the attention check of docs/bench/gpu/run_all.sh
    to show, and why cuDNN is opt-in there: MEASURED_KERNELS)."""
    B = q.shape[0]
    lengths = None if kv_limit is None else jnp.broadcast_to(kv_limit, (B,)).astype(jnp.int32)
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
