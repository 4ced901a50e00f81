"""Tokens/s at prompt lengths 256, 1,024 and 4,096, autoregressive and speculative (the
shipped draft, K=4), greedy, batch 1, for the specjax of the checkout given by --specjax
(default: the installed one; PYTHONPATH alone does not override an editable install, whose
import hook comes first). It checks out nothing itself. Issue 13's before/after, from the
repository root:

    git worktree add /tmp/before $(git rev-parse ec697bf^1)
    python docs/bench/long_context.py --label before --specjax /tmp/before
    python docs/bench/long_context.py --label after --specjax .

The shipped pair was trained with max_position_embeddings=1024; to reach 4,096 tokens the
limit is raised here (rotary positions extrapolate; the numbers are about speed, and the
draft agrees less often far beyond its training length, which the acceptance column shows).
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time


def _import_specjax_from(argv):
    """--specjax TREE: specjax is imported from TREE, not from the installed copy."""
    if "--specjax" in argv:
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        sys.path.insert(0, argv[argv.index("--specjax") + 1])


_import_specjax_from(sys.argv)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import specjax  # noqa: E402
from specjax.tools import bench  # noqa: E402

LENGTHS = (256, 1024, 4096)


def stretched(model, n):
    return model.replace(config=dataclasses.replace(model.config, max_position_embeddings=n))


def prompt_of(tokenizer, n):
    """Held-out stdlib code, n tokens (windows concatenated when no single file is long enough)."""
    ids = []
    for p in bench.held_out_prompts(tokenizer, 64, 512, seed=1):
        ids += p
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"not enough held-out text for {n} tokens")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", required=True)
    parser.add_argument("--specjax", help="a checkout whose specjax to measure (default: the installed one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    args = parser.parse_args()
    print(f"specjax from {specjax.__file__}", file=sys.stderr)
    target = stretched(specjax.load_model("checkpoints/target"), 8192)
    draft = stretched(specjax.load_model("checkpoints/draft"), 8192)
    tokenizer = specjax.load_tokenizer("checkpoints/target")
    rows = []
    for n in args.lengths:
        padded, lengths = specjax.pad_prompts([prompt_of(tokenizer, n)])
        for mode, d in (("autoregressive", None), ("speculative", draft)):
            out = {}

            def call():
                out["o"] = jax.block_until_ready(specjax.generate(
                    target, padded, lengths, draft=d, max_new_tokens=args.max_new_tokens,
                    num_draft_tokens=None if d is None else args.k))

            start = time.perf_counter()
            call()  # compile + first run
            first = time.perf_counter() - start
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            o = jax.tree.map(np.asarray, out["o"])
            tokens = int(o.num_tokens.sum())
            row = {"label": args.label, "prompt": n, "mode": mode, "tokens": tokens,
                   "median_s": statistics.median(times), "times_s": times, "first_call_s": first,
                   "tok_s": tokens / statistics.median(times),
                   "acceptance": (float(o.stats.accepted.sum() / o.stats.drafted.sum())
                                  if o.stats.drafted.sum() else None),
                   "tokens_out": o.tokens[0, : o.num_tokens[0]].tolist()}
            rows.append(row)
            print(f"{args.label:<7} prompt {n:>5} {mode:<15} {row['tok_s']:>8.1f} tok/s  (median of "
                  f"{args.repeats}: {row['median_s']:.3f} s; first call {first:.1f} s; acceptance "
                  f"{row['acceptance'] if row['acceptance'] is None else round(row['acceptance'], 2)})",
                  flush=True)
    print(json.dumps(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
