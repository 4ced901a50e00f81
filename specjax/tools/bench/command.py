"""The bench's command line: the flags of `specjax bench` (specjax.cli adds them to its
subcommand) and of `python -m specjax.tools.bench`, and which of specjax.tools.bench.pair's
runs they call. The default checkpoints come from specjax.shipped; it never imports
specjax.cli, and `--synthetic` is the cli's to dispatch (to specjax.tools.synthetic), not
this module's.
"""

from __future__ import annotations

from specjax.shipped import default_checkpoint
from specjax.tools.bench.pair import (PROFILE_TREE, PROFILE_TREE_NODES, measure_profile, run_divergence,
                                      run_pair, run_quick)
from specjax.tree import Tree

DEFAULT_OUT = "bench"  # --out, where not given (--synthetic writes nothing then)
DESCRIPTION = ("Benchmarks behind `specjax bench`: autoregressive vs speculative `generate`, timed side "
               "by side in one run, with the speedup theory predicts set beside the measured one.")


def main(argv=None):
    """`python -m specjax.tools.bench`: the bench's own flags, without the specjax command
    around them."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m specjax.tools.bench", description=DESCRIPTION)
    add_arguments(parser)
    run_from_args(parser.parse_args(argv))


def add_arguments(parser):
    """The bench's flags, on `specjax bench`'s parser or main's."""
    parser.add_argument("--target", default=default_checkpoint("target"),
                        help="the target model's folder or hub id (default: the shipped target)")
    parser.add_argument("--draft", default=default_checkpoint("draft"),
                        help="the draft model's folder or hub id (default: the shipped draft)")
    parser.add_argument("--tokenizer", metavar="PATH", default=None,
                        help="the target's tokenizer, which encodes the held-out prompts: a folder or hub id "
                             "(default: the target's own folder)")
    parser.add_argument("--synthetic", choices=["tiny", "gpt2-small", "llama-tiny", "llama-1b", "llama-8b"],
                        help="benchmark a random pair instead, in the backend's default dtype "
                             "(see specjax.tools.synthetic)")
    parser.add_argument("--draft-layers", type=int, default=2, help="--synthetic: the draft's depth")
    parser.add_argument("--sweep", action="store_true",
                        help="the whole bench (K 1..8 at two temperatures, batches 1 4 16, trees, every other "
                             "drafter, auto K, plots: tens of minutes on a CPU; writes bench.json as it goes). "
                             "Without it, or a section flag: plain vs the draft's chain side by side (quick.json)")
    parser.add_argument("-k", "--ks", type=int, nargs="+", default=None,
                        help="K values (default 4; with --sweep 1..8)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=None,
                        help="sampling temperatures to time (default 0; with --sweep 0 1, where 0, greedy, is "
                             "always run)")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="batch sizes to time (default 1; with --sweep, --profile and --dtype: 1 4 16)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="held-out prompts (default 8; 16 with a section flag or --sweep)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per configuration, the median reported (default 3; without a section "
                             "flag: 5 interleaved rounds of plain and speculative, their speedups' spread shown)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help=f"folder for the JSON reports and the plots (default {DEFAULT_OUT}; with --synthetic: "
                             f"synthetic.json, written only when --out is given)")
    parser.add_argument("--hf", action="store_true", help="also time transformers' generate (needs torch)")
    parser.add_argument("--trees-only", action="store_true",
                        help="only the chains-vs-trees comparison (writes trees.json)")
    parser.add_argument("--heads-only", action="store_true",
                        help="only the draft model vs trained Medusa/EAGLE heads (writes heads.json)")
    parser.add_argument("--profile", action="store_true",
                        help="only measure the cost profile for num_draft_tokens='auto' (writes profile.json; "
                             "K up to the largest -k)")
    parser.add_argument("--training-free-only", action="store_true",
                        help="only lookahead and retrieval against prompt lookup and the draft model "
                             "(writes training_free.json)")
    parser.add_argument("--auto-k-only", action="store_true",
                        help="only num_draft_tokens='auto' against every fixed K per batch size (writes auto_k.json)")
    parser.add_argument("--profile-tree", default=",".join(map(str, PROFILE_TREE)), metavar="DEPTH,TOP_K",
                        help="the dynamic tree family --profile measures node budgets of ('none': chains only)")
    parser.add_argument("--tree-nodes", type=int, nargs="+", default=list(PROFILE_TREE_NODES),
                        help="the node budgets --profile measures for --profile-tree")
    parser.add_argument("--datastore", default=default_checkpoint("datastore"), help="a datastore for retrieval")
    parser.add_argument("--cost-profile", default=None, help="profile.json for 'auto' (default: the shipped one)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="bfloat16: only count rows of greedy speculative output that diverge from "
                             "autoregressive output, and where (writes divergence_bfloat16.json)")
    parser.add_argument("--medusa", default=default_checkpoint("medusa"), help="a saved Medusa drafter")
    parser.add_argument("--eagle", default=default_checkpoint("eagle"), help="a saved EAGLE drafter")
    parser.add_argument("--eagle3", default=default_checkpoint("eagle3"), help="a saved EAGLE-3 drafter")
    parser.add_argument("--aot", metavar="SLICE", default=None,
                        help="only compile the pair's step programs for a TPU slice or a GPU here (v5e:1x1, "
                             "v6e:2x2, h100, ...; needs jax[tpu], or jax[cuda12] for a GPU) from their config.json "
                             "alone and print what each costs: temporaries over weights, the weights copied, a CUDA "
                             "program's bytes over what a step must read (writes aot.txt; -k's first value is K; "
                             "with --synthetic, its pair's shapes)")


def _tree_family(text: str) -> tuple[int, int] | None:
    """--profile-tree DEPTH,TOP_K, or none."""
    if text == "none":
        return None
    try:
        depth, top_k = (int(x) for x in text.split(","))
        Tree(depth, top_k, 1)
    except ValueError as e:
        raise SystemExit(f"--profile-tree {text!r}: give DEPTH,TOP_K such as 8,2, or none ({e})") from None
    return depth, top_k


def run_aot(args):
    """--aot SLICE: the pair's step programs (specjax.tools.aot.step_programs) compiled for a TPU
    slice or a GPU from the configs alone, the instrument's table printed and written to
    OUT/aot.txt."""
    import dataclasses
    from pathlib import Path

    from specjax.tools import aot
    from specjax.tools.plan import read_config

    if args.synthetic:
        from specjax.tools.synthetic import synthetic_config

        target = synthetic_config(args.synthetic)
        draft = dataclasses.replace(target, num_layers=args.draft_layers)
        name = f"synthetic {args.synthetic} with its first {args.draft_layers} layers as the draft"
    else:
        target = read_config(args.target)
        draft = None if args.draft == "none" else read_config(args.draft)
        name = f"{args.target} with {args.draft}"
    K = (args.ks or [4])[0]
    lines = [f"# specjax bench --aot {args.aot}: {name}; bf16, prompt {args.prompt_tokens}, "
             f"context {args.prompt_tokens + args.max_new_tokens}, K={K}"]

    def log(line):
        print(line, flush=True)
        lines.append(line)

    aot.instrument(aot.abstract_model(target), None if draft is None else aot.abstract_model(draft), args.aot,
                   context=args.prompt_tokens + args.max_new_tokens, K=K, prompt_len=args.prompt_tokens, log=log)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "aot.txt").write_text("\n".join(lines) + "\n")


