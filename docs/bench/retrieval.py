"""Retrieval drafting on the shipped pair: tokens per target pass and tokens/s against
autoregressive decoding, greedy, batch 1, 8 held-out prompts of 64 tokens, 64 new tokens.

  python docs/bench/retrieval.py [--repeats 2]

1. with checkpoints/datastore (the training corpus; the prompts' modules are held out of it);
2. with a datastore that also holds the target's own greedy outputs (the text being generated).
"""

import argparse
import json

import numpy as np

import specjax
from specjax.bench import held_out_prompts, time_generate
from specjax.tree import Tree


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=8)
    args = parser.parse_args()
    target = specjax.load_model("checkpoints/target")
    tokenizer = specjax.load_tokenizer("checkpoints/target")
    corpus = specjax.Datastore.load("checkpoints/datastore")
    prompts = held_out_prompts(tokenizer, args.num_prompts, 64)
    auto, auto_rows = time_generate(target, prompts, 1, args.repeats, max_new_tokens=64)
    results = [{"drafter": "none", "tokens_per_s": auto.tokens_per_s, "tokens_per_pass": 1.0}]
    print(f"autoregressive: {auto.tokens_per_s:.1f} tokens/s")
    docs = np.load("checkpoints/datastore/tokens.npy")
    cuts = np.flatnonzero(docs == -1)
    corpus_docs = [d.tolist() for d in np.split(docs[:cuts[-1]], cuts[:-1] + 1)]
    corpus_docs = [[t for t in d if t >= 0] for d in corpus_docs]
    own = specjax.Datastore.build(corpus_docs + [p + r for p, r in zip(prompts, auto_rows)])
    for store_name, store in (("training corpus", corpus), ("corpus + the target's own outputs", own)):
        for shape, K in ((None, 4), (None, 8), (Tree(8, 2, 16), None)):
            drafter = specjax.Retrieval(store, tree=shape)
            name = f"retrieval, {store_name}, " + (f"chain K={K}" if shape is None else
                                                    f"tree depth {shape.depth} top_k {shape.top_k} nodes {shape.nodes}")
            run, rows = time_generate(target, prompts, 1, args.repeats, drafter=drafter, K=K, max_new_tokens=64)
            result = {"drafter": name, "tokens_per_s": run.tokens_per_s, "tokens_per_pass": run.tokens_per_pass,
                      "speedup": run.tokens_per_s / auto.tokens_per_s, "acceptance": run.acceptance,
                      "exact": rows == auto_rows}
            results.append(result)
            print(json.dumps(result))


if __name__ == "__main__":
    main()
