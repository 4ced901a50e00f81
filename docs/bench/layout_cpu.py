"""Decoding speed of two specjax checkouts side by side on this machine: the shipped pair,
float32, greedy, batch 1, 64 new tokens on 8 held-out prompts; plain decoding, a draft
chain (K=4) and a draft tree (Tree(6, 2, 20)).

Each round runs every checkout once, in a fresh process (so each imports its own
specjax), alternating the order; a process times each case as the median of --repeats
runs after a warm-up. Prints the median tok/s over rounds per checkout and case, and each
checkout's speculative speedup over its own plain decoding.

    python docs/bench/layout_cpu.py --before /path/to/old/checkout [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = ("plain", "chain K=4", "Tree(6,2,20)")


def measure(repeats: int) -> dict:
    """tok/s per case with the specjax this process imports."""
    import jax.numpy as jnp

    import specjax
    try:
        from specjax.tools import bench
    except ImportError:  # a checkout from before the tools moved apart (004df2b)
        from specjax import bench

    target = specjax.load_model(os.path.join(ROOT, "checkpoints/target"), dtype=jnp.float32)
    draft = specjax.load_model(os.path.join(ROOT, "checkpoints/draft"), dtype=jnp.float32)
    tokenizer = specjax.load_tokenizer(os.path.join(ROOT, "checkpoints/target"))
    prompts = bench.held_out_prompts(tokenizer, 8, 64, seed=3)
    out, rows = {}, {}
    for case in CASES:
        drafter, K = {"plain": (None, 0), "chain K=4": (draft, 4),
                      "Tree(6,2,20)": (specjax.DraftModel(draft, tree=specjax.Tree(6, 2, 20)), None)}[case]
        run, rows[case] = bench.time_generate(target, prompts, 1, repeats, drafter, K, case, 0.0, 64)
        out[case] = run.tokens_per_s
    out["exact"] = all(rows[c] == rows["plain"] for c in CASES)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the other checkout (its specjax/ is imported)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.repeats)))
        return
    checkouts = {"before": os.path.abspath(args.before), "after": ROOT}
    results = {name: [] for name in checkouts}
    for r in range(args.rounds):
        for name in (list(checkouts) if r % 2 == 0 else list(checkouts)[::-1]):
            env = dict(os.environ, PYTHONPATH=checkouts[name])
            line = subprocess.run([sys.executable, __file__, "--before", args.before, "--measure", "--repeats",
                                   str(args.repeats)], env=env, check=True, capture_output=True,
                                  text=True).stdout.splitlines()[-1]
            results[name].append(json.loads(line))
    print(f"shipped pair, float32, batch 1, 8 held-out prompts x 64 new tokens; median tok/s of {args.rounds} "
          f"rounds (each the median of {args.repeats} runs)")
    print(f"{'case':<14} " + " ".join(f"{n + ' (' + os.path.basename(p) + ')':>20}" for n, p in checkouts.items())
          + "   after / before")
    med = {n: {c: statistics.median(r[c] for r in rs) for c in CASES} for n, rs in results.items()}
    for case in CASES:
        print(f"{case:<14} " + " ".join(f"{med[n][case]:>20.1f}" for n in checkouts)
              + f"   {med['after'][case] / med['before'][case]:.2f}x")
    for n in checkouts:
        print(f"{n}: speculative / plain: chain {med[n]['chain K=4'] / med[n]['plain']:.2f}x, tree "
              f"{med[n]['Tree(6,2,20)'] / med[n]['plain']:.2f}x; every output equal to plain: "
              f"{all(r['exact'] for r in results[n])}")


if __name__ == "__main__":
    main()
