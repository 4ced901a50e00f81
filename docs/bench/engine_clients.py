"""The engine alone (no HTTP): output tokens/s of the shipped target, plain decoding (or with
--draft, K by live rows as the engine chooses it, printed), 8 slots of 1,024 positions, 4
steps per call (--steps-per-call), for 32 requests of 128 new tokens
(the prompts of serve_load.py) with 1 and with 8 concurrent clients (threads, each
submitting its next request when the last finished), and the median time to each request's
first token; then the ratio 8 clients / 1, the bar the server's issue set at 4x.
--prefix-block sets `attention.CPU_PREFIX_BLOCK` (the slots a CPU reads a long cache's prefix
in) before anything compiles, to compare values in separate processes:

    for b in 512 256; do python docs/bench/engine_clients.py --prefix-block $b; done

Prefill time is the time `Programs.prefill` took, waited for, summed over the requests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import specjax  # noqa: E402
from serve_load import prompts  # noqa: E402
from specjax.models import attention  # noqa: E402
from specjax.serve import programs  # noqa: E402
from specjax.shipped import default_checkpoint  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefix-block", type=int, default=attention.CPU_PREFIX_BLOCK)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps-per-call", type=int, default=4)
    p.add_argument("--draft", default="none", help="a draft model's folder, 'shipped' (the shipped draft) or "
                   "'none' (plain decoding, the default); K by live rows as the engine chooses it")
    args = p.parse_args()
    attention.CPU_PREFIX_BLOCK = args.prefix_block
    target = specjax.load_model(default_checkpoint("target"))
    tokenizer = specjax.load_tokenizer(default_checkpoint("target"))
    ids = [tokenizer.encode(text) for text in prompts(32)]
    draft = None if args.draft == "none" else specjax.DraftModel.load(
        default_checkpoint("draft") if args.draft == "shipped" else args.draft)
    engine = specjax.Engine(target, draft=draft, slots=8, max_len=1024,
                            steps_per_call=args.steps_per_call).compile_all(groups_later=True)
    while engine.stats()["compiling"]:
        time.sleep(0.5)
    print(f"K by live rows: {engine.k_table}; steps measured (ms): {engine.stats().get('step_ms')}", flush=True)
    spent = [0.0]
    real = programs.Programs.prefill

    def timed(self, *a, **k):
        start = time.perf_counter()
        row = jax.block_until_ready(real(self, *a, **k))
        spent[0] += time.perf_counter() - start
        return row

    programs.Programs.prefill = timed
    rates = {1: [], 8: []}
    with engine:
        for _ in range(args.rounds):
            for clients in (1, 8):
                spent[0], gate = 0.0, threading.Semaphore(clients)

                ttft = []

                def one(prompt):
                    with gate:
                        start = time.perf_counter()
                        request = engine.submit(prompt, max_new_tokens=128)
                        for _ in request:  # the first chunk: the first token's arrival
                            ttft.append(time.perf_counter() - start)
                            break
                        request.result()

                threads = [threading.Thread(target=one, args=(prompt,)) for prompt in ids]
                start = time.perf_counter()
                [t.start() for t in threads]
                [t.join() for t in threads]
                seconds = time.perf_counter() - start
                rates[clients].append(32 * 128 / seconds)
                print(f"prefix block {args.prefix_block}: {clients} client(s) K by rows {engine.k_table} "
                      f"{rates[clients][-1]:.0f} tok/s ({seconds:.2f} s, prefill {spent[0]:.2f} s, TTFT p50 {1e3 * statistics.median(ttft):.0f} ms)",
                      flush=True)
    best = {c: max(r) for c, r in rates.items()}
    print(f"prefix block {args.prefix_block}: 8 clients / 1 = {best[8] / best[1]:.2f}x (best of {args.rounds} rounds each)")


if __name__ == "__main__":
    main()
