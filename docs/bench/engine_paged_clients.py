"""Dense rows against pages under closed-loop clients (issue 59: `specjax serve` pages by
default): the shipped pair (float32, its draft at the profile's K), 8 slots of 1,024, an
engine with dense rows and one with 512 pages of 16 (what `specjax serve` makes on a CPU:
prefix caching on, prefill chunks of 64), both compiled and warm before either is loaded,
loaded in turn (--rounds). A load: --clients threads, each submitting one request after
the other (64 held-out prompts of 48 tokens, 128 new tokens each, greedy). Printed per
load: time to first token p50 (submit to the first token's listener call) and output
tokens/s; then medians and paged / dense.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/engine_paged_clients.py [--clients 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import specjax
from shipped_pair import load_pair
from specjax.train.data import held_out_prompts


def load(engine, prompts, clients: int, new: int) -> tuple[float, float]:
    """(time to first token p50 in ms, output tokens/s) of `clients` closed-loop clients."""
    ttft, queue, lock = [], list(prompts), threading.Lock()

    def client():
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            first = []
            start = time.perf_counter()
            request = engine.submit(prompt, max_new_tokens=new,
                                    listener=lambda tokens: first or first.append(time.perf_counter()))
            request.result()
            ttft.append(first[0] - start)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 1e3 * statistics.median(ttft), len(prompts) * new / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    target, draft, tokenizer = load_pair()
    prompts = [[int(t) for t in p] for p in held_out_prompts(tokenizer, 64, 48, seed=0)]
    engines = {"dense": specjax.Engine(target, draft=draft, slots=8, max_len=1024),
               "paged": specjax.Engine(target, draft=draft, slots=8, max_len=1024, kv_pages=512)}
    for engine in engines.values():
        engine.compile_all().__enter__()
        load(engine, prompts[:16], args.clients, 16)  # warm
    runs = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            runs[name].append(load(engine, prompts, args.clients, 128))
            print(f"{name}: time to first token p50 {runs[name][-1][0]:.0f} ms, {runs[name][-1][1]:.0f} tokens/s",
                  flush=True)
    for engine in engines.values():
        engine.__exit__(None, None, None)
    m = {name: [statistics.median(r[i] for r in rs) for i in range(2)] for name, rs in runs.items()}
    print(f"# {args.clients} closed-loop clients, 64 requests of 48 + 128 tokens, {args.rounds} rounds, medians")
    for name, (ttft, tps) in m.items():
        print(f"{name}: time to first token p50 {ttft:.0f} ms, {tps:.0f} tokens/s")
    print(f"paged / dense: tokens/s {m['paged'][1] / m['dense'][1]:.2f}x, time to first token "
          f"{m['paged'][0] / m['dense'][0]:.2f}x")


if __name__ == "__main__":
    main()
