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
import sys

import numpy as np
from serve_load import ROOT, load, prefix_figures, prefix_medians, settle, start

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
                ttft = [r["chunks"][0] - r["start"] for r in results if r["chunks"]]
                runs[name].append(prefix_figures(ttft, results, seconds))
                print(f"{name}: {json.dumps({k: round(v, 1) for k, v in runs[name][-1].items()})}", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    print(f"# {' '.join(sys.argv)}")
    print(f"# shipped pair over HTTP, 8 slots of 1024 on 512 pages of 16; {len(prompts)} requests sharing "
          f"{len(shared)} tokens, then 16-64 of their own, 32 new tokens each, 8 closed-loop clients; "
          f"{args.rounds} rounds, medians")
    prefix_medians(runs, "caching on", "caching off")


if __name__ == "__main__":
    main()
