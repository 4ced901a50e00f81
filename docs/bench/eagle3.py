"""The shipped drafters side by side on held-out prompts that neither training nor the
bench's own sections use (seed 11 of `measure.held_out_prompts`: windows of held-out
standard-library modules): greedy, batch 1, float32 on this CPU, 96 new tokens. Per
drafter and shape: tokens per target pass, tokens/s (median of 3), the ratio to plain
decoding measured in the same run, whether every row equals plain decoding's, and the
fraction of steps that kept >= k drafted tokens. Beside the shipped EAGLE-3, the same
drafter with a reduced draft vocabulary of the training corpus' 1024 most frequent tokens
and no further training (`Eagle3.with_vocab`: the target's head rows for them), and any
drafter folder named as NAME=PATH.

    python docs/bench/eagle3.py [NAME=PATH ...] > docs/bench/eagle3.txt
"""

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax.numpy as jnp  # noqa: E402

import specjax  # noqa: E402
from specjax import Tree  # noqa: E402
from specjax.drafters.eagle3 import draft_vocabulary  # noqa: E402
from specjax.measure import depth_acceptance, held_out_prompts, time_generate  # noqa: E402
from specjax.train import data  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints")
PROMPTS, PROMPT_TOKENS, NEW, REPEATS = 8, 64, 96, 3


def main():
    target = specjax.load_model(f"{ROOT}/target", dtype=jnp.float32)
    draft = specjax.load_model(f"{ROOT}/draft", dtype=jnp.float32)
    prompts = held_out_prompts(specjax.load_tokenizer(f"{ROOT}/target"), PROMPTS, PROMPT_TOKENS, seed=11)
    drafters = {"draft model": specjax.DraftModel(draft), "EAGLE": specjax.load_drafter(f"{ROOT}/eagle")}
    if os.path.exists(f"{ROOT}/eagle3/drafter.json"):
        drafters["EAGLE-3"] = eagle3 = specjax.load_drafter(f"{ROOT}/eagle3")
        if eagle3.vocab is None:
            with tempfile.TemporaryDirectory() as run_dir:  # the training corpus, encoded as training does
                stream = data.prepare(run_dir, tokenizer_folder=f"{ROOT}/target")[1]
            vocab = draft_vocabulary(stream, 1024, target.config.vocab_size)
            drafters["EAGLE-3 Vd1024"] = eagle3.with_vocab(target, vocab)
    for arg in sys.argv[1:]:
        name, path = arg.split("=", 1)
        drafters[name] = specjax.load_drafter(path)
    shapes = [Tree.chain(4, "sampled"), Tree.chain(5, "sampled"), Tree.chain(6, "sampled"), Tree(6, 2, 20),
              Tree(8, 2, 30)]
    plain, plain_rows = time_generate(target, prompts, 1, REPEATS, None, 0, "plain", 0.0, NEW)
    print(f"cpu float32; {PROMPTS} held-out prompts of {PROMPT_TOKENS} tokens (seed 11), {NEW} new tokens, greedy, "
          f"batch 1; plain decoding {plain.tokens_per_s:.1f} tok/s (median of {REPEATS})")
    print(f"{'drafter':<14} {'shape':<16} {'tok/pass':>8} {'tok/s':>8} {'vs plain':>8} "
          f"exact  kept >= k drafts, k = 1..")
    for name, drafter in drafters.items():
        for tree in shapes:
            run, rows = time_generate(target, prompts, 1, REPEATS, drafter.replace(tree=tree), None, name, 0.0, NEW)
            rates = " ".join(f"{a:.2f}" for a in depth_acceptance(run.traces, tree.depth))
            print(f"{name:<14} {str(tree):<16} {run.tokens_per_pass:>8.2f} {run.tokens_per_s:>8.1f} "
                  f"{run.tokens_per_s / plain.tokens_per_s:>8.2f} {str(rows == plain_rows):<5}  {rates}", flush=True)


if __name__ == "__main__":
    main()