def run_from_args(args):
    """Runs what the parsed flags ask for (--synthetic aside, but with --aot: specjax.cli runs
    specjax.tools.synthetic)."""
    if args.out is None:
        args.out = DEFAULT_OUT
    sections = ("sweep", "profile", "trees_only", "heads_only", "training_free_only", "auto_k_only", "hf")
    quick = not args.aot and args.dtype == "float32" and not any(getattr(args, name) for name in sections)
    if args.num_prompts is None:
        args.num_prompts = 8 if quick else 16
    if args.batches is None:
        args.batches = [1] if quick else [1, 4, 16]
    if args.temperatures is None:
        args.temperatures = [0.0] if quick else [0.0, 1.0]
    if args.repeats is None:
        args.repeats = 5 if quick else 3
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: at least 1")
    if quick:
        run_quick(args.target, args.draft, args.out, ks=tuple(args.ks or (4,)),
                  temperatures=tuple(args.temperatures), batches=tuple(args.batches),
                  num_prompts=args.num_prompts, prompt_tokens=args.prompt_tokens,
                  max_new_tokens=args.max_new_tokens, repeats=args.repeats, tokenizer=args.tokenizer)
        return
    if args.aot:
        others = ("profile", "trees_only", "heads_only", "training_free_only", "auto_k_only", "hf")
        if args.dtype != "float32" or any(getattr(args, name) for name in others):
            raise SystemExit("--aot compiles for a TPU or a GPU and runs nothing; leave out --dtype and "
                             + ", ".join("--" + name.replace("_", "-") for name in others))
        return run_aot(args)
    if args.dtype != "float32":
        sections = ("synthetic", "profile", "trees_only", "heads_only", "training_free_only", "auto_k_only", "hf")
        if any(getattr(args, name) for name in sections):
            raise SystemExit("--dtype bfloat16 runs the divergence count alone; leave out "
                             + ", ".join("--" + name.replace("_", "-") for name in sections))
        run_divergence(args.target, args.draft, args.dtype, args.out, ks=tuple(args.ks or (1, 2, 4, 6, 8)),
                       batches=tuple(args.batches), num_prompts=args.num_prompts, prompt_tokens=args.prompt_tokens,
                       max_new_tokens=args.max_new_tokens, repeats=args.repeats, tokenizer=args.tokenizer)
        return
    if args.profile:
        measure_profile(args.target, args.draft, args.out, max_k=max(args.ks or [8]), batches=tuple(args.batches),
                        num_prompts=args.num_prompts, prompt_tokens=args.prompt_tokens,
                        max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                        tree_family=_tree_family(args.profile_tree), tree_nodes=tuple(args.tree_nodes),
                        tokenizer=args.tokenizer)
        return
    run_pair(args.target, args.draft, args.out, ks=tuple(args.ks or range(1, 9)),
             temperatures=tuple(args.temperatures), batches=tuple(args.batches),
             num_prompts=args.num_prompts, prompt_tokens=args.prompt_tokens,
             max_new_tokens=args.max_new_tokens, repeats=args.repeats, hf=args.hf,
             only=next((name for name in ("trees", "heads", "training_free", "auto_k")
                        if getattr(args, f"{name}_only")), None),
             medusa=args.medusa, eagle=args.eagle, eagle3=args.eagle3, datastore=args.datastore,
             cost_profile=args.cost_profile, tokenizer=args.tokenizer)
