"""What one step of the compiled decoding loop launches: the operations of `generate`'s
while-loop body after XLA's optimisations (fusions, library calls such as dots and
custom calls, and the few unfused ops that remain), for the shipped pair. On a GPU each is
a kernel launch, and a small model's step is bound by launches (docs/bench/gpu); on this
CPU the count is the same program structure, compiled for the CPU.

Counted in the body's own computation and in the loops nested in it, each nested loop's
body as many times as XLA knows it runs (its known_trip_count: the draft's steps, a
scan over stacked layers, the PRNG's rounds); a conditional counts its largest branch.

    python docs/bench/step_ops.py [--specjax PATH]   # another checkout's specjax (before/after)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "opt-barrier"}


def computations(hlo: str) -> dict[str, list[str]]:
    """Name -> instruction lines of each computation in compiled HLO text."""
    out, name = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?(%?[\w.\-]+) ", line)
        if header and line.rstrip().endswith("{"):
            name = header.group(1).lstrip("%")
            out[name] = []
        elif name and line.startswith("  ") and " = " in line:
            out[name].append(line.strip())
    return out


def op_of(line: str) -> str:
    """The opcode of an instruction line ("%x = f32[2]{0} fusion(...)" -> "fusion")."""
    line = re.sub(r"/\*.*?\*/", "", line)  # tuple shapes carry /*index=5*/ comments
    found = re.search(r"=\s*(?:\([^=]*?\)|\S+)\s+([\w\-]+)\(", line)
    return found.group(1) if found else "?"


def launches(comps: dict, name: str) -> collections.Counter:
    """Kernels one run of computation `name` launches (see the module docstring)."""
    count = collections.Counter()
    for line in comps[name]:
        op = op_of(line)
        if op in FREE:
            continue
        if op == "while":
            body = re.search(r"body=%?([\w.\-]+)", line).group(1)
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
            for k, v in launches(comps, body).items():
                count[k] += v * (int(trips.group(1)) if trips else 1)
            continue
        if op == "conditional":  # its largest branch
            listed = re.search(r"branch_computations=\{([^}]*)\}", line)
            branches = (re.findall(r"%?([\w.\-]+)", listed.group(1)) if listed else
                        re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line))
            count.update(max((launches(comps, b) for b in branches), key=lambda c: sum(c.values())))
            continue
        count[op] += 1
    return count


def measure() -> dict:
    import importlib
    import inspect

    import jax.numpy as jnp

    import specjax

    loop = importlib.import_module("specjax.generate")  # the module (specjax.generate is the function)
    target = specjax.load_model(os.path.join(ROOT, "checkpoints/target"), dtype=jnp.float32)
    draft = specjax.load_model(os.path.join(ROOT, "checkpoints/draft"), dtype=jnp.float32)
    prompts, lengths = specjax.pad_prompts([[1, 2, 3, 4, 5]])
    out = {}
    for case, options in {"plain": {}, "chain K=4": dict(draft=draft, num_draft_tokens=4)}.items():
        bound = inspect.signature(loop.generate).bind(target, prompts, lengths, max_new_tokens=64, **options)
        bound.apply_defaults()
        args, static, _ = loop._prepare(**bound.arguments)
        hlo = loop._generate.lower(*args, **static, stream=None).compile().as_text()
        comps = computations(hlo)
        # The decoding loop: the entry computation's while with the largest body.
        entry = re.search(r"^ENTRY %?([\w.\-]+)", hlo, re.M).group(1)
        bodies = [re.search(r"body=%?([\w.\-]+)", line).group(1) for line in comps[entry] if op_of(line) == "while"]
        body = max(bodies, key=lambda b: len(comps[b]))
        count = launches(comps, body)
        out[case] = {"total": sum(count.values()), "by_op": dict(count.most_common(8))}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specjax", default=ROOT)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure()))
        return

    env = dict(os.environ, PYTHONPATH=os.path.abspath(args.specjax))
    result = json.loads(subprocess.run([sys.executable, __file__, "--measure"], env=env, check=True,
                                       capture_output=True, text=True).stdout.splitlines()[-1])
    print(f"specjax from {os.path.abspath(args.specjax)}: operations one loop step launches (CPU compile)")
    for case, r in result.items():
        print(f"  {case:<10} {r['total']:>5}   " + ", ".join(f"{k} {v}" for k, v in r["by_op"].items()))


if __name__ == "__main__":
    main()
