"""Draft models side by side against the shipped one, on the held-out prompts of
docs/bench/eagle3.py (seed 11 of `measure.held_out_prompts`), greedy, batch 1, float32 on
this CPU, 96 new tokens: per draft and shape (chains of 4, 5, 6 and Tree(6, 2, 20)),
tokens per target pass, the ratio to plain decoding (the median of per-round ratios; each
round times plain and every case once, in turn) and whether every row equals plain's.
A folder with a draft vocabulary (draft_vocab.json) is run twice: with its whole head
(NAME) and drafting from that vocabulary (NAME/Vd, as `specjax generate` runs it).

    python docs/bench/compare_drafts.py [NAME=FOLDER ...] [--rounds 5] [--shapes chain4,chain5]
"""

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax.numpy as jnp  # noqa: E402

import specjax  # noqa: E402
from specjax import Tree  # noqa: E402
from specjax.tools.measure import held_out_prompts, time_generate  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("drafts", nargs="*", metavar="NAME=FOLDER")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", default="chain4,chain5,chain6,d6k2n20")
    args = parser.parse_args()
    target = specjax.load_model(f"{ROOT}/target", dtype=jnp.float32)
    prompts = held_out_prompts(specjax.load_tokenizer(f"{ROOT}/target"), 8, 64, seed=11)
    folders = {"shipped": f"{ROOT}/draft", **dict(arg.split("=", 1) for arg in args.drafts)}
    shapes = {"chain4": Tree.chain(4, "sampled"), "chain5": Tree.chain(5, "sampled"),
              "chain6": Tree.chain(6, "sampled"), "d6k2n20": Tree(6, 2, 20)}
    cases = {("plain", "-"): None}
    for name, folder in folders.items():
        loaded = specjax.DraftModel.load(folder, dtype=jnp.float32)
        variants = {name: specjax.DraftModel(loaded.model)}
        if loaded.vocab is not None:
            variants[f"{name}/{loaded.vocab.shape[0]}"] = loaded
        for variant, drafter in variants.items():
            for shape in args.shapes.split(","):
                cases[(variant, shape)] = drafter.replace(tree=shapes[shape])
    first = {case: time_generate(target, prompts, 1, 1, d, None, str(case), 0.0, 96) for case, d in cases.items()}
    seconds = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case, d in cases.items():
            seconds[case].append(time_generate(target, prompts, 1, 1, d, None, str(case), 0.0, 96,
                                               warm=False)[0].seconds)
    for case in cases:
        ratio = statistics.median(p / s for p, s in zip(seconds[("plain", "-")], seconds[case]))
        print(f"{case[0]:14s} {case[1]:8s} tok/pass {first[case][0].tokens_per_pass:.2f} x{ratio:.3f} "
              f"exact {first[case][1] == first[('plain', '-')][1]}", flush=True)


if __name__ == "__main__":
    main()
