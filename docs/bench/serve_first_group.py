"""A grouped admission's first calls after the engine's background compile, in two source trees.

`specjax serve` compiles the prefills of several requests at once in the background
(`Engine.compile_all(groups_later=True)`, `Programs.compile_group`); the load benchmarks wait
for it to finish before they measure. This runs, in a child process per tree (--before: a
checkout to compare with, e.g. the parent commit; then this checkout), the shipped pair's
paged engine (float32, this CPU, --slots, --max-len) through that compile, then admits groups
of each (n, bucket) of --groups into a throwaway state, each twice: per call the time to its
result and the XLA compiles during it (jax.monitoring). No persistent compilation cache.

--load: instead, a `specjax serve` from each tree (the shipped pair, --slots, its default
compilation cache), both up and warm as serve_load.py starts them, then loaded in turn,
--rounds times, with serve_load.py's closed loop of --clients clients (64 requests of 128
tokens): a burst's first grouped admissions come in the first rounds.

    PYTHONPATH=$PWD python docs/bench/serve_first_group.py --before /tmp/parent [--slots 8]
    PYTHONPATH=$PWD python docs/bench/serve_first_group.py --before /tmp/parent --load --slots 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(slots: int, max_len: int, groups: list[tuple[int, int]]):
    import jax
    import numpy as np

    import specjax

    target = specjax.load_model(ROOT / "checkpoints/target")
    draft = specjax.load_model(ROOT / "checkpoints/draft")
    engine = specjax.Engine(target, draft=draft, slots=slots, max_len=max_len, kv_pages=slots * max_len // 16)
    start = time.perf_counter()
    engine.compile_all(groups_later=True)
    engine.wait_warm()
    print(json.dumps({"compile_all_and_background_s": round(time.perf_counter() - start, 1)}), flush=True)
    compiles = []

    def count(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(count)
    programs = engine.programs
    state = programs.set_table(programs.empty(), np.zeros((slots, programs.table_width), np.int32))
    jax.block_until_ready(state)
    for n, b in groups:
        for call in ("first", "second"):
            compiles.clear()
            t = time.perf_counter()
            state = jax.block_until_ready(programs.dummy_admit(state, n, b))
            print(json.dumps({"n": n, "bucket": b, "call": call, "ms": round(1e3 * (time.perf_counter() - t), 1),
                              "compiles": len(compiles)}), flush=True)


def load(trees: list, slots: int, clients: int, rounds: int):
    import asyncio

    sys.path.insert(0, str(Path(__file__).parent))
    import serve_load

    texts, servers = serve_load.prompts(64), []
    try:
        for name, tree in trees:
            servers.append((name, *serve_load.start("checkpoints/draft", slots, tree=tree)))
        for _, _, url in servers:
            asyncio.run(serve_load.load(url, "target", texts[:2], 1, float("inf"), 8, 0))  # warm, as serve_load
        for r in range(rounds):
            for name, _, url in servers:
                serve_load.settle()
                results, seconds = asyncio.run(serve_load.load(url, "target", texts, clients, float("inf"), 128, 0))
                print(json.dumps({"tree": name, "round": r, **{k: round(v, 1) for k, v in serve_load.summary(
                    results, seconds).items()}}), flush=True)
    finally:
        for _, proc, _ in servers:
            proc.kill()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", help="a source tree to compare with (e.g. a checkout of the parent commit)")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--groups", default="8x64,4x32,2x16", help="n x bucket, in the order admitted")
    p.add_argument("--load", action="store_true", help="servers under load instead (see above)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    groups = [tuple(int(x) for x in g.split("x")) for g in args.groups.split(",")]
    if args.child:
        return child(args.slots, args.max_len, groups)
    trees = ([("before", args.before)] if args.before else []) + [("after", str(ROOT))]
    if args.load:
        return load(trees, args.slots, args.clients, args.rounds)
    for name, tree in trees:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": tree}
        out = subprocess.run([sys.executable, __file__, "--child", "--slots", str(args.slots), "--max-len",
                              str(args.max_len), "--groups", args.groups], env=env, cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        for line in out.splitlines():
            print(json.dumps({"tree": name, **json.loads(line)}), flush=True)


if __name__ == "__main__":
    main()
