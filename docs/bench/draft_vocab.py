"""A reduced draft vocabulary for the draft model, measured: the shipped draft (or the one
named) drafting from its whole head and from the training corpus' N most frequent tokens
(`DraftModel.with_vocab`, no retraining), on the held-out prompts of docs/bench/eagle3.py
(seed 11 of `measure.held_out_prompts`), greedy, batch 1, float32 on this CPU, 96 new
tokens, chains of 5 and 6. Per case: tokens per target pass, the ratio to plain decoding
(the median of per-round ratios; each round times plain and every case once, in turn),
whether every row equals plain decoding's, and the share of target tokens the vocabulary
covers in the held-out prompts' plain continuations.

    python docs/bench/draft_vocab.py [--draft FOLDER] [--rounds 7]   (its output: docs/bench/draft_vocab.txt)
"""

import argparse
import os
import statistics
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import specjax  # noqa: E402
from specjax import Tree  # noqa: E402
from specjax.tools.measure import held_out_prompts, time_generate  # noqa: E402
from specjax.train import data  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints")
SIZES = (256, 512, 1024, 2048)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft", default=f"{ROOT}/draft")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    target = specjax.load_model(f"{ROOT}/target", dtype=jnp.float32)
    draft = specjax.load_model(args.draft, dtype=jnp.float32)
    prompts = held_out_prompts(specjax.load_tokenizer(f"{ROOT}/target"), 8, 64, seed=11)
    with tempfile.TemporaryDirectory() as run_dir:  # the training corpus, encoded as training does
        stream = data.prepare(run_dir, tokenizer_folder=f"{ROOT}/target")[1]
    V = target.config.vocab_size
    vocabs = {"whole": None, **{str(n): specjax.draft_vocabulary(stream, n, V) for n in SIZES}}
    cases = {("plain", "-"): None}
    for name, ids in vocabs.items():
        drafter = specjax.DraftModel(draft) if ids is None else specjax.DraftModel(draft).with_vocab(ids)
        for K in (5, 6):
            cases[(name, f"chain{K}")] = drafter.replace(tree=Tree.chain(K, "sampled"))
    first = {case: time_generate(target, prompts, 1, 1, d, None, str(case), 0.0, 96) for case, d in cases.items()}
    plain_rows = first[("plain", "-")][1]
    generated = np.concatenate([np.asarray(row) for row in plain_rows])
    seconds = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case, d in cases.items():
            seconds[case].append(time_generate(target, prompts, 1, 1, d, None, str(case), 0.0, 96,
                                               warm=False)[0].seconds)
    print(f"# {args.draft}: {len(prompts)} held-out prompts, greedy, batch 1, 96 new tokens, {args.rounds} rounds")
    for case in cases:
        ratio = statistics.median(p / s for p, s in zip(seconds[("plain", "-")], seconds[case]))
        ids = vocabs.get(case[0])
        covered = "" if ids is None else f" covers {np.isin(generated, ids).mean():.3f} of plain's tokens"
        print(f"{case[0]:6s} {case[1]:7s} tok/pass {first[case][0].tokens_per_pass:.2f} x{ratio:.3f} "
              f"exact {first[case][1] == plain_rows}{covered}", flush=True)


if __name__ == "__main__":
    main()
