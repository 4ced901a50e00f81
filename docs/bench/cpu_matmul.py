"""Why eight rows cost more than one on this CPU: one MLP-sized matmul of the shipped target
(x [M, 384] times a [384, 2048] weight, float32) at M = 1 and 8, timed per weight over 12
distinct weights (38 MB, more than the 32 MB L3: every call reads them from memory), in
XLA's default CPU dot and with its other dot libraries (compiler options, no XLA_FLAGS), and
with the weight stored transposed ([2048, 384], the output [2048, M]). Medians of 5 rounds
of 100 calls, the variants interleaved.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/cpu_matmul.py
"""

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

E, F2, N = 384, 2048, 12
OPTIONS = {"default (ynn)": {}, "ynn off (Eigen)": {"xla_cpu_experimental_ynn_fusion_type": ""},
           "XNNPACK": {"xla_cpu_use_xnnpack": True, "xla_cpu_experimental_ynn_fusion_type": ""}}


def main():
    key = jax.random.key(0)
    w = [jax.random.normal(jax.random.fold_in(key, i), (E, F2), jnp.float32) for i in range(N)]
    wt = [jnp.asarray(np.asarray(a).T) for a in w]
    for M in (1, 8):
        x = jax.random.normal(key, (M, E), jnp.float32)
        calls = {name: (jax.jit(lambda ws, x: [x @ a for a in ws]).lower(w, x).compile(compiler_options=o), w)
                 for name, o in OPTIONS.items()}
        calls["weight [2048, 384], out [2048, M]"] = (jax.jit(lambda ws, x: [a @ x.T for a in ws]), wt)
        times = {name: [] for name in calls}
        for r in range(6):
            for name, (f, ws) in calls.items():
                jax.block_until_ready(f(ws, x))
                start = time.perf_counter()
                for _ in range(100):
                    out = f(ws, x)
                jax.block_until_ready(out)
                if r:
                    times[name].append((time.perf_counter() - start) / 100 / N * 1e3)
        for name, t in times.items():
            ms = float(np.median(t))
            print(f"M={M}: {name:36s} {ms:.3f} ms a weight, {2 * M * E * F2 / ms / 1e6:6.1f} GFLOP/s, "
                  f"{4 * E * F2 / ms / 1e6:5.1f} GB/s of weight")


if __name__ == "__main__":
    main()
