"""Prefix caching over HTTP (issue 59): two `specjax serve` processes of the shipped pair on
pages (8 slots, max_len 1024, --kv-pages 512), one with prefix caching (the default) and
one with --no-prefix-caching, both up before either is loaded, loaded in turn (--rounds).
A load: --requests streamed completions whose prompts (token ids) share a --shared-token
first part of held-out text and end in 16-64 tokens of their own, 32 new tokens each, from
8 closed-loop clients; one request of the shared part first (it writes its pages). Printed
per load: time to first token p50 and p99, output tokens/s, and the prompt tokens the
server reports cached; then the medians over rounds and their ratios.

    PYTHONPATH=$PWD python docs/bench/serve_prefix.py [--requests 32] [--shared 600] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys

import numpy as np
from serve_load import ROOT, load, settle, start, summary

INF = float("inf")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--shared", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import specjax
    from specjax.train.data import held_out_prompts

    tokenizer = specjax.load_tokenizer(str(ROOT / "checkpoints/target"))
    texts = held_out_prompts(tokenizer, args.requests + 4, 512, seed=0)
    shared = [int(t) for p in texts[:4] for t in p][:args.shared]
    rng = np.random.default_rng(0)
    prompts = [shared + [int(t) for t in p[:int(rng.integers(16, 65))]] for p in texts[4:]]
    modes = {"caching on": (), "caching off": ("--no-prefix-caching",)}
    servers = {}
    try:
        for name, extra in modes.items():
            servers[name] = start("checkpoints/draft", 8, ("--kv-pages", "512", *extra))
        runs = {name: [] for name in modes}
        for _ in range(args.rounds):
            for name, (_, url) in servers.items():
                settle()
                asyncio.run(load(url, "target", [shared], 1, INF, 32, 0))  # the shared part's pages written
                results, seconds = asyncio.run(load(url, "target", prompts, 8, INF, 32, 0))
                figures = summary(results, seconds)
                runs[name].append({"ttft_p50_ms": figures["ttft_p50_ms"], "ttft_p99_ms": figures["ttft_p99_ms"],
                                   "tok_per_s": figures["output_tok_per_s"],
                                   "cached": sum(r["cached"] for r in results)})
                print(f"{name}: {json.dumps({k: round(v, 1) for k, v in runs[name][-1].items()})}", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    print(f"# {' '.join(sys.argv)}")
    print(f"# shipped pair over HTTP, 8 slots of 1024 on 512 pages of 16; {len(prompts)} requests sharing "
          f"{len(shared)} tokens, then 16-64 of their own, 32 new tokens each, 8 closed-loop clients; "
          f"{args.rounds} rounds, medians")
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    for name, m in medians.items():
        print(f"{name}: time to first token p50 {m['ttft_p50_ms']:.0f} ms, p99 {m['ttft_p99_ms']:.0f} ms; "
              f"{m['tok_per_s']:.0f} output tokens/s; {m['cached']:.0f} prompt tokens cached")
    on, off = medians["caching on"], medians["caching off"]
    print(f"off / on: time to first token p50 {off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x, p99 "
          f"{off['ttft_p99_ms'] / on['ttft_p99_ms']:.2f}x; output tokens/s on / off "
          f"{on['tok_per_s'] / off['tok_per_s']:.2f}x")


if __name__ == "__main__":
    main()
