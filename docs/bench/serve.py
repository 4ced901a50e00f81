"""Serving benchmark: requests arriving one at a time, in one run, four ways on the same weights.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/serve.py --out docs/bench/serve

- static: requests wait for a batch of up to `--slots`, which `generate` runs to its
  slowest row (budget: the batch's largest), as a server without continuous batching does;
- engine plain: `specjax.Engine` without a draft;
- engine spec: `specjax.Engine` with the shipped draft (its saved vocabulary), K by live rows
  from the shipped cost profile;
- transformers: transformers' continuous batching (`init_continuous_batching`, float32, torch
  on the same threads), where installed.

Workloads: closed loops of 1 and of `--slots` clients (each sends its next request when its
last finishes) and open Poisson arrivals at `--rates` requests/s. Held-out prompts of 16-64
tokens, budgets of 16-128 tokens, greedy, no stop ids. Per run: output tokens/s, time to
first token (TTFT), time per output token after the first (TPOT), inter-token latency (ITL:
the gap between chunks, each chunk a device call's tokens for the engine, as vLLM counts
speculative decoding), p50/p99, and the K the engine chose. Writes serve.txt, serve.json and
serve.png (p50 TPOT against throughput) into --out.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def workload(tokenizer, n: int, seed: int = 0):
    from specjax.tools.measure import held_out_prompts

    rng = np.random.RandomState(seed)
    prompts = held_out_prompts(tokenizer, n, 64, seed=seed)
    return [(p[: rng.randint(16, 65)], int(rng.randint(16, 129))) for p in prompts]


class Record:
    """One request's times: submitted, each chunk (time, tokens), finished."""

    def __init__(self, budget):
        self.budget, self.submitted, self.chunks, self.finished = budget, None, [], None


# ---- the systems: submit(prompt, budget, record) -> a handle with .wait() -------------------

class EngineSystem:
    def __init__(self, engine):
        self.engine = engine

    def __enter__(self):
        self.engine.compile_all()
        self.engine.start()
        return self

    def __exit__(self, *exc):
        self.engine.stop()

    def submit(self, prompt, budget, record):
        record.submitted = time.perf_counter()
        request = self.engine.submit(prompt, max_new_tokens=budget)

        def wait():
            for chunk in request:
                record.chunks.append((time.perf_counter(), len(chunk)))
            record.finished = time.perf_counter()
        return wait


