"""How a burst of waiting requests is prefilled: one call for all of them, in the bucket of
the longest prompt (the engine before `Programs.partition`), against the partition into
groups that costs least by the measured cost of a call (`Programs.call_tokens`).

The shipped target, plain, 8 slots of 1,024 positions, float32. First the admission (prefill
and insert) of n requests in bucket b, timed, beside the linear model the partition assumes
(n b token slots plus call_tokens per call). Then the 32 prompts of serve_load.py, in the
order it sends them, as 4 bursts of 8 (8 clients whose requests end together, as they do
there): each burst admitted both ways, alternately, median of 5; its time is what the
burst's first tokens wait for before the first step.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/prefill_groups.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import specjax  # noqa: E402
from serve_load import prompts  # noqa: E402
from specjax.shipped import default_checkpoint  # noqa: E402


def main():
    target = specjax.load_model(default_checkpoint("target"))
    tokenizer = specjax.load_tokenizer(default_checkpoint("target"))
    engine = specjax.Engine(target, slots=8, max_len=1024).compile_all()
    p = engine.programs
    print(f"call_tokens measured by compile_all: {p.call_tokens:.1f}")
    state = p.empty()
    stops = np.full((8, p.stop_width), -1, np.int32)

    def admit(ids: list[list[int]], sizes: list[int]) -> float:
        nonlocal state
        start = time.perf_counter()
        for n in sizes:
            group, ids = ids[:n], ids[n:]
            rows = p.prefill([np.asarray(x, np.int32) for x in group], [len(x) + 128 for x in group],
                             [(0.0, 0, 1.0)] * n, stops[:n], [0] * n)
            state = p.insert(state, list(range(n)), rows)
        jax.block_until_ready(state)
        return time.perf_counter() - start

    print("admission of n requests in bucket b (prefill + insert), median of 5, ms; model: (n b + call_tokens) x slope")
    measured = {}
    for b in (16, 32, 64, 128):
        for n in (1, 2, 4, 8):
            ids = [list(range(1, b + 1))] * n
            admit(ids, [n])
            measured[n, b] = statistics.median(admit(ids, [n]) for _ in range(5))
    slope = np.polyfit([n * b for n, b in measured], list(measured.values()), 1)
    print(f"least squares over the table: {1e3 * slope[0]:.3f} ms a token slot, {1e3 * slope[1]:.2f} ms a call "
          f"= {slope[1] / slope[0]:.1f} token slots")
    for (n, b), t in measured.items():
        print(f"  n={n} b={b:4d}: {1e3 * t:7.2f} ms   model {1e3 * slope[0] * (n * b + p.call_tokens):7.2f}")

    ids = [tokenizer.encode(text) for text in prompts(32)]
    totals = {"one call": 0.0, "partition": 0.0}
    print("bursts of 8 (serve_load's prompts in order): admission ms, median of 5")
    for w in range(4):
        burst = sorted(ids[8 * w:8 * w + 8], key=len)
        ways = {"one call": [8], "partition": p.partition([len(x) for x in burst], p.call_tokens)}
        times = {name: [] for name in ways}
        admit(burst, ways["partition"])
        for _ in range(5):
            for name, sizes in ways.items():
                times[name].append(admit(burst, sizes))
        lengths = [len(x) for x in burst]
        line = []
        for name, sizes in ways.items():
            t = statistics.median(times[name])
            totals[name] += t
            line.append(f"{name} {sizes} {1e3 * t:.1f}")
        print(f"  burst {w} lengths {lengths}: " + ", ".join(line))
    print(f"total: one call {1e3 * totals['one call']:.1f} ms, partition {1e3 * totals['partition']:.1f} ms "
          f"({totals['partition'] / totals['one call']:.2f}x)")


if __name__ == "__main__":
    main()
