"""Prefix caching on and off (issue 59), side by side in one run on this machine: the shipped
pair (float32, greedy, its draft at the cost profile's K) in a paged engine of 8 slots,
max_len 1024, requests that share a long first part (a system prompt of --shared held-out
tokens) and end in their own question (16-64 held-out tokens), 32 new tokens each.

One request goes first and alone (it writes the shared pages), then the rest at once. For
each mode: the burst's time to first token (median and 90th percentile over its requests),
its wall time, the burst's prompt tokens and those taken from cached pages, and whether
every output (the first request's too) equals the other mode's.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/prefix_cache.py [--requests 24]
        [--shared 512] > docs/bench/prefix_cache.txt
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import specjax
from shipped_pair import load_pair
from specjax.train.data import held_out_prompts

MAX_LEN = 1024
SLOTS = 8
NEW_TOKENS = 32


def run(engine, first, rest) -> dict:
    """The first request alone, then the rest at once; -> outputs and times."""
    with engine:
        alone = engine.submit(first, max_new_tokens=NEW_TOKENS)
        alone.result(timeout=3600)
        start = time.perf_counter()
        submitted = [engine.submit(p, max_new_tokens=NEW_TOKENS) for p in rest]
        outputs = [r.result(timeout=3600) for r in submitted]
        seconds = time.perf_counter() - start
    ttft = [1e3 * (r.chunk_times[0][0] - r.submitted) for r in submitted]
    return {"outputs": [alone.tokens] + outputs, "seconds": seconds, "ttft_ms": ttft,
            "cached": sum(r.cached_tokens for r in submitted), "prompt": sum(len(p) for p in rest)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--shared", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    target, draft, tokenizer = load_pair()
    rng = np.random.default_rng(args.seed)
    pool = held_out_prompts(tokenizer, args.requests + 1, 512, seed=args.seed)
    shared = list(pool[0][:args.shared]) + list(pool[1][:max(0, args.shared - len(pool[0]))])
    prompts = [shared + list(p[:int(rng.integers(16, 65))]) for p in pool[1:]]
    print(f"# {' '.join(os.sys.argv)}")
    print(f"# shipped pair, float32, greedy, draft at the profile's K; paged engine, {SLOTS} slots, max_len "
          f"{MAX_LEN}, pages of 16; {len(prompts)} requests of a shared {len(shared)}-token first part and their "
          f"own {min(len(p) for p in prompts) - len(shared)}-{max(len(p) for p in prompts) - len(shared)} tokens, "
          f"{NEW_TOKENS} new tokens each: one alone, then {len(prompts) - 1} at once")
    results = {}
    for name, caching in (("off", False), ("on", True)):
        engine = specjax.Engine(target, draft=draft, slots=SLOTS, max_len=MAX_LEN, kv_pages=SLOTS * MAX_LEN // 16,
                                prefix_caching=caching)
        engine.compile_all()
        results[name] = run(engine, prompts[0], prompts[1:])
    for name, r in results.items():
        ttft = np.asarray(r["ttft_ms"])
        print(f"prefix caching {name}: burst {r['seconds']:.2f} s; time to first token median "
              f"{np.median(ttft):.0f} ms, p90 {np.percentile(ttft, 90):.0f} ms; prompt tokens {r['prompt']}, "
              f"{r['cached']} of them from cached pages")
    off, on = results["off"], results["on"]
    print(f"on / off: burst time {on['seconds'] / off['seconds']:.2f}x, median time to first token "
          f"{np.median(on['ttft_ms']) / np.median(off['ttft_ms']):.2f}x")
    print(f"outputs equal: {on['outputs'] == off['outputs']}")


if __name__ == "__main__":
    main()