class StaticSystem:
    """Waiting requests are taken in batches of up to `slots`; each batch is one generate call."""

    def __init__(self, target, slots, max_budget):
        self.target, self.slots, self.max_budget = target, slots, max_budget
        self.queue, self.lock = [], threading.Condition()

    def __enter__(self):
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        with self.lock:
            self.stopping = True
            self.lock.notify()
        self.thread.join()

    def _serve(self):
        import specjax

        while True:
            with self.lock:
                while not self.queue and not self.stopping:
                    self.lock.wait()
                if not self.queue:
                    return
                batch, self.queue = self.queue[: self.slots], self.queue[self.slots:]
            prompts, lengths = specjax.pad_prompts([p for p, _, _, _ in batch])
            prompts = np.pad(prompts, ((0, self.slots - len(batch)), (0, 64 - prompts.shape[1])), constant_values=1)
            lengths = np.pad(lengths, (0, self.slots - len(batch)), constant_values=1)
            budget = max(b for _, b, _, _ in batch)  # the batch runs to its slowest row
            budget = -(-budget // 32) * 32  # a few shapes only
            out = specjax.generate(self.target, prompts, lengths, max_new_tokens=budget)
            np.asarray(out.tokens)
            now = time.perf_counter()
            for _, b, record, done in batch:
                record.chunks.append((now, b))
                record.finished = now
                done.set()

    def submit(self, prompt, budget, record):
        record.submitted = time.perf_counter()
        done = threading.Event()
        with self.lock:
            self.queue.append((prompt, budget, record, done))
            self.lock.notify()
        return done.wait


class TransformersSystem:
    def __init__(self, folder, threads):
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        torch.set_num_threads(threads)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.manager = model.init_continuous_batching(generation_config=GenerationConfig(
            max_new_tokens=128, do_sample=False, eos_token_id=-1, pad_token_id=0))
        self.manager.start()
        warm = self.manager.add_request([5, 6, 7, 8] * 8, max_new_tokens=16)  # its first request compiles
        for _ in self.manager.request_id_iter(warm):
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def close(self):
        self.manager.stop(block=True)

    def submit(self, prompt, budget, record):
        record.submitted = time.perf_counter()
        rid = self.manager.add_request(list(prompt), max_new_tokens=budget, streaming=True)

        def wait():
            seen = 0
            for result in self.manager.request_id_iter(rid):
                n = len(result.generated_tokens)
                if n > seen:
                    record.chunks.append((time.perf_counter(), n - seen))
                    seen = n
            record.finished = time.perf_counter()
        return wait


# ---- the workloads ---------------------------------------------------------------------------

def closed_loop(system, requests, clients):
    records = [Record(b) for _, b in requests]
    todo = list(range(len(requests)))
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            system.submit(requests[i][0], requests[i][1], records[i])()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return records


def poisson(system, requests, rate, seed=0):
    records = [Record(b) for _, b in requests]
    gaps = np.random.RandomState(seed).exponential(1.0 / rate, len(requests))
    waiters, start = [], time.perf_counter()
    for (prompt, budget), record, at in zip(requests, records, np.cumsum(gaps)):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        wait = system.submit(prompt, budget, record)
        thread = threading.Thread(target=wait)
        thread.start()
        waiters.append(thread)
    [t.join() for t in waiters]
    return records


def summary(records) -> dict:
    tokens = sum(n for r in records for _, n in r.chunks)
    span = max(r.finished for r in records) - min(r.submitted for r in records)
    ttft = [r.chunks[0][0] - r.submitted for r in records]
    tpot = [(r.finished - r.chunks[0][0]) / (sum(n for _, n in r.chunks) - r.chunks[0][1])
            for r in records if sum(n for _, n in r.chunks) > r.chunks[0][1]]
    itl = [b[0] - a[0] for r in records for a, b in zip(r.chunks, r.chunks[1:])]
    pct = lambda x, q: 1e3 * float(np.percentile(x, q)) if x else float("nan")  # noqa: E731
    return {"tokens_per_s": tokens / span, "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99), "itl_p50_ms": pct(itl, 50),
            "itl_p99_ms": pct(itl, 99), "tokens": tokens, "seconds": span}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "serve")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rates", type=float, nargs="*", default=[1.0, 4.0, 16.0])
    parser.add_argument("--systems", nargs="*", default=["static", "engine plain", "engine spec", "transformers"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads for transformers")
    parser.add_argument("--from-json", type=Path, help="only write the report again from a serve.json")
    args = parser.parse_args()
    if args.from_json:
        return write(json.loads(args.from_json.read_text()), args.slots, args.out)

    import jax

    import specjax

    target = specjax.load_model(ROOT / "checkpoints" / "target")
    draft = specjax.DraftModel.load(ROOT / "checkpoints" / "draft")
    tokenizer = specjax.load_tokenizer(ROOT / "checkpoints" / "target")
    requests = workload(tokenizer, args.requests)
    warmup = workload(tokenizer, 2 * args.slots, seed=1)
    max_len = 64 + 128
    systems = {
        "static": lambda: StaticSystem(target, args.slots, 128),
        "engine plain": lambda: EngineSystem(specjax.Engine(target, slots=args.slots, max_len=max_len)),
        "engine spec": lambda: EngineSystem(specjax.Engine(target, draft=draft, slots=args.slots, max_len=max_len)),
        "transformers": lambda: TransformersSystem(str(ROOT / "checkpoints" / "target"), args.threads),
    }
    loads = [("1 client", lambda s: closed_loop(s, requests, 1)),
             (f"{args.slots} clients", lambda s: closed_loop(s, requests, args.slots))]
    loads += [(f"poisson {r:g}/s", lambda s, r=r: poisson(s, requests, r)) for r in args.rates]

    lines = [f"# specjax serving benchmark, {jax.default_backend()} float32, {args.requests} held-out requests "
             f"(prompts 16-64 tokens, budgets 16-128, greedy), {args.slots} slots",
             f"# {' '.join(['python docs/bench/serve.py'] + [a for a in __import__('sys').argv[1:]])}", ""]
    results = {}
    for name in args.systems:
        system = systems[name]()
        with system:
            closed_loop(system, warmup, args.slots)  # compiles every program this load needs
            if hasattr(system, "engine"):
                system.engine.calls.clear()
                system.engine.steps.clear()
            for load, run in loads:
                records = run(system)
                row = summary(records)
                if hasattr(system, "engine"):
                    row["steps_by_K"] = dict(system.engine.steps)
                    system.engine.steps.clear()
                results.setdefault(load, {})[name] = row
                print(f"{load:>16} {name:>13}: {row['tokens_per_s']:7.1f} tok/s  TTFT p50 {row['ttft_p50_ms']:7.1f} "
                      f"ms  TPOT p50 {row['tpot_p50_ms']:6.2f} ms  ITL p50/p99 {row['itl_p50_ms']:6.1f}/"
                      f"{row['itl_p99_ms']:6.1f} ms {row.get('steps_by_K', '')}", flush=True)
        if hasattr(system, "close"):
            system.close()
        if hasattr(system, "engine"):
            results.setdefault("k_table", {})[name] = list(system.engine.k_table)

    results["title"] = lines
    write(results, args.slots, args.out)


def write(results, slots, out: Path):
    """serve.txt (the table and the goals), serve.json and serve.png into out."""
    lines = list(results["title"])
    loads = [load for load in results if load not in ("title", "k_table")]
    header = (f"{'load':>16} {'system':>13} {'tok/s':>8} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>7} "
              f"{'ITL p50':>8} {'p99':>8}  steps by K")
    lines.append(header)
    for load in loads:
        for name, row in results[load].items():
            lines.append(f"{load:>16} {name:>13} {row['tokens_per_s']:8.1f} {row['ttft_p50_ms']:9.1f} "
                         f"{row['ttft_p99_ms']:8.1f} {row['tpot_p50_ms']:9.2f} {row['tpot_p99_ms']:7.2f} "
                         f"{row['itl_p50_ms']:8.1f} {row['itl_p99_ms']:8.1f}  {row.get('steps_by_K', '')}")
    lines.append("")
    ratio = lambda load, a, b: results[load][a]["tokens_per_s"] / results[load][b]["tokens_per_s"]  # noqa: E731
    have = lambda *names: all(n in results[loads[0]] for n in names)  # noqa: E731
    if have("engine spec", "engine plain"):
        lines.append(f"engine spec / plain, 1 client: {ratio('1 client', 'engine spec', 'engine plain'):.2f}x "
                     f"(goal >= 1.5x); {slots} clients: "
                     f"{ratio(f'{slots} clients', 'engine spec', 'engine plain'):.2f}x (goal >= 0.95x)")
        scaling = results[f"{slots} clients"]["engine plain"]["tokens_per_s"] / results["1 client"]["engine plain"][
            "tokens_per_s"]
        lines.append(f"engine plain, {slots} clients / 1 client: {scaling:.2f}x (goal >= 4x)")
    if have("engine plain", "transformers"):
        # Below saturation every system delivers the offered load: compare time per token there.
        engine = lambda load, key: [results[load][n][key] for n in ("engine plain", "engine spec")  # noqa: E731
                                    if n in results[load]]
        closed = min(max(engine(load, "tokens_per_s")) / results[load]["transformers"]["tokens_per_s"]
                     for load in loads[:2])
        open_ = min(results[load]["transformers"]["tpot_p50_ms"] / min(engine(load, "tpot_p50_ms"))
                    for load in loads[2:])
        lines.append(f"engine / transformers continuous batching (goal >= 2x): tokens/s, the least of the closed "
                     f"loops {closed:.2f}x; TPOT p50, the least of the Poisson rates {open_:.2f}x")
    if "k_table" in results:
        lines.append(f"K by live rows: {results['k_table']}")
    text = "\n".join(lines) + "\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.txt").write_text(text)
    (out / "serve.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, [load for load in loads if load.startswith("poisson")], out / "serve.png")


def plot(results, loads, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in results[loads[0]]:
        xs = [results[load][name]["tokens_per_s"] for load in loads if name in results[load]]
        ys = [results[load][name]["tpot_p50_ms"] for load in loads if name in results[load]]
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("TPOT p50 (ms)")
    ax.set_yscale("log")
    ax.set_title("Poisson arrivals: latency against throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
