"""Admissions into the engine, timed: the prefill of 50-token prompts (bucket 64) and their
insert into an 8-slot state, one request per call and eight together (a burst), the shipped
pair, float32; the median of 40 after 3 warm-ups, per request.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/engine_admission.py
"""

import statistics
import time
from pathlib import Path

import jax
import numpy as np

import specjax

ROOT = Path(__file__).resolve().parents[2]
target = specjax.load_model(ROOT / "checkpoints" / "target")
draft = specjax.DraftModel.load(ROOT / "checkpoints" / "draft")
for name, d in (("plain", None), ("draft", draft)):
    programs = specjax.Engine(target, draft=d, slots=8, max_len=192, num_draft_tokens=None if d is None else 4).programs
    state, prompt = programs.empty(), np.arange(5, 55, dtype=np.int32)
    stops = np.full((programs.stop_width,), -1, np.int32)

    def admit(state, n):
        rows = programs.prefill([prompt] * n, [60] * n, [(0.0, 0, 1.0)] * n, np.stack([stops] * n), [7] * n)
        return jax.block_until_ready(programs.insert(state, list(range(n)), rows))

    for n in (1, 8):
        times = []
        for i in range(43):
            start = time.perf_counter()
            state = admit(state, n)
            times.append(time.perf_counter() - start)
        print(f"{name}: {n} admitted per call (prefill + insert): {1e3 * statistics.median(times[3:]) / n:.2f} ms "
              f"per request, median")
