"""How the plain server's throughput grows from 1 client to 8, against what its step allows.

One `specjax serve --draft none --slots 8` on the shipped target (serve_load.py's start:
float32, this CPU), loaded over HTTP by serve_load.py's closed loop (--requests streamed
completions of --max-tokens each, greedy, ignore_eos) at 1 and 8 clients, in turn, --rounds
times. Per load: output tokens/s, time per output token p50, the rows decoding on average
(each request's time from its first token to its last, summed, over the load's seconds),
and the CPU seconds the server's threads used (XLA's compute pool against the rest: the
engine's thread, the event loop) and this client's. From the server's /metrics: each width's
step time as it timed it once compiled (`specjax:step_seconds`, K = 0).

Printed last, of the medians: tokens/s at 8 clients over 1; the step's own ratio, 8 x
step(1 row) / step(8 rows), the most any engine on this step reaches; and each load's tokens/s
over its step's (rows / step time): the share of the step's speed the server delivers.

    PYTHONPATH=$PWD:docs/bench python docs/bench/plain_scaling.py [--requests 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import resource
import statistics
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

import serve_load

def thread_cpu(pid: int) -> collections.Counter:
    """CPU seconds by thread name of process pid (Linux /proc): XLA's CPU pool is tf_XLAEigen."""
    out = collections.Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # a thread that ended
            continue
        out[stat[stat.index("(") + 1:stat.rindex(")")]] += serve_load.cpu_seconds(stat)
    return out


def own_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def step_seconds(url: str) -> dict[int, float]:
    """{width: seconds of a K = 0 step}, from the server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {int(s.labels["width"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "specjax:step_seconds" and s.labels["k"] == "0"}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    texts = serve_load.prompts(args.requests)
    proc, url = serve_load.start("none", 8)
    try:
        steps = step_seconds(url)
        print(json.dumps({"step_ms_by_width": {w: round(1e3 * s, 3) for w, s in sorted(steps.items())}}), flush=True)
        asyncio.run(serve_load.load(url, "target", texts[:2], 1, float("inf"), 8, 0))  # warm: first requests' paths
        runs = collections.defaultdict(list)
        for r in range(args.rounds):
            for clients in (1, 8):
                serve_load.settle()
                before, mine = thread_cpu(proc.pid), own_cpu()
                results, seconds = asyncio.run(serve_load.load(url, "target", texts, clients, float("inf"),
                                                               args.max_tokens, 0))
                after, mine = thread_cpu(proc.pid), own_cpu() - mine
                used = {name: after[name] - before.get(name, 0.0) for name in after}
                xla = sum(v for name, v in used.items() if name.startswith("tf_XLA"))
                row = {**serve_load.summary(results, seconds),
                       "rows_decoding": sum(x["end"] - x["chunks"][0] for x in results if x["chunks"]) / seconds,
                       "xla_cpu_s": xla, "other_server_cpu_s": sum(used.values()) - xla, "client_cpu_s": mine}
                runs[clients].append(row)
                print(json.dumps({"clients": clients, "round": r, **{k: round(v, 3) for k, v in row.items()
                                                                     if not k.endswith("p99_ms")}}), flush=True)
    finally:
        proc.terminate()
        proc.wait(120)
    med = {c: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for c, rs in runs.items()}
    print(f"medians of {args.rounds} rounds:")
    for c, row in med.items():
        print(json.dumps({"clients": c, **{k: round(v, 3) for k, v in row.items() if not k.endswith("p99_ms")}}))
    one, eight = med[1]["output_tok_per_s"], med[8]["output_tok_per_s"]
    print(f"plain, 8 clients / 1: {eight / one:.2f}x output tokens/s")
    print(f"the step's own ratio, 8 x step(1 row) / step(8 rows): {8 * steps[1] / steps[8]:.2f}x "
          f"({1e3 * steps[1]:.2f} and {1e3 * steps[8]:.2f} ms)")
    for c in (1, 8):
        rate = med[c]["output_tok_per_s"]
        print(f"{c} client(s): {rate:.0f} tokens/s = {rate * steps[c] / c:.2f} of the step's {c / steps[c]:.0f} at "
              f"{c} row(s); rows decoding on average {med[c]['rows_decoding']:.2f}")


if __name__ == "__main__":
    main()
