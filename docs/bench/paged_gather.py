"""A paged decode step's attention over its pages, in four layouts, against a dense cache read in place.

One layer's K=0 attention of B rows (1 query, 3 query heads per kv head, 2 kv heads, head_dim 64)
over 16 pages of 16 slots each, float32, on this CPU: the gather as `cache.page_blocks` does it
(pool [P, G, page, D], pages gathered then laid out [B, G, S, D]); with two index arrays (the gather
lands [B, G, n, page, D]); the products taken over the gathered [B, n, G, page, D] with no relayout;
pools laid out [G, P, page, D]; and the same attention over a dense [B, G, S, D] cache. Each checked
against the first, then timed: the median over 7 rounds of 50 calls.

    JAX_PLATFORMS=cpu python docs/bench/paged_gather.py [B]
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

B = int(sys.argv[1]) if len(sys.argv) > 1 else 8
M, PAGE, G, D, R, T = 16, 16, 2, 64, 3, 1  # pages a row, slots a page, kv heads, head_dim, queries a kv head, tokens
S, P = M * PAGE, B * M + 8


def attend(qg, k, v):  # qg [B, T, G, R, D], k/v [B, G, S, D]
    p = jax.nn.softmax(jnp.einsum("btgrd,bgsd->bgrts", qg, k), -1)
    return jnp.einsum("bgrts,bgsd->bgrtd", p, v)


def relayout(qg, pk, pv, pages):  # cache.page_blocks' way
    def rows(pool):
        return jnp.swapaxes(pool[pages], 1, 2).reshape(B, G, S, D)
    return attend(qg, rows(pk), rows(pv))


def two_index(qg, pk, pv, pages):
    def rows(pool):
        return pool[pages[:, None, :], jnp.arange(G)[None, :, None]].reshape(B, G, S, D)
    return attend(qg, rows(pk), rows(pv))


def no_relayout(qg, pk, pv, pages):
    k, v = pk[pages], pv[pages]  # [B, n, G, page, D]
    s = jnp.einsum("btgrd,bngpd->bgrtnp", qg, k).reshape(B, G, R, T, S)
    p = jax.nn.softmax(s, -1).reshape(B, G, R, T, M, PAGE)
    return jnp.einsum("bgrtnp,bngpd->bgrtd", p, v)


def heads_outer(qg, pk, pv, pages):  # pools [G, P, page, D]
    k, v = (pool[:, pages].reshape(G, B, S, D) for pool in (pk, pv))
    p = jax.nn.softmax(jnp.einsum("btgrd,gbsd->bgrts", qg, k), -1)
    return jnp.einsum("bgrts,gbsd->bgrtd", p, v)


def dense(qg, k, v, pages):  # k/v [B, G, S, D] in place
    return attend(qg, k, v)


rng = np.random.default_rng(0)
pool_k, pool_v = (jnp.asarray(rng.standard_normal((P, G, PAGE, D), np.float32)) for _ in range(2))
pages = jnp.asarray(rng.permutation(P)[:B * M].reshape(B, M).astype(np.int32))
q = jnp.asarray(rng.standard_normal((B, T, G, R, D), np.float32))
outer = tuple(jnp.transpose(pool, (1, 0, 2, 3)) for pool in (pool_k, pool_v))
whole = tuple(jnp.swapaxes(pool[pages], 1, 2).reshape(B, G, S, D) for pool in (pool_k, pool_v))
cases = {"as cache.page_blocks": (relayout, (pool_k, pool_v)), "two index arrays": (two_index, (pool_k, pool_v)),
         "no relayout": (no_relayout, (pool_k, pool_v)), "pools [G, P, page, D]": (heads_outer, outer),
         "dense cache in place": (dense, whole)}
want = np.asarray(relayout(q, pool_k, pool_v, pages))
times = {name: [] for name in cases}
for name, (fn, kv) in cases.items():
    cases[name] = (jax.jit(fn), kv)
    np.testing.assert_allclose(np.asarray(cases[name][0](q, *kv, pages)), want, rtol=1e-4, atol=1e-4)
for _ in range(7):
    for name, (fn, kv) in cases.items():
        fn(q, *kv, pages).block_until_ready()
        start = time.perf_counter()
        for _ in range(50):
            out = fn(q, *kv, pages)
        out.block_until_ready()
        times[name].append((time.perf_counter() - start) / 50 * 1e6)
for name, ts in times.items():
    print(f"B={B} {name:22s} {np.median(ts):8.1f} us")
