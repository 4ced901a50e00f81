"""The engine's KV memory as max_len-sized slots against a pool of pages, on the same budget
(issue 58), in one run on this machine: the shipped pair (float32, greedy, its draft at the
cost profile's K), max_len 1024 (the shipped target's context), a burst of mixed requests
(prompts of 16-256 held-out tokens, 16-256 new tokens each, submitted at once).

dense: --dense-slots rows of max_len positions each (budget = dense-slots x max_len tokens).
paged: the same tokens as a pool of 16-position pages, and --paged-slots rows.
For each: the most requests running at once, requests' output tokens over the burst's wall
time (programs compiled first), and whether every output equals the other mode's.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/paged_engine.py [--requests 32]
        [--dense-slots 4] [--paged-slots 16] > docs/bench/paged_engine.txt
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np

import specjax
from shipped_pair import load_pair
from specjax.train.data import held_out_prompts

MAX_LEN = 1024
PAGE = 16


def burst(engine, requests) -> dict:
    """Submits every request at once; -> outputs, the most running at once, tokens/s."""
    most, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            most[0] = max(most[0], engine.load()[0])
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    with engine:
        watcher.start()
        start = time.perf_counter()
        submitted = [engine.submit(p, max_new_tokens=n) for p, n in requests]
        outputs = [r.result(timeout=3600) for r in submitted]
        seconds = time.perf_counter() - start
        stop.set()
    tokens = sum(len(o) for o in outputs)
    return {"outputs": outputs, "most_running": most[0], "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tokens": tokens}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--dense-slots", type=int, default=4)
    parser.add_argument("--paged-slots", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    target, draft, tokenizer = load_pair()
    rng = np.random.default_rng(args.seed)
    pool = held_out_prompts(tokenizer, args.requests, 256, seed=args.seed)
    requests = [(p[:int(rng.integers(16, 257))], int(rng.integers(16, 257))) for p in pool]
    budget = args.dense_slots * MAX_LEN
    modes = {"dense": dict(slots=args.dense_slots),
             "paged": dict(slots=args.paged_slots, kv_pages=budget // PAGE, page_size=PAGE)}
    print(f"# {' '.join(os.sys.argv)}")
    print(f"# shipped pair, float32, greedy, draft at the profile's K; max_len {MAX_LEN}; KV budget {budget} "
          f"tokens of the target's cache; {len(requests)} requests at once, prompts "
          f"{min(len(p) for p, _ in requests)}-{max(len(p) for p, _ in requests)} tokens, new tokens "
          f"{min(n for _, n in requests)}-{max(n for _, n in requests)} (mean request "
          f"{np.mean([len(p) + n for p, n in requests]):.0f} tokens)")
    results = {}
    for name, kwargs in modes.items():
        engine = specjax.Engine(target, draft=draft, max_len=MAX_LEN, **kwargs)
        start = time.perf_counter()
        engine.compile_all()
        compiled = time.perf_counter() - start
        results[name] = r = burst(engine, requests)
        print(f"{name:6} slots {kwargs['slots']:3}: most running at once {r['most_running']:3}, "
              f"{r['tokens']} tokens in {r['seconds']:.1f} s = {r['tokens_per_s']:.1f} output tokens/s "
              f"(compiled in {compiled:.0f} s; K by live rows {list(engine.k_table)})", flush=True)
    same = results["dense"]["outputs"] == results["paged"]["outputs"]
    d, p = results["dense"], results["paged"]
    print(f"paged / dense: {p['most_running'] / d['most_running']:.2f}x the requests running at once, "
          f"{p['tokens_per_s'] / d['tokens_per_s']:.2f}x the output tokens/s; every output the same: {same}")


if __name__ == "__main__":
    main()
