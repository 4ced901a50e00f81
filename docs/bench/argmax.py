"""sampling.argmax against jnp.argmax on this CPU: microseconds per call inside a compiled
fori_loop of 1000 (so no dispatch is counted), for one 4096-token row (a greedy draft step
at batch 1) and 6 rows (verifying a chain of 5), median of 15 runs; and a check that both
give the same index.

    python docs/bench/argmax.py > docs/bench/argmax.txt
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling import argmax

N = 1000


def per_call_us(reduce, x):
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, N, lambda i, x: x + reduce(x)[..., None] * 1e-9, x))
    jax.block_until_ready(loop(x))
    runs = []
    for _ in range(15):
        start = time.perf_counter()
        jax.block_until_ready(loop(x))
        runs.append((time.perf_counter() - start) / N * 1e6)
    return statistics.median(runs)


def main():
    print(f"{jax.default_backend()}, jax {jax.__version__}: us per call inside a loop")
    for shape in ((1, 4096), (6, 4096)):
        x = jax.random.normal(jax.random.key(0), shape)
        same = np.array_equal(argmax(x), jnp.argmax(x, axis=-1))
        print(f"{str(shape):10s} jnp.argmax {per_call_us(lambda x: jnp.argmax(x, axis=-1), x):6.2f}  "
              f"sampling.argmax {per_call_us(argmax, x):6.2f}  same index {same}")


if __name__ == "__main__":
    main()
