"""What a narrow run costs: the engine's plain steps of the shipped target (float32, 1,024
positions) over the state's first `width` rows of an 8-slot state, against the same rows as
a state of exactly `width` slots (nothing to narrow), ms per step (median of 5 rounds of 10
calls of 4 steps, the cases interleaved). Equal times: a narrow run pays for no other slot.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/narrow_run.py
"""

import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import specjax  # noqa: E402
from specjax.serve.programs import Programs  # noqa: E402
from specjax.shipped import default_checkpoint  # noqa: E402


def main():
    target = specjax.load_model(default_checkpoint("target"))
    stops = np.full((1, 4), -1, np.int32)
    cases = {}
    for slots, width in ((1, 1), (8, 1), (2, 2), (8, 2), (4, 4), (8, 4)):
        p = Programs(target, {0: None}, slots, 1024, 4, 4, 0.0)
        state = p.empty()
        for s in range(width):
            rows = p.prefill([np.arange(1, 49, dtype=np.int32)], [1020], [(0.0, 0, 1.0)], stops, [0])
            state = p.insert(state, [s], rows)
        cases[slots, width] = [p, p.run(state, 0, width, "greedy")[0]]
    times = {k: [] for k in cases}
    for _ in range(5):
        for (slots, width), case in cases.items():
            p, state = case
            jax.block_until_ready(state)
            start = time.perf_counter()
            for _ in range(10):
                state = p.run(state, 0, width, "greedy")[0]
            jax.block_until_ready(state)
            times[slots, width].append((time.perf_counter() - start) / 40)
            case[1] = state
    for (slots, width), t in times.items():
        print(f"rows [:{width}] of {slots} slot(s): {1e3 * statistics.median(t):.2f} ms per step")


if __name__ == "__main__":
    main()
