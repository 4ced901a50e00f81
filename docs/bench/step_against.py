"""The engine's step at a git revision against the working tree's, per sampling kind, side
by side in one run: two processes (one per source tree) each build an engine over the
shipped pair (float32, 8 slots of 256; plain, and the draft at K=4), fill its 8 rows
with greedy requests, then take turns: each round every process times each (K, kind) run
program over a call of `steps_per_call` steps (rows re-inserted first, so none finishes),
median of 5 calls. Printed: ms a step per round, then medians and working tree / revision.
What a change to the step costs rows that do not use it (a greedy, sampled or filtered
program's rows are the same here whatever their settings: the shapes are fixed). Where the
working tree's engine scores tokens (`Engine(max_logprobs=20)`), its filtered program that
also does ("filtered+logprobs") is timed too, against its own filtered one; where its rows
may have penalties, its filtered program over rows that all do ("filtered+penalties":
presence 0.5, frequency 0.5, repetition 1.2, temperature 1), likewise; where they may hold a
grammar, over rows that all hold a JSON object's (response_format json_object, the shipped
tokenizer's vocabulary; "filtered+grammar", temperature 1).

    python docs/bench/step_against.py --against REV [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from revision import ROOT, checked_out  # noqa: E402


def child():
    """Builds the engine, then answers each line on stdin with a JSON line {"K kind": ms}."""
    import inspect

    import jax
    import numpy as np

    import specjax
    from specjax.sampling import KINDS, Settings

    target = specjax.load_model(os.path.join(ROOT, "checkpoints", "target"))
    draft = specjax.DraftModel.load(os.path.join(ROOT, "checkpoints", "draft"))
    scoring = {"max_logprobs": 20} if "max_logprobs" in inspect.signature(specjax.Engine).parameters else {}
    engines = {K: specjax.Engine(target, draft=d, slots=8, max_len=256, num_draft_tokens=K, **scoring)
                for K, d in ((0, None), (4, draft))}
    penalties = "repetition_penalty" in Settings._fields
    grammars = "constrained" in Settings._fields
    extra = ((("filtered+logprobs",) if scoring else ()) + (("filtered+penalties",) if penalties else ())
             + (("filtered+grammar",) if grammars else ()))
    if grammars:
        tokenizer = specjax.load_tokenizer(os.path.join(ROOT, "checkpoints", "target"))
        vocabulary = specjax.Vocabulary.of(tokenizer, target.config.vocab_size)
        json_object = specjax.Grammar.json_schema({"type": "object"}, vocabulary)

    def filled(programs, kind):
        prompt = np.arange(5, 5 + programs.buckets[1], dtype=np.int32)
        stops = np.full((1, programs.stop_width), -1, np.int32)
        settings = programs.dummy_prompts(1, programs.buckets[1])[2]  # greedy, in each tree's own form
        more = {}
        if kind == "filtered+penalties":
            settings = [Settings(1.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)]
        if kind == "filtered+grammar":
            settings, more = [Settings(1.0, constrained=True)], {"grammars": [(json_object, ())]}
        row = programs.prefill([prompt], [programs.max_len], settings, stops, [0], **more)
        state = programs.empty()
        for slot in range(programs.slots):
            state = programs.insert(state, [slot], row)
        return state

    def time_all():
        out = {}
        for K, engine in engines.items():
            programs = engine.programs
            for kind in KINDS + extra:
                times = []
                for call in range(6):
                    state = jax.block_until_ready(filled(programs, kind))
                    start = time.perf_counter()
                    result = (programs.run(state, K, programs.slots, "filtered", logprobs=True)
                              if kind == "filtered+logprobs" else programs.run(state, K, programs.slots,
                                                                                kind.split("+")[0]))
                    taken = int(result[1].taken if len(result) == 2 else result[3])  # (state, Emitted) from 3293d80
                    if call:
                        times.append(1e3 * (time.perf_counter() - start) / taken)
                out[f"K={K} {kind}"] = statistics.median(times)
        return out

    time_all()  # compiles
    print("ready", flush=True)
    for _ in sys.stdin:
        print(json.dumps(time_all()), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, help="a git revision to compare the working tree with")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with checked_out(args.against) as old:
        procs = {}
        try:
            for name, tree in ((args.against, old), ("working tree", ROOT)):  # one at a time: compiles don't fight
                procs[name] = subprocess.Popen(
                    [sys.executable, os.path.join(ROOT, "docs", "bench", "step_against.py"), "--child"],
                    cwd=tree, env={**env, "PYTHONPATH": tree}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                assert procs[name].stdout.readline().strip() == "ready", name
            runs = {name: [] for name in procs}
            for r in range(args.rounds):
                for name, proc in procs.items():
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                    runs[name].append(json.loads(proc.stdout.readline()))
                    print(f"round {r}, {name}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in runs[name][-1].items()),
                          flush=True)
        finally:
            for proc in procs.values():
                proc.stdin.close()
                proc.wait(60)
    print(f"# medians of {args.rounds} rounds, ms a step (8 live rows); working tree / {args.against}")
    old_runs, new_runs = runs[args.against], runs["working tree"]
    median = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    for key in new_runs[0]:
        if key in old_runs[0]:
            a, b = median(old_runs, key), median(new_runs, key)
            print(f"{key}: {a:.2f} -> {b:.2f} ms ({b / a:.3f}x)")
        else:  # the working tree's own: against its filtered program
            a, b = median(new_runs, key.split("+")[0]), median(new_runs, key)
            print(f"{key} (working tree only): {b:.2f} ms, {b / a:.3f}x its filtered program's {a:.2f} ms")


if __name__ == "__main__":
    child() if "--child" in sys.argv else main()
