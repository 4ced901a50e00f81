"""The engine's host work beside its device calls (issue 59): a revision against the working
tree, side by side in one run on this machine, alternating (--rounds each, medians): the
shipped pair (float32, greedy, its draft at the cost profile's K), 8 slots, max_len 1024, a
burst of --requests requests (prompts of 16-64 held-out tokens, 8-32 new tokens each,
submitted at once), so that requests wait behind the slots for most of the burst: where the
host read each call before dispatching the next whenever requests waited, the device waited
on it. Prints each tree's burst wall time and tokens/s, and their ratio.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/host_overlap.py --against a665ca9 \\
        > docs/bench/host_overlap.txt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_LEN = 1024


def one(requests: int, seed: int) -> dict:
    """The burst on the specjax importable here (PYTHONPATH; the checkpoints are this tree's);
    -> seconds, tokens, the outputs' hash."""
    import specjax
    from shipped_pair import load_pair
    from specjax.train.data import held_out_prompts

    target, draft, tokenizer = load_pair()
    rng = np.random.default_rng(seed)
    pool = held_out_prompts(tokenizer, requests, 64, seed=seed)
    burst = [(list(p[:int(rng.integers(16, 65))]), int(rng.integers(8, 33))) for p in pool]
    engine = specjax.Engine(target, draft=draft, slots=8, max_len=MAX_LEN).compile_all()
    with engine:
        engine.submit(burst[0][0], max_new_tokens=4).result()  # warm
        start = time.perf_counter()
        submitted = [engine.submit(p, max_new_tokens=n) for p, n in burst]
        outputs = [r.result(timeout=3600) for r in submitted]
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(map(len, outputs)),
            "outputs": hashlib.sha256(str(outputs).encode()).hexdigest()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="a git revision to compare the working tree with")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.requests, args.seed)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        old = os.path.join(tmp, "old")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", old, args.against], check=True,
                       capture_output=True)
        try:
            trees = {args.against: old, "working tree": ROOT}
            runs = {name: [] for name in trees}
            for _ in range(args.rounds):
                for name, tree in trees.items():
                    env = dict(os.environ, PYTHONPATH=tree)
                    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", "--requests",
                                          str(args.requests), "--seed", str(args.seed)], env=env, check=True,
                                         capture_output=True, text=True)
                    runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", old], capture_output=True)
    print(f"# {' '.join(sys.argv)}")
    print(f"# shipped pair, float32, greedy, draft at the profile's K; 8 slots, max_len {MAX_LEN}; a burst of "
          f"{args.requests} requests (prompts 16-64 tokens, 8-32 new tokens) at once; {args.rounds} rounds, "
          f"alternating")
    medians = {}
    for name, rs in runs.items():
        seconds = [r["seconds"] for r in rs]
        medians[name] = float(np.median(seconds))
        print(f"{name}: burst {medians[name]:.2f} s (median of {', '.join(f'{s:.2f}' for s in seconds)}), "
              f"{rs[0]['tokens'] / medians[name]:.1f} tokens/s")
    old_name = args.against
    print(f"working tree / {old_name}: {medians[old_name] / medians['working tree']:.2f}x tokens/s; outputs equal: "
          f"{len({r['outputs'] for rs in runs.values() for r in rs}) == 1}")


if __name__ == "__main__":
    main()
