"""One engine call's cost per step with the caches in pages against max_len-sized rows (issue
58: "the engine's step at the same rows costs no more with pages than without, within 10%"),
interleaved in one run on this machine: the shipped pair (float32, greedy), the same slots
and max_len, every row live with a prompt of --prompt tokens; paged rows hold shuffled pages
of a pool (as a pool that has served a while hands them out), dense rows their own buffers.
For each K (0: the target alone; the profile's draft K) and width: the median of
--rounds rounds of a call's milliseconds over the steps it took, dense and paged calls
alternating.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/paged_step.py [--slots 8] [--prompt 256]
        > docs/bench/paged_step.txt
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

import specjax
from shipped_pair import load_pair

PAGE = 16


def filled(engine, prompt, seed: int):
    """The engine's state with every slot live on `prompt` (greedy, to max_len), a paged
    engine's rows on shuffled pages: -> (state, table or None)."""
    programs = engine.programs
    stops = np.full((1, programs.stop_width), -1, np.int32)
    row = programs.prefill([prompt], [programs.max_len], [(0.0, 0, 1.0)], stops, [0])
    table = None
    if programs.paging is not None:
        width = programs.table_width
        ids = np.random.default_rng(seed).permutation(np.arange(1, programs.paging[0]))[:engine.slots * width]
        table = ids.reshape(engine.slots, width).astype(np.int32)
    state = programs.empty()
    for slot in range(engine.slots):
        state = programs.insert(state, [slot], row, table)
    return state


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    target, draft, _ = load_pair()
    prompt = np.random.default_rng(0).integers(3, target.config.vocab_size, args.prompt).astype(np.int32)
    K = specjax.Engine(target, draft=draft, slots=1, max_len=args.max_len).k_table[0]
    table = (K,) * (args.slots - 1) + (0,)  # K = 0 compiled too
    engines = {"dense": specjax.Engine(target, draft=draft, slots=args.slots, max_len=args.max_len,
                                       num_draft_tokens=table),
               "paged": specjax.Engine(target, draft=draft, slots=args.slots, max_len=args.max_len,
                                       num_draft_tokens=table, kv_cache_bytes=2 ** 40, page_size=PAGE)}  # every row at max_len
    print(f"# {' '.join(os.sys.argv)}")
    print(f"# shipped pair, float32, greedy; {args.slots} slots of max_len {args.max_len}, each live on a "
          f"{args.prompt}-token prompt; K={K} and 0; {jax.devices()[0].device_kind}")
    states = {name: filled(engine, prompt, 1) for name, engine in engines.items()}
    programs = {name: engine.programs for name, engine in engines.items()}
    for name in engines:  # compile every (K, width) run
        for k in sorted(programs[name].drafters):
            for w in programs[name].widths:
                states[name] = programs[name].run(states[name], k, w, "greedy")[0]
        jax.block_until_ready(states[name])
    # every call starts from the same filled state: its rows never reach max_len
    fresh = {name: filled(engine, prompt, 1) for name, engine in engines.items()}
    times = {(name, k, w): [] for name in engines for k in sorted(programs[name].drafters)
             for w in programs[name].widths}
    for _ in range(args.rounds):
        for k in sorted(programs["dense"].drafters):
            for w in programs["dense"].widths:
                for name in engines:
                    state = jax.tree.map(lambda x: x.copy(), fresh[name])
                    jax.block_until_ready(state)
                    start = time.perf_counter()
                    state, *_, taken, _, _ = programs[name].run(state, k, w, "greedy")
                    taken = int(taken)
                    times[(name, k, w)].append(1e3 * (time.perf_counter() - start) / max(taken, 1))
    print(f"{'K':>2} {'rows':>4} {'dense ms/step':>14} {'paged ms/step':>14} {'paged/dense':>12}")
    for k in sorted(programs["dense"].drafters):
        for w in programs["dense"].widths:
            d, p = (float(np.median(times[(name, k, w)])) for name in ("dense", "paged"))
            print(f"{k:>2} {w:>4} {d:14.2f} {p:14.2f} {p / d:11.2f}x", flush=True)


if __name__ == "__main__":
    main()
