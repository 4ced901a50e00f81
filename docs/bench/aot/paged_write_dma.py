"""Can a Pallas kernel write a paged pass's new K/V into the head-major pool [P, G, page, D]
by DMA, one token's [G, 1, D] entry a copy (so that a TPU program's write no longer unrolls
B*T updates a layer)? `python paged_write_dma.py cpu`: the kernel in Pallas's TPU interpret
mode against a scatter; `python paged_write_dma.py tpu`: compiled for one v5e chip by libtpu
(needs no TPU). Output: paged_write_dma.txt.
"""
import os, sys, time
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

def _kernel(pages_ref, slots_ref, new_ref, pool_in, pool_out, sem):
    # pages_ref, slots_ref: SMEM int32 [N]; new_ref: HBM [N, G, 1, D]; pool: HBM [P, G, page, D]
    n = pages_ref.shape[0]
    def copy(i):
        return pltpu.make_async_copy(new_ref.at[i], pool_out.at[pages_ref[i], :, pl.ds(slots_ref[i], 1), :], sem)
    def start(i, c):
        copy(i).start(); return c
    def wait(i, c):
        copy(i).wait(); return c
    jax.lax.fori_loop(0, n, start, 0)
    jax.lax.fori_loop(0, n, wait, 0)

def write(pool, new, pages, slots, interpret=False):
    """pool [P, G, page, D]; new [N, G, 1, D]; pages, slots int32 [N]."""
    N = new.shape[0]
    kw = dict(interpret=pltpu.InterpretParams()) if interpret else {}
    return pl.pallas_call(
        _kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA]),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={3: 0}, **kw)(pages, slots, new, pool)

if sys.argv[1] == "cpu":
    P, G, S, D, N = 6, 2, 4, 8, 5
    pool = jnp.arange(P*G*S*D, dtype=jnp.float32).reshape(P, G, S, D)
    new = -jnp.arange(N*G*D, dtype=jnp.float32).reshape(N, G, 1, D) - 1
    pages = jnp.array([1, 3, 3, 5, 0], jnp.int32); slots = jnp.array([0, 2, 3, 1, 0], jnp.int32)
    got = write(pool, new, pages, slots, interpret=True)
    want = pool.at[pages, :, slots].set(new[:, :, 0])
    print("equal", bool((got == want).all()))
else:
    from specjax.tools import aot
    dev = aot.tpu_slice("v5e:1x1").devices[0]
    from jax.sharding import SingleDeviceSharding
    sh = SingleDeviceSharding(dev)
    for N in (8, 64, 512):
        P, G, S, D = 1001, 8, 16, 128
        args = (jax.ShapeDtypeStruct((P, G, S, D), jnp.bfloat16, sharding=sh), jax.ShapeDtypeStruct((N, G, 1, D), jnp.bfloat16, sharding=sh),
                jax.ShapeDtypeStruct((N,), jnp.int32, sharding=sh), jax.ShapeDtypeStruct((N,), jnp.int32, sharding=sh))
        t = time.perf_counter()
        c = jax.jit(write, donate_argnums=0).lower(*args).compile()
        m = c.memory_analysis()
        print(N, "compile s", round(time.perf_counter()-t, 2), "temp", m.temp_size_in_bytes, "alias", m.alias_size_in_bytes, "hlo chars", len(c.as_text()))
