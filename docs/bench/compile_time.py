"""How long `generate` takes to compile, for the shipped pair and a 32-layer target, on this
machine's backend: plain decoding, a draft chain (K=4) and a draft tree (Tree(6, 2, 20)).

Each case is compiled ahead of time with `specjax.compile_generate` (nothing runs), with no
persistent compilation cache, in a fresh process each so that no case warms another.
Prints seconds per case (median of --repeats fresh processes).

    python docs/bench/compile_time.py [--repeats 3] [--specjax PATH]

--specjax PATH imports specjax from another checkout (a before/after comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = [(pair, kind) for pair in ("shipped", "32-layer") for kind in ("plain", "chain K=4", "Tree(6,2,20)")]


def one(pair: str, kind: str) -> float:
    """Seconds to compile one case, in this process."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    import specjax
    from specjax.models import init

    target = specjax.load_model(os.path.join(ROOT, "checkpoints/target"), dtype=jnp.float32)
    draft = specjax.load_model(os.path.join(ROOT, "checkpoints/draft"), dtype=jnp.float32)
    if pair == "32-layer":  # the shipped target's width, 32 layers deep, random
        target = init(dataclasses.replace(target.config, num_layers=32), jax.random.key(0), jnp.float32)
    prompts, lengths = specjax.pad_prompts([[1, 2, 3, 4, 5]])
    options = {"plain": {}, "chain K=4": dict(draft=draft, num_draft_tokens=4),
               "Tree(6,2,20)": dict(draft=specjax.DraftModel(draft, tree=specjax.Tree(6, 2, 20)))}[kind]
    start = time.perf_counter()
    specjax.compile_generate(target, prompts, lengths, max_new_tokens=64, **options)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--specjax", default=ROOT, help="the checkout to import specjax from")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case here
    args = parser.parse_args()
    if args.case:
        print(json.dumps(one(*json.loads(args.case))))
        return
    env = dict(os.environ, PYTHONPATH=os.path.abspath(args.specjax), JAX_ENABLE_COMPILATION_CACHE="false")
    print(f"specjax from {os.path.abspath(args.specjax)}; median of {args.repeats} fresh processes")
    for case in CASES:
        times = [json.loads(subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], env=env,
                                           check=True, capture_output=True, text=True).stdout.splitlines()[-1])
                 for _ in range(args.repeats)]
        print(f"{case[0]:>9} {case[1]:>13}: {statistics.median(times):6.2f} s  "
              f"({', '.join(f'{t:.2f}' for t in times)})", flush=True)


if __name__ == "__main__":
    main()
