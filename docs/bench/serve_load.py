"""Load on a live `specjax serve` over HTTP, as vLLM's `bench serve` measures it.

The servers (the shipped pair with its draft, and with --draft none, each started here as a
subprocess on a free loopback port; --other: one already running, vLLM) are all up before
any is loaded, then loaded in turn, round after round (--rounds), so that the machine's
drift falls on them alike, each load once the machine is idle (`settle`). A load: for each
number of concurrent clients, N streamed completions of the same prompts (lines of the
standard library's source, which the shipped pair was trained on), arriving as a Poisson
process at --rate requests/s (inf: all at once), at most that many in flight. Per request:
time to first token (TTFT), time per output token after the first (TPOT), the gaps between
streamed chunks spread over their tokens (ITL), and output tokens (the usage chunk).
Printed per load: request throughput, output tokens/s, and TTFT, TPOT, ITL medians and p99;
then each figure's median over the rounds, and the ratios the server's bars are about, of
those medians. Then each idle server's CPU over 5 s (its process's user + system time),
while the others idle too.

    python docs/bench/serve_load.py [--requests 32] [--max-tokens 128] [--clients 1,8]
        [--rounds 3] [--other URL NAME]

It starts servers with `python -m specjax.cli serve`; JAX_PLATFORMS=cpu is set for them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def prompts(n: int, seed: int = 0) -> list[str]:
    """n prompts: a def or class line and the lines before it, from the standard library."""
    import sysconfig

    rng = random.Random(seed)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out = []
    while len(out) < n:
        lines = rng.choice(files).read_text(errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]
        if starts:
            i = rng.choice(starts)
            out.append("\n".join(lines[max(0, i - 3):i + 1]) + "\n")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(draft: str, slots: int, extra: tuple = (), tree: str | None = None) -> tuple[subprocess.Popen, str]:
    """`specjax serve --draft draft --slots slots` (and `extra` flags) on a free port, once it
    serves at full speed; -> (its process, its URL). tree: a source tree to run it from
    (PYTHONPATH; default: the installed specjax, from this checkout)."""
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **({"PYTHONPATH": str(tree)} if tree else {})}
    proc = subprocess.Popen([sys.executable, "-m", "specjax.cli", "serve", "--draft", draft, "--port", str(port),
                             "--slots", str(slots), "--max-model-len", "1024", *extra], cwd=tree or ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"specjax serve --draft {draft} exited with {proc.returncode}")
        try:  # serving, and done compiling the grouped prefills in the background (the load measures steady state)
            if httpx.get(url + "/health", timeout=1).status_code == 200 and next(
                    line for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
                    if line.startswith("specjax:num_prefill_groups_compiling")).endswith(" 0.0"):
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("the server did not start in 900 s")


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    chunks, text, tokens, cached = [], [], 0, 0  # the time and the text of each non-empty text chunk
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
                cached = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            if data["choices"] and data["choices"][0]["text"]:
                chunks.append(time.perf_counter())
                text.append(data["choices"][0]["text"])
    end = time.perf_counter()
    return {"start": start, "end": end, "chunks": chunks, "text": "".join(text), "tokens": tokens, "cached": cached}


async def load(url: str, model: str, texts: list[str], clients: int, rate: float, max_tokens: int, seed: int):
    rng = random.Random(seed)
    gate = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        async def gated(prompt):
            async with gate:
                return await one(client, url, model, prompt, max_tokens)

        tasks, t0 = [], time.perf_counter()
        for prompt in texts:
            tasks.append(asyncio.create_task(gated(prompt)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def summary(results: list[dict], seconds: float) -> dict:
    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    ttft = [r["chunks"][0] - r["start"] for r in results if r["chunks"]]
    tpot = [(r["end"] - r["chunks"][0]) / (r["tokens"] - 1) for r in results if r["chunks"] and r["tokens"] > 1]
    itl = []
    for r in results:  # chunks carry several tokens: each gap spread over the tokens it brought (estimated evenly)
        gaps = [b - a for a, b in zip(r["chunks"], r["chunks"][1:])]
        per_chunk = r["tokens"] / max(1, len(r["chunks"]))
        itl += [g / per_chunk for g in gaps for _ in range(max(1, round(per_chunk)))]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "seconds": seconds, "req_per_s": len(results) / seconds,
            "output_tok_per_s": tokens / seconds, "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "ttft_p99_ms": 1e3 * pct(ttft, 0.99), "tpot_p50_ms": 1e3 * statistics.median(tpot),
            "tpot_p99_ms": 1e3 * pct(tpot, 0.99), "itl_p50_ms": 1e3 * statistics.median(itl),
            "itl_p99_ms": 1e3 * pct(itl, 0.99)}


def prefix_figures(ttft: list[float], results: list[dict], seconds: float) -> dict:
    """A load's figures where what differs is a prefix cache: time to first token p50 and p99
    (ms) over `ttft` (seconds), output tokens/s and prompt tokens the server found cached."""
    ttft = sorted(ttft)
    p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
    return {"ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_p99_ms": 1e3 * p99,
            "tok_per_s": sum(r["tokens"] for r in results) / seconds, "cached": sum(r["cached"] for r in results)}


def prefix_medians(runs: dict, ours: str, theirs: str):
    """Prints each server's `prefix_figures`, the medians over its rounds ({name: [figures,
    ...]}), a line each, then how server `ours` compares with `theirs` (their time to first
    token over ours, our tokens/s over theirs)."""
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    for name, m in medians.items():
        print(f"{name}: time to first token p50 {m['ttft_p50_ms']:.0f} ms, p99 {m['ttft_p99_ms']:.0f} ms; "
              f"{m['tok_per_s']:.0f} output tokens/s; {m['cached']:.0f} prompt tokens cached")
    a, b = medians[ours], medians[theirs]
    print(f"{theirs} / {ours}: time to first token p50 {b['ttft_p50_ms'] / a['ttft_p50_ms']:.2f}x, p99 "
          f"{b['ttft_p99_ms'] / a['ttft_p99_ms']:.2f}x; output tokens/s {ours} / {theirs} "
          f"{a['tok_per_s'] / b['tok_per_s']:.2f}x")


def settle(window: float = 0.5, most: float = 0.05, patience: float = 20.0):
    """Waits until the machine is idle (its CPUs used under `most` CPU-seconds in a `window`,
    from /proc/stat; at most `patience` seconds): a server may spin for a moment after its
    load ends (vLLM's processes used 1.0 CPU-second in the second after an 8-client load
    here), which the next server's load would pay for."""
    def busy():
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait

    deadline = time.time() + patience
    while time.time() < deadline:
        before = busy()
        time.sleep(window)
        if busy() - before < most:
            return


