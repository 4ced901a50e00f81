"""One client: speculation's gain through `specjax serve` against its gain through `generate`
on the same prompts, in one run (issue 59: the server's speculative / plain ratio should be
at least 0.95x of generate's). The shipped pair, float32, greedy, 128 new tokens a request
(ignore_eos), serve_load's prompts (--requests of them, one at a time). Through `generate`:
each prompt alone, with the shipped draft at K=4 and plain, timed after a warm-up pass over
every prompt. Through the server: `specjax serve` with the draft and with --draft none (8
slots, its defaults otherwise), one closed-loop client. Each ratio is of total times, the
median over --rounds; and server / generate per round (the two measured minutes apart), its
median.

    PYTHONPATH=$PWD python docs/bench/serve_vs_generate.py [--requests 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import numpy as np
from serve_load import ROOT, load, prompts, settle, start

INF = float("inf")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    texts = prompts(args.requests)
    servers = {}
    try:
        for name, draft in (("draft", "checkpoints/draft"), ("plain", "none")):
            servers[name] = start(draft, 8)
        import jax.numpy as jnp

        import specjax
        from specjax.text import encode_prompts

        target = specjax.load_model(str(ROOT / "checkpoints/target"), dtype=jnp.float32)
        draft = specjax.DraftModel.load(str(ROOT / "checkpoints/draft"), dtype=jnp.float32)
        tokenizer = specjax.load_tokenizer(str(ROOT / "checkpoints/target"))
        encoded = [specjax.pad_prompts([ids]) for ids in encode_prompts(tokenizer, texts)]  # as the server does

        def through_generate(d):
            start_time = time.perf_counter()
            for p, n in encoded:
                np.asarray(specjax.generate(target, p, n, draft=d, num_draft_tokens=4 if d else None,
                                            max_new_tokens=128).tokens)  # eos_token_id None: 128 each
            return time.perf_counter() - start_time

        for d in (draft, None):  # compiles every prompt's bucket
            through_generate(d)
        for _, url in servers.values():
            asyncio.run(load(url, "target", texts[:2], 1, INF, 8, 0))
        ratios = {"generate": [], "server": []}
        for _ in range(args.rounds):
            settle()
            ratios["generate"].append(through_generate(None) / through_generate(draft))
            seconds = {}
            for name, (_, url) in servers.items():
                settle()
                seconds[name] = asyncio.run(load(url, "target", texts, 1, INF, 128, 0))[1]
            ratios["server"].append(seconds["plain"] / seconds["draft"])
            print({k: round(v[-1], 3) for k, v in ratios.items()}, "server / generate",
                  round(ratios["server"][-1] / ratios["generate"][-1], 3), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    g, s = statistics.median(ratios["generate"]), statistics.median(ratios["server"])
    print(f"# {' '.join(sys.argv)}: {args.requests} prompts one at a time, 128 new tokens, {args.rounds} rounds, "
          f"medians")
    paired = statistics.median(b / a for a, b in zip(ratios["generate"], ratios["server"]))
    print(f"speculative / plain: generate {g:.2f}x, server {s:.2f}x; server / generate {s / g:.2f} "
          f"(the median of each round's own: {paired:.2f})")


if __name__ == "__main__":
    main()
