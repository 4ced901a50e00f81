"""A long prompt arriving while clients stream (issue 59): `specjax serve` of the shipped pair
on pages (9 slots, max_len 1024, --kv-pages 512), once per --chunks value (--prefill-chunk;
1024: the whole prompt in one call), all up before any is loaded, loaded in turn (--rounds).
A load: 8 clients each stream one completion (a short prompt, --max-tokens new tokens,
greedy, ignore_eos; a load of each kind first, unmeasured); with the arrival, a 9th request
of a --long-token prompt (held-out text, token ids, 1 new token) is sent 0.5 s after the
streams, each past its first token. Printed per load: the 8 streams' inter-token latency (each gap between streamed chunks spread over the tokens it
brought) p50 and p99 over the gaps that overlap the arrival's window (its send to its first
token; without the arrival, the same window measured from the same moment), the longest gap,
and the long prompt's time to first token; then medians over rounds and, per chunk size,
p99 with the arrival / without.

    PYTHONPATH=$PWD python docs/bench/serve_arrival.py [--chunks 512,128] [--long 900] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx
from serve_load import ROOT, one, prompts, settle, start


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def streams(url: str, texts: list[str], max_tokens: int, long: list[int] | None) -> dict:
    """8 streams, and the long prompt sent LEAD seconds later (or, without it, the moment it
    would have been): the streams' gaps within the window."""
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=16)) as client:
        tasks = [asyncio.create_task(one(client, url, "target", t, max_tokens)) for t in texts]
        await asyncio.sleep(LEAD)  # every stream past its first token (8 short prompts: ~0.1 s)
        sent = time.perf_counter()
        arrival = await one(client, url, "target", long, 1) if long is not None else None
        first = arrival["chunks"][0] if arrival else sent + WINDOW[url]
        results = await asyncio.gather(*tasks)
    if arrival:
        WINDOW[url] = first - sent
    itl, gaps = [], []
    for r in results:
        per_chunk = r["tokens"] / max(1, len(r["chunks"]))
        assert not arrival or r["chunks"][-1] > first, "a stream ended before the arrival's first token: more tokens"
        for a, b in zip(r["chunks"], r["chunks"][1:]):
            if b > sent and a < first:
                gaps.append(b - a)
                itl += [(b - a) / per_chunk] * max(1, round(per_chunk))
    return {"itl_p50_ms": 1e3 * statistics.median(itl), "itl_p99_ms": 1e3 * pct(itl, 0.99),
            "longest_gap_ms": 1e3 * max(gaps), "arrival_ttft_ms": 1e3 * (first - sent) if arrival else float("nan")}


LEAD = 0.5  # seconds from the streams' start to the arrival
WINDOW: dict[str, float] = {}  # a server's last arrival's time to first token: the window without one


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", default="512,128")
    parser.add_argument("--long", type=int, default=900)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import specjax
    from specjax.train.data import held_out_prompts

    tokenizer = specjax.load_tokenizer(str(ROOT / "checkpoints/target"))
    long = [int(t) for p in held_out_prompts(tokenizer, 4, 512, seed=1) for t in p][:args.long]
    texts = prompts(8)
    chunks = [int(c) for c in args.chunks.split(",")]
    servers = {}
    try:
        for c in chunks:
            servers[c] = start("checkpoints/draft", 9, ("--kv-pages", "512", "--prefill-chunk", str(c),
                                                        "--no-prefix-caching"))
        for _, url in servers.values():  # warm: the first arrival's programs (a chunk, its admission) run once
            for arriving in (long, None):
                asyncio.run(streams(url, texts, args.max_tokens, arriving))
        runs = {}
        for _ in range(args.rounds):
            for c, (_, url) in servers.items():
                for name, arriving in (("arrival", long), ("none", None)):
                    settle()
                    runs.setdefault((c, name), []).append(asyncio.run(streams(url, texts, args.max_tokens, arriving)))
                    print(json.dumps({"chunk": c, "load": name, **{k: round(v, 1) for k, v in
                                                                   runs[(c, name)][-1].items()}}), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    print(f"# {' '.join(sys.argv)}")
    print(f"# shipped pair over HTTP, 9 slots of 1024 on 512 pages of 16, no prefix caching; 8 clients streaming "
          f"{args.max_tokens} tokens each, a {len(long)}-token prompt arriving once they stream; {args.rounds} "
          f"rounds, medians; inter-token latency over the gaps overlapping the arrival's send .. first token")
    for c in chunks:
        m = {name: {k: statistics.median(r[k] for r in runs[(c, name)]) for k in runs[(c, name)][0]}
             for name in ("arrival", "none")}
        print(f"--prefill-chunk {c}: ITL p50 {m['arrival']['itl_p50_ms']:.1f} ms / p99 "
              f"{m['arrival']['itl_p99_ms']:.1f} ms with the arrival, {m['none']['itl_p50_ms']:.1f} / "
              f"{m['none']['itl_p99_ms']:.1f} ms without: p99 "
              f"{m['arrival']['itl_p99_ms'] / m['none']['itl_p99_ms']:.2f}x; "
              f"longest gap {m['arrival']['longest_gap_ms']:.0f} vs {m['none']['longest_gap_ms']:.0f} ms; "
              f"the long prompt's first token after {m['arrival']['arrival_ttft_ms']:.0f} ms")


if __name__ == "__main__":
    main()
