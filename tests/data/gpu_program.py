"""Writes tests/data/gpu_program.hlo: a small program as XLA optimises it for an H100, for
test_aot's checks of `hlo.kernels` (a gather from a table, an in-place scatter into a donated
buffer, a loop of a known trip count slicing a buffer, a matmul). Needs jax's CUDA plugin
(pip install 'jax[cuda12]'), no GPU:

    JAX_PLATFORMS=cpu python tests/data/gpu_program.py
"""

import os

import jax
import jax.numpy as jnp

from specjax.tools import aot

TABLE, BUFFER, LOOPED, WEIGHT = (4096, 256), (8, 2048, 128), (16, 4096, 128), (256, 1024)
TRIPS = 8


def program(table, ids, buffer, slots, looped, weight):
    rows = table[ids]  # [8, 256]: a gather of 8 rows
    buffer = buffer.at[jnp.arange(8), slots].set(rows[:, :128])  # [8, 2048, 128]: 8 entries written

    def body(i, total):  # reads one [16, 512, 128] block of `looped` a trip
        return total + jax.lax.dynamic_slice_in_dim(looped, i * 512, 512, 1).sum(1)

    total = jax.lax.fori_loop(0, TRIPS, body, jnp.zeros((16, 128)))
    return rows @ weight, buffer, total


if __name__ == "__main__":
    device = aot.gpu_slice("h100").devices[0]
    where = jax.sharding.SingleDeviceSharding(device)
    shape = lambda s, dtype=jnp.float32: jax.ShapeDtypeStruct(s, dtype, sharding=where)  # noqa: E731
    compiled = jax.jit(program, donate_argnums=2).lower(
        shape(TABLE), shape((8,), jnp.int32), shape(BUFFER), shape((8,), jnp.int32), shape(LOOPED),
        shape(WEIGHT)).compile()
    with open(os.path.join(os.path.dirname(__file__), "gpu_program.hlo"), "w") as f:
        f.write(compiled.as_text())
