"""One admission into the engine, timed: the prefill of a 50-token prompt (bucket 64) and its
insert into an 8-slot state, the shipped pair, float32; the median of 40 after 3 warm-ups.

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

    def admit(state):
        row = programs.prefill(prompt, 60, (0.0, 0, 1.0), stops, 7)
        return jax.block_until_ready(programs.insert(state, 3, row))

    times = []
    for i in range(43):
        start = time.perf_counter()
        state = admit(state)
        times.append(time.perf_counter() - start)
    print(f"{name}: one admission (prefill + insert) {1e3 * statistics.median(times[3:]):.2f} ms median")
