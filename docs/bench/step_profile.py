"""Where a step's time goes on this CPU: the engine's plain run of the shipped target
(float32, 8 slots of 1,024 positions, every row 48 prompt tokens and then ~90-170 generated)
over its first `--width` rows, traced by jax.profiler; each XLA thunk's time (less the
thunks inside it) summed by kind and by the op it computes (its HLO metadata), per step.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/step_profile.py [--width 8] [--top 12]
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import specjax  # noqa: E402
from specjax.sampling import Settings  # noqa: E402
from specjax.serve import programs as P  # noqa: E402
from specjax.shipped import default_checkpoint  # noqa: E402

CALLS, STEPS = 20, 4  # traced calls, steps per call


def self_times(trace: str) -> collections.Counter:
    """Each event name's time in microseconds, less the time of events nested inside it."""
    events = [e for e in json.load(gzip.open(trace))["traceEvents"] if e.get("ph") == "X"]
    threads = collections.defaultdict(list)
    for e in events:
        threads[e["pid"], e["tid"]].append(e)
    own = collections.Counter()
    for run in threads.values():
        run.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in run:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                own[stack[-1]["name"]] -= e["dur"]
            own[e["name"]] += e["dur"]
            stack.append(e)
    return own


def instructions(hlo: str) -> dict:
    """Compiled HLO text's instructions: name -> (shape, the op it computes: its metadata's
    op_name, or its opcode)."""
    what = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) (\S+?)\(", line)
        if m:
            op = re.search(r'op_name="([^"]+)"', line)
            what[m.group(1)] = (m.group(2), op.group(1) if op else m.group(3))
    return what


def traced(run) -> collections.Counter:
    """`self_times` of what run() dispatches (it waits for its calls), traced by jax.profiler."""
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        run()
        jax.profiler.stop_trace()
        return self_times(sorted(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True))[-1])


def report(groups: collections.Counter, label: str, ops: collections.Counter, per_step: float, top: int):
    """Prints the thunks' time per step in all, the `top` groups' ({name: us}, by `label`),
    then the `top` ops' ({(kind, shape, op): us})."""
    print(f"XLA thunks, per step: {sum(groups.values()) / per_step / 1e3:.2f} ms; by {label}:")
    for name, us in groups.most_common(top):
        print(f"  {us / per_step:8.1f} us  {name}")
    print("by op:")
    for (kind, shape, op), us in ops.most_common(top):
        print(f"  {us / per_step:8.1f} us  {kind} {shape} {op}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    target = specjax.load_model(default_checkpoint("target"))
    p = P.Programs(target, {0: None}, 8, 1024, 4, STEPS, 0.0)
    state, stops = p.empty(), np.full((1, 4), -1, np.int32)
    for s in range(args.width):
        state = p.insert(state, [s], p.prefill([np.arange(1, 49, dtype=np.int32)], [1020], [Settings()], stops, [0]))
    run = lambda state: p.run(state, 0, args.width, "greedy")[0]  # noqa: E731
    for _ in range(3 + CALLS):  # compile, warm, then as many untraced calls as will be traced
        state = run(state)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(CALLS):
        state = run(state)
    jax.block_until_ready(state)
    print(f"width {args.width}: {1e3 * (time.perf_counter() - start) / CALLS / STEPS:.2f} ms per step untraced")
    hlo = P.run_steps.lower(p.target, None, p.deepest, state, p.threshold, np.int32(STEPS), steps=STEPS, open_steps=STEPS,
                       width=args.width, kind="greedy", backend=p.backend, rules=None).compile().as_text()
    what = {name: (shape, op.replace("jit(run_steps)/while/body/", "")) for name, (shape, op) in instructions(hlo).items()}

    def calls():
        nonlocal state
        for _ in range(CALLS):
            state = run(state)
        jax.block_until_ready(state)

    own = traced(calls)
    per_step = CALLS * STEPS
    kinds, ops = collections.Counter(), collections.Counter()
    for name, us in own.items():
        if name in what:
            kinds[re.sub(r"\.\d+$", "", name)] += us
            ops[(re.sub(r"\.\d+$", "", name),) + what[name]] += us
    report(kinds, "kind", ops, per_step, args.top)


if __name__ == "__main__":
    main()
