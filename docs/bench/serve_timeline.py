"""Where a streamed request's time to first token goes inside `specjax serve`, under a
closed-loop load of --clients clients (serve_load.py's prompts and client).

It starts `specjax serve` (the shipped pair, 8 slots, as serve_load.py does) through this
same file, which wraps a few of the engine's and the server's methods to stamp each choice
(time.perf_counter: CLOCK_MONOTONIC, one clock for every process here) and appends a JSON
line per choice to a log as the choice ends. Printed: each load's serve_load summary, then
the medians of the segments between the stamps:

    arrival        the server made the request's Generation (prompt tokenized)
    submitted      Engine.submit returned
    placed         its admission was dispatched (Engine._place returned)
    deliver_start  the host began reading the first device call whose rows held it
    chunk0         that read handed its first tokens over (Request._emit)
    loop0          the event loop took them from its queue
    yield0         their text was yielded to the HTTP response

    PYTHONPATH=$PWD python docs/bench/serve_timeline.py [--clients 8] [--rounds 2] [-- SERVE FLAGS]
"""

from __future__ import annotations

import json
import os
import sys
import time

STAMPS = ("arrival", "submitted", "placed", "deliver_start", "chunk0", "loop0", "yield0")


def wrapped_serve(log: str):
    """`specjax serve` (sys.argv past "serve") with each choice's stamps appended to `log`."""
    from specjax.serve import engine as E
    from specjax.serve import generation as G

    place, deliver, events = E.Engine._place, E.Engine._deliver, G.Generation.events

    def _place(self, taken, n, free):
        group = list(taken[:n])
        out = place(self, taken, n, free)
        now = time.perf_counter()
        for request in group:
            request.placed = now
        return out

    def _deliver(self, call):
        now = time.perf_counter()
        for request in call.owners.values():
            if not hasattr(request, "deliver_start"):
                request.deliver_start = now
        return deliver(self, call)

    async def _events(self):
        first = {}
        async for c, text in events(self):
            if text and c.index not in first:
                first[c.index] = time.perf_counter()
            if text is None:
                r = c.request
                stamps = [self.arrival, r.submitted, getattr(r, "placed", None), getattr(r, "deliver_start", None),
                          r.chunk_times[0][0] if r.chunk_times else None,
                          c.chunk_times[0][0] if c.chunk_times else None, first.get(c.index)]
                with open(log, "a") as f:
                    f.write(json.dumps(dict(zip(STAMPS, stamps))) + "\n")
            yield c, text

    E.Engine._place, E.Engine._deliver, G.Generation.events = _place, _deliver, _events
    from specjax.cli import entry
    return entry(["serve", *sys.argv[2:]])


def main():
    import argparse
    import asyncio
    import statistics
    import subprocess
    import tempfile

    import httpx

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import serve_load as L

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("serve", nargs="*", help="more `specjax serve` flags (after --)")
    args = parser.parse_args()
    log = os.path.join(tempfile.mkdtemp(), "timeline.jsonl")
    port = L.free_port()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", "checkpoints/target", "--draft",
                             "checkpoints/draft", "--port", str(port), "--slots", "8", "--max-model-len", "1024",
                             *args.serve], cwd=L.ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu", "TIMELINE_LOG": log},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:  # serving, and done compiling in the background (as serve_load.start waits)
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                metrics = httpx.get(url + "/metrics", timeout=5).text.splitlines()
                if httpx.get(url + "/health", timeout=1).status_code == 200 and next(
                        line for line in metrics if line.startswith("specjax:num_prefill_groups_compiling")
                ).endswith(" 0.0"):
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        texts = L.prompts(args.requests)
        asyncio.run(L.load(url, model, texts[:16], args.clients, float("inf"), args.max_tokens, 0))  # warm
        os.remove(log)
        print(f"# {' '.join(sys.argv)}   ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs)")
        for round_ in range(args.rounds):
            L.settle()
            results, seconds = asyncio.run(L.load(url, model, texts, args.clients, float("inf"), args.max_tokens,
                                                  round_))
            print(json.dumps({"round": round_, **{k: round(v, 2) for k, v in L.summary(results, seconds).items()}}))
    finally:
        proc.terminate()
        proc.wait()
    records = [json.loads(line) for line in open(log)]
    print(f"segments, medians over {len(records)} requests (ms):")
    for a, b in zip(STAMPS, STAMPS[1:]):
        gaps = [r[b] - r[a] for r in records if r[a] is not None and r[b] is not None]
        print(f"  {a:>13} -> {b:<13} {1e3 * statistics.median(gaps):7.1f}")
    whole = [r["yield0"] - r["arrival"] for r in records if r["yield0"] is not None]
    print(f"  {'arrival':>13} -> {'yield0':<13} {1e3 * statistics.median(whole):7.1f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        sys.exit(wrapped_serve(os.environ["TIMELINE_LOG"]))
    main()