def cpu_seconds(stat: str) -> float:
    """User + system CPU seconds in the text of a Linux /proc/PID[/task/TID]/stat."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(pid: int, seconds: float = 5.0) -> float:
    """CPU seconds the process used in `seconds` of wall time (Linux /proc)."""
    before = cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
    time.sleep(seconds)
    return cpu_seconds(Path(f"/proc/{pid}/stat").read_text()) - before


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--clients", default="1,8")
    p.add_argument("--rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: at once)")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--other", nargs=2, metavar=("URL", "MODEL"), help="also load this running server")
    p.add_argument("--rounds", type=int, default=3, help="each server loaded this many times, in turn; medians")
    args = p.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    texts = prompts(args.requests)
    servers = [("specjax, shipped draft", "checkpoints/draft"), ("specjax, plain", "none")]
    started = []  # (name, process, url, model): every server up (and idle) before any is loaded
    try:
        for name, draft in servers:
            proc, url = start(draft, args.slots)
            started.append((name, proc, url, "target"))
        if args.other:
            started.append(("other", None, *args.other))
        for _, _, url, model in started:
            asyncio.run(load(url, model, texts[:2], 1, float("inf"), 8, 0))  # warm: first requests' paths
        runs = {}  # (server, clients) -> a summary per round
        for r in range(args.rounds):  # the servers in turn, each round: the machine's drift hits them alike
            for c in clients:
                for name, _, url, model in started:
                    settle()
                    results, seconds = asyncio.run(load(url, model, texts, c, args.rate, args.max_tokens, 0))
                    runs.setdefault((name, c), []).append(summary(results, seconds))
                    shown = f"other {url}" if name == "other" else name
                    print(json.dumps({"server": shown, "clients": c, "round": r, **{
                        k: round(v, 3) for k, v in runs[(name, c)][-1].items()}}), flush=True)
        for name, proc, _, _ in started:
            if proc is not None:
                print(json.dumps({"server": name, "idle_cpu_seconds_in_5s": round(idle_cpu(proc.pid), 3)}), flush=True)
    finally:
        for _, proc, _, _ in started:
            if proc is not None:
                proc.terminate()
                proc.wait(120)
    table = {key: {k: statistics.median(s[k] for s in summaries) for k in summaries[0]}
             for key, summaries in runs.items()}
    print(f"medians of {args.rounds} rounds:")
    for (name, c), row in table.items():
        print(json.dumps({"server": name, "clients": c, **{k: round(v, 3) for k, v in row.items()}}))
    spec, plain = servers[0][0], servers[1][0]
    for c in clients:
        ratio = table[(spec, c)]["output_tok_per_s"] / table[(plain, c)]["output_tok_per_s"]
        print(f"{c} client(s): speculation / plain output tokens/s = {ratio:.2f}x")
    if len(clients) > 1:
        lo, hi = min(clients), max(clients)
        print(f"plain, {hi} clients / {lo}: {table[(plain, hi)]['output_tok_per_s'] / table[(plain, lo)]['output_tok_per_s']:.2f}x")
    if args.other:
        for c in clients:
            print(f"{c} client(s): specjax (best of its servers) / other = "
                  f"{max(table[(spec, c)]['output_tok_per_s'], table[(plain, c)]['output_tok_per_s']) / table[('other', c)]['output_tok_per_s']:.2f}x")

if __name__ == "__main__":
    main()
