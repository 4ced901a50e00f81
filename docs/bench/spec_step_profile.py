"""Where a speculative engine step's time goes on this CPU: the shipped pair (float32, greedy)
in an engine of --slots rows of paged caches (pages of 16), its first --width rows live on a
--prompt-token prompt, --k drafted tokens a step; its run program traced by jax.profiler,
each XLA thunk's time (less the thunks nested in it) summed per step by the phase of the step
it computes (the op's HLO metadata: draft model, target, acceptance, ...), and by op.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/spec_step_profile.py [--k 4] [--width 8]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import specjax  # noqa: E402
from shipped_pair import load_pair  # noqa: E402
from specjax.serve import programs as P  # noqa: E402
from step_profile import instructions, report, traced  # noqa: E402

CALLS = 10


def phase(op: str, depth: int) -> str:
    """The first `depth` scopes of an op's name, less jit's and the loops' own."""
    parts = [p for p in op.split("/") if not re.match(r"(jit\(|while|body|cond|closed_call|pjit)", p)]
    return "/".join(parts[:depth]) or op


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--depth", type=int, default=2, help="scopes of an op's name that name its phase")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    target, draft, _ = load_pair()
    engine = specjax.Engine(target, draft=draft if args.k else None, slots=args.slots, max_len=1024,
                            num_draft_tokens=(args.k,) * args.slots if args.k else None, kv_cache_bytes=2 ** 40,
                            page_size=16, steps_per_call=args.steps)
    p = engine.programs
    prompt = np.random.default_rng(0).integers(3, target.config.vocab_size, args.prompt).astype(np.int32)
    stops = np.full((1, p.stop_width), -1, np.int32)
    width = p.table_width
    pages = np.random.default_rng(1).permutation(np.arange(1, p.paging[0]))[:args.slots * width]
    table = pages.reshape(args.slots, width).astype(np.int32)
    state = p.empty()
    for s in range(args.width):  # a chunk a call, then admitted with the last (as the engine does)
        start = 0
        while p.chunk and len(prompt) - start > p.chunk:
            state, start = p.prefill_chunk(state, s, prompt, start, table), start + p.chunk
        state = p.admit(state, [s], [prompt], [start], [1020], [specjax.sampling.Settings()], stops, [0], table)
    run = lambda state: p.run(state, args.k, args.width, "greedy")  # noqa: E731
    for _ in range(3):
        state = run(state)[0]
    jax.block_until_ready(state)
    start, steps = time.perf_counter(), 0
    for _ in range(CALLS):
        state, *_, taken, _, _ = run(state)
        steps += int(taken)
    print(f"K={args.k} width {args.width}, prompt {args.prompt}: "
          f"{1e3 * (time.perf_counter() - start) / steps:.2f} ms per step untraced")
    hlo = P.run_steps.lower(p.target, p.drafters[args.k], p.deepest, state, p.threshold, np.int32(p.steps_per_call),
                       steps=p.steps_per_call, open_steps=p.open_steps, width=args.width, kind="greedy",
                       backend=p.backend, rules=None).compile().as_text()
    what, steps = instructions(hlo), 0

    def calls():
        nonlocal state, steps
        for _ in range(CALLS):
            state, *_, taken, _, _ = run(state)
            steps += int(taken)

    own = traced(calls)
    phases, ops = collections.Counter(), collections.Counter()
    for name, us in own.items():
        if name in what:
            shape, op = what[name]
            phases[phase(op, args.depth)] += us
            ops[(re.sub(r"\.\d+$", "", name), shape, phase(op, 6))] += us
    report(phases, "phase", ops, steps, args.top)


if __name__ == "__main__":
    main()
