"""How long an engine's programs take on this device, measured once they are compiled: each
K's step at each run width (`step_costs`: what a call's length and K table are chosen at),
and what a prefill call costs beyond its tokens (`call_tokens`: what `Programs.partition`
groups bursts by). It knows `Programs`' calls and shapes; nothing of requests or threads.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from specjax.sampling import Settings


def call_tokens(programs, state, skip=()) -> tuple:
    """(state, `call_tokens` on this device): admissions (prefill and insert into `state`)
    of one row and of the most, in the shortest bucket and in the one 4x longer (where
    bursts' prompts are grouped), timed (the fastest of 3 each; compiled already); the
    least-squares line of their times over their token slots gives a call's cost beyond
    its tokens (the intercept) in tokens (over the slope). Those in `skip` (not compiled
    yet) are left out."""
    points = {(n, b) for n in (1, max(programs.prefill_sizes)) for b in (programs.buckets[0], programs.buckets[:3][-1])}
    points = (points & set(programs.sizes)) - set(skip)
    slots, times = [], []
    for n, b in sorted(points):
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            state = programs.dummy_admit(state, n, b)
            runs.append(time.perf_counter() - start)
        slots.append(n * b)
        times.append(min(runs))
    if len(set(slots)) < 2:
        return state, programs.most_tokens
    per_token, per_call = np.polyfit(slots, times, 1)
    if per_token <= 0:
        return state, programs.most_tokens
    return state, float(min(programs.most_tokens, max(0.0, per_call) / per_token))


def step_costs(programs, calls: int = 5) -> dict[int, dict[int, float]]:
    """Milliseconds of one step of each run program, {K: {width: ms}}, on this device:
    the median over `calls` calls (after one that warms) of a call's time over the steps
    it took, its first `width` rows live (a prompt of the shortest bucket each, greedy,
    limited only by max_len), the rest free, as the engine runs them. A step's cost does
    not depend on what it accepts (its shapes are fixed). A (K, width) whose rows all
    finish before any call is timed is left out. Run after `compile_all` (no compiles)."""
    request = ([np.ones((programs.buckets[0],), np.int32)], [programs.max_len], [Settings()],
               np.full((1, programs.stop_width), -1, np.int32), [0])
    row = programs.prefill(*request) if programs.paging is None else None
    state, costs = programs.empty(), {}
    for K in sorted(programs.drafters):
        costs[K] = {}
        for w in programs.widths:
            state = programs.release(state, range(programs.slots))
            for slot in range(w):  # (paged: into the null pages, as timing wants no more)
                state = (programs.insert(state, [slot], row) if row is not None
                         else programs.admit(state, [slot], request[0], [0], *request[1:]))
            times = []
            for call in range(calls + 1):
                start = time.perf_counter()
                state, emitted = programs.run(state, K, w, "greedy")
                taken = int(emitted.taken)  # waits for the call
                if call and taken:
                    times.append(1e3 * (time.perf_counter() - start) / taken)
            if times:
                costs[K][w] = float(np.median(times))
    jax.block_until_ready(state)
    return costs
