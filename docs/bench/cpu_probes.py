"""Two probes of this CPU behind docs/bench/step_profile.txt, outside specjax's programs.

matmul: XLA's CPU products x [N, E] with weights of the shipped target's shapes (qkv as
[M, E], the MLP's gate/up [E, 2F], the tied head [V, E]) at N = 1, 8 and 40 rows, each over
enough distinct weights (64 MB) that they come from memory, not cache: median time, the
weights' bytes over it, and the rate in GFLOP/s. OPTIONS (JSON): XLA options for the
programs (`jax.jit(compiler_options=...)`), e.g. '{"xla_cpu_use_onednn": true}'.

layout: one attention block of 256 cached slots for 8 rows (G=2 kv heads of 3 query heads,
head_dim 64, 12 distinct layers' caches, 51 MB), as `attention.cached_attention` computes it
(the [B, S, G, D] block relaid for the dots) against the block read as [B, S, G D] with
block-diagonal queries (G x the flops, no relayout); twice each, alternately.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/cpu_probes.py matmul [OPTIONS]
    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/cpu_probes.py layout
"""

import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def median_ms(fn, *args, repeats: int = 15) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def matmul(options: dict):
    rng = np.random.default_rng(0)
    for N in (1, 8, 40):
        for name, shape, subscripts in (("qkv [M, E]", (640, 384), "ne,me->nm"), ("gate/up [E, 2F]", (384, 2048), "ne,ef->nf"),
                                        ("head [V, E]", (4096, 384), "ne,ve->nv")):
            copies = int(64e6 // (np.prod(shape) * 4)) + 1
            inner = shape[1] if subscripts.split(",")[1][1] == "e" else shape[0]
            x = jnp.asarray(rng.standard_normal((N, inner)), jnp.float32)
            ws = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(copies)]
            f = jax.jit(lambda x, ws: sum(jnp.einsum(subscripts, x, w).sum() for w in ws), compiler_options=options)
            t = median_ms(f, x, ws) / 1e3 / copies
            print(f"N={N:2d} {name:16s} {1e6 * t:7.1f} us  {np.prod(shape) * 4 / t / 1e9:5.1f} GB/s  "
                  f"{2 * N * np.prod(shape) / t / 1e9:6.1f} GFLOP/s", flush=True)


def layout():
    B, S, G, R, D, T, block, L = 8, 1040, 2, 3, 64, 1, 256, 12
    rng = np.random.default_rng(0)
    caches = [jnp.asarray(rng.standard_normal((B, S, G, D)), jnp.float32) for _ in range(L)]
    q = jnp.asarray(rng.standard_normal((B, T, G, R, D)), jnp.float32)

    def relaid(q, k, v, start):
        kb, vb = (jax.lax.dynamic_slice_in_dim(x, start, block, 1) for x in (k, v))
        s = jnp.einsum("btgrd,bsgd->bgrts", q, kb)
        return jnp.einsum("bgrts,bsgd->bgrtd", jnp.exp(s - s.max(-1, keepdims=True)), vb)

    def block_diagonal(q, k, v, start):
        eye = jnp.eye(G, dtype=q.dtype)
        qb = jnp.einsum("btgrd,gh->bgrthd", q, eye).reshape(B, G * R * T, G * D)
        kb, vb = (jax.lax.dynamic_slice_in_dim(x, start, block, 1).reshape(B, block, G * D) for x in (k, v))
        s = jnp.einsum("bmc,bnc->bmn", qb, kb)
        out = jnp.einsum("bmn,bnc->bmc", jnp.exp(s - s.max(-1, keepdims=True)), vb).reshape(B, G, R, T, G, D)
        return jnp.einsum("bgrthd,gh->bgrtd", out, eye)

    np.testing.assert_allclose(relaid(q, caches[0], caches[1], 0), block_diagonal(q, caches[0], caches[1], 0),
                               rtol=1e-4, atol=1e-4)
    for attend in (relaid, block_diagonal, relaid, block_diagonal):
        f = jax.jit(lambda q, caches, start, attend=attend: sum(
            attend(q, caches[i], caches[(i + 1) % L], start).sum() for i in range(L)))
        print(f"{attend.__name__:15s} {median_ms(f, q, caches, jnp.int32(0), repeats=20):.2f} ms for {L} "
              f"layers' blocks", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["matmul"]:
        matmul(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
    elif sys.argv[1:2] == ["layout"]:
        layout()
    else:
        sys.exit(__doc__)
