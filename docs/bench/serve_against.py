"""`specjax serve` at a git revision against the working tree's, over HTTP, side by side in
one run: serve_load.py's closed-loop load (its stdlib prompts, 128 new tokens, greedy,
streamed) at each number of clients, the two servers (shipped pair, draft at the profile's
K, 8 slots of 1,024, each started from its own source tree) loaded in turn each round.
Printed per load: time to first token p50 and p99, output tokens/s, inter-token latency
p99; then medians and working tree / revision.

    python docs/bench/serve_against.py --against REV [--clients 1,8] [--rounds 3] [--requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from revision import ROOT, checked_out  # noqa: E402
from serve_load import load, prompts, settle, start, summary  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, help="a git revision to compare the working tree with")
    p.add_argument("--clients", default="1,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=64)
    args = p.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    texts = prompts(args.requests)
    with checked_out(args.against) as old:
        servers = {}
        try:
            for name, tree in ((args.against, old), ("working tree", ROOT)):  # one at a time: compiles don't fight
                servers[name] = start("checkpoints/draft", 8, tree=tree)
            for _, url in servers.values():
                asyncio.run(load(url, "target", texts[:4], 1, float("inf"), 8, 0))  # warm: first requests' paths
            runs = {}
            for r in range(args.rounds):
                for c in clients:
                    for name, (_, url) in servers.items():
                        settle()
                        s = summary(*asyncio.run(load(url, "target", texts, c, float("inf"), 128, 0)))
                        runs.setdefault((name, c), []).append(s)
                        print(f"round {r}, {c} client(s), {name}: time to first token p50 {s['ttft_p50_ms']:.0f} ms, "
                              f"p99 {s['ttft_p99_ms']:.0f} ms, {s['output_tok_per_s']:.0f} tokens/s, "
                              f"ITL p99 {s['itl_p99_ms']:.1f} ms", flush=True)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(120)
    print(f"# medians of {args.rounds} rounds, {args.requests} requests of 128 new tokens each")
    keys = ("ttft_p50_ms", "ttft_p99_ms", "output_tok_per_s", "itl_p99_ms")
    med = {key: {k: statistics.median(s[k] for s in ss) for k in keys} for key, ss in runs.items()}
    for (name, c), m in med.items():
        print(f"{c} client(s), {name}: time to first token p50 {m['ttft_p50_ms']:.0f} ms, p99 {m['ttft_p99_ms']:.0f} "
              f"ms, {m['output_tok_per_s']:.0f} tokens/s, ITL p99 {m['itl_p99_ms']:.1f} ms")
    for c in clients:
        new, old_ = med[("working tree", c)], med[(args.against, c)]
        print(f"{c} client(s), working tree / {args.against}: time to first token "
              f"p50 {new['ttft_p50_ms'] / old_['ttft_p50_ms']:.2f}x, p99 {new['ttft_p99_ms'] / old_['ttft_p99_ms']:.2f}x, "
              f"tokens/s {new['output_tok_per_s'] / old_['output_tok_per_s']:.2f}x, "
              f"ITL p99 {new['itl_p99_ms'] / old_['itl_p99_ms']:.2f}x")


if __name__ == "__main__":
    main()
