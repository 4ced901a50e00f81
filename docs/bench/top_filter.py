"""Top-k then top-p over the vocabulary: one ascending sort (specjax before 2026-11-25) against
two bisections of 32 masked reductions each (sampling._filter now), jitted, float32, on this
machine's default backend; and, compiled for one v5e chip (libtpu, nothing run), each one's
temporaries and its sort ops. Median of 20 runs after a warm-up; both in one process.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/top_filter.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling
from specjax.tools.measure import median_time


def _pick(x, index):
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.max(jnp.where(iota == index, x, -jnp.inf), axis=-1, keepdims=True)


def sorted_filter(scores, top_k, top_p):
    """The filter as it was (specjax 8a7a712, sampling._filter): one ascending sort."""
    V = scores.shape[-1]
    ascending = jnp.sort(scores, axis=-1)
    k = jnp.clip(top_k, 1, V)
    kth = jnp.where(top_k > 0, _pick(ascending, V - k), -jnp.inf)
    scores = jnp.where(scores < kth, -jnp.inf, scores)
    ascending = jnp.where(ascending < kth, -jnp.inf, ascending)
    cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
    removed = jnp.sum(cumulative[..., :-1] <= 1.0 - top_p, axis=-1, keepdims=True)
    return jnp.where(scores < _pick(ascending, removed), -jnp.inf, scores)


def tpu_figures(fn, shape):
    from specjax.tools import aot

    device = aot.tpu_slice("v5e:1x1").devices[0]
    placed = jax.sharding.SingleDeviceSharding(device)
    args = (jax.ShapeDtypeStruct(shape, jnp.float32, sharding=placed),
            jax.ShapeDtypeStruct(shape[:-1] + (1,), jnp.int32, sharding=placed),
            jax.ShapeDtypeStruct(shape[:-1] + (1,), jnp.float32, sharding=placed))
    compiled = jax.jit(fn).lower(*args).compile()
    sorts = sum(" sort(" in line for line in compiled.as_text().splitlines())
    return compiled.memory_analysis().temp_size_in_bytes / 2**20, sorts


print(f"backend {jax.default_backend()}; top_k 50, top_p 0.9 on every row")
print(f"{'scores':<20} {'sort ms':>9} {'bisect ms':>10} {'ratio':>7}   v5e temps sort/bisect (MB), sort ops")
for shape in ((1, 4096), (8, 4096), (8, 5, 4096), (1, 128256), (8, 128256), (8, 5, 128256)):
    scores = jnp.asarray(np.random.RandomState(0).randn(*shape).astype(np.float32) * 3)
    top_k = jnp.full(shape[:-1] + (1,), 50, jnp.int32)
    top_p = jnp.full(shape[:-1] + (1,), 0.9, jnp.float32)
    old, new = jax.jit(sorted_filter), jax.jit(sampling._filter)
    np.testing.assert_array_equal(np.isinf(old(scores, top_k, top_p)), np.isinf(new(scores, top_k, top_p)))
    t_old, t_new = (1e3 * median_time(lambda f=f: jax.block_until_ready(f(scores, top_k, top_p)), 20)
                    for f in (old, new))
    try:
        (m_old, s_old), (m_new, s_new) = tpu_figures(sorted_filter, shape), tpu_figures(sampling._filter, shape)
        tpu = f"{m_old:7.1f} / {m_new:7.1f}, {s_old} / {s_new}"
    except Exception as e:  # noqa: BLE001 - no libtpu here
        tpu = f"(not compiled: {type(e).__name__})"
    print(f"{str(list(shape)):<20} {t_old:9.3f} {t_new:10.3f} {t_old / t_new:6.2f}x   {tpu}", flush=True)
