"""The engine's run calls of eight live rows at K = 0..3 (the shipped pair, greedy, serve_load's
prompts, each row a prompt of its own from its first token on): ms per step, tokens per row
and step, and tokens per ms; 15 calls of 4 steps per K and round, K in turn, medians of 3
rounds (a fourth, first, warms). What the cost profile prices from generate's loop on held-out
text, measured here through the engine's own programs on the load's text.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/engine_k.py [--ks 0,1,2,3] [--rows 8]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import specjax  # noqa: E402
from serve_load import prompts  # noqa: E402
from specjax.serve import programs as P  # noqa: E402
from specjax.shipped import default_checkpoint  # noqa: E402

STEPS, CALLS = 4, 15


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ks", default="0,1,2,3")
    p.add_argument("--rows", type=int, default=8)
    args = p.parse_args()
    Ks, W = [int(k) for k in args.ks.split(",")], args.rows
    target = specjax.load_model(default_checkpoint("target"))
    tokenizer = specjax.load_tokenizer(default_checkpoint("target"))
    ids = [np.asarray(tokenizer.encode(t), np.int32) for t in prompts(W)]
    draft = specjax.DraftModel.load(default_checkpoint("draft")).bind(target)
    programs = {K: P.Programs(target, {K: None if K == 0 else draft.resolve(K)}, 8, 1024, 4, STEPS, 0.0) for K in Ks}
    stops = np.full((1, 4), -1, np.int32)
    results = {K: [] for K in Ks}
    for r in range(4):
        for K in Ks:
            p = programs[K]
            state = p.empty()
            for s in range(W):
                state = p.insert(state, [s], p.prefill([ids[s]], [1000], [(0.0, 0, 1.0)], stops, [0]))
            before = int(np.asarray(state.length)[:W].sum())
            start = time.perf_counter()
            for _ in range(CALLS):
                state = p.run(state, K, W, "greedy")[0]
            jax.block_until_ready(state)
            seconds = time.perf_counter() - start
            tokens = int(np.asarray(state.length)[:W].sum()) - before
            if r:
                results[K].append((1e3 * seconds / (CALLS * STEPS), tokens / (CALLS * STEPS * W), tokens / seconds / 1e3))
    plain = np.median(np.array(results[Ks[0]]), 0)[2]
    for K in Ks:
        ms, per_row, rate = np.median(np.array(results[K]), 0)
        print(f"{W} rows, K={K}: {ms:6.2f} ms a step, {per_row:.2f} tokens a row and step, {rate:.3f} tokens/ms "
              f"({rate / plain:.2f}x K={Ks[0]})")


if __name__ == "__main__":
    main()
