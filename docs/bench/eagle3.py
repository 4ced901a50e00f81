"""The shipped drafters side by side on held-out prompts that neither training nor the
bench's own sections use (seed 11 of `measure.held_out_prompts`: windows of held-out
standard-library modules): greedy, batch 1, float32 on this CPU, 96 new tokens. Per
drafter and shape: tokens per target pass, tokens/s, the ratio to plain decoding, whether
every row equals plain decoding's, and the fraction of steps that kept >= k drafted
tokens. Timing goes in rounds: each round times plain decoding and every (drafter, shape)
once, in turn, so that a slow spell of this shared machine slows them alike; tok/s is the
median over rounds, and the ratio the median of each round's ratio to that round's plain.

Drafter folders (or a draft model's Hugging Face folder) named as NAME=PATH join the
shipped ones; an EAGLE-3 that speaks the whole vocabulary is also run with a draft
vocabulary of the training corpus' 1024 most frequent tokens and no further training
(`Eagle3.with_vocab`: the target's head rows for them), as "NAME->1024".

    python docs/bench/eagle3.py [NAME=PATH ...] > docs/bench/eagle3.txt
"""

import os
import statistics
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax.numpy as jnp  # noqa: E402

import specjax  # noqa: E402
from specjax import Tree  # noqa: E402
from specjax.drafters.vocab import draft_vocabulary  # noqa: E402
from specjax.tools.measure import depth_acceptance, held_out_prompts, time_generate  # noqa: E402
from specjax.train import data  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints")
PROMPTS, PROMPT_TOKENS, NEW, ROUNDS = 8, 64, 96, 7


def main():
    target = specjax.load_model(f"{ROOT}/target", dtype=jnp.float32)
    prompts = held_out_prompts(specjax.load_tokenizer(f"{ROOT}/target"), PROMPTS, PROMPT_TOKENS, seed=11)
    # The draft model drafts from the vocabulary saved beside it, as `specjax generate` does.
    drafters = {"draft model": specjax.DraftModel.load(f"{ROOT}/draft", dtype=jnp.float32),
                "EAGLE": specjax.load_drafter(f"{ROOT}/eagle")}
    if os.path.exists(f"{ROOT}/eagle3/drafter.json"):
        drafters["EAGLE-3"] = specjax.load_drafter(f"{ROOT}/eagle3")
    for arg in sys.argv[1:]:
        name, path = arg.split("=", 1)
        is_model = os.path.exists(os.path.join(path, "config.json"))
        drafters[name] = (specjax.DraftModel(specjax.load_model(path, dtype=jnp.float32)) if is_model
                          else specjax.load_drafter(path))
    for name, drafter in list(drafters.items()):
        if isinstance(drafter, specjax.Eagle3) and drafter.vocab is None:
            with tempfile.TemporaryDirectory() as run_dir:  # the training corpus, encoded as training does
                stream = data.prepare(run_dir, tokenizer_folder=f"{ROOT}/target")[1]
            vocab = draft_vocabulary(stream, 1024, target.config.vocab_size)
            drafters[f"{name}->1024"] = drafter.replace(tree=None).with_vocab(target, vocab)
    shapes = [Tree.chain(4, "sampled"), Tree.chain(5, "sampled"), Tree.chain(6, "sampled"), Tree(6, 2, 20),
              Tree(8, 2, 30)]
    cases = {("plain", "-"): None, **{(name, str(tree)): drafter.replace(tree=tree)
                                      for name, drafter in drafters.items() for tree in shapes}}
    # A first run of each compiles it and gives its rows and traces; then the timed rounds.
    first = {case: time_generate(target, prompts, 1, 1, d, None, case[0], 0.0, NEW) for case, d in cases.items()}
    seconds = {case: [] for case in cases}
    for _ in range(ROUNDS):
        for case, d in cases.items():
            seconds[case].append(time_generate(target, prompts, 1, 1, d, None, case[0], 0.0, NEW, warm=False)[0].seconds)
    plain_run, plain_rows = first[("plain", "-")]
    tok_s = lambda case: first[case][0].tokens / statistics.median(seconds[case])  # noqa: E731
    print(f"cpu float32; {PROMPTS} held-out prompts of {PROMPT_TOKENS} tokens (seed 11), {NEW} new tokens, greedy, "
          f"batch 1; plain decoding {tok_s(('plain', '-')):.1f} tok/s; medians of {ROUNDS} rounds")
    print(f"{'drafter':<18} {'shape':<16} {'tok/pass':>8} {'tok/s':>8} {'vs plain':>8} "
          f"exact  kept >= k drafts, k = 1..")
    for (name, shape), d in cases.items():
        if d is None:
            continue
        run, rows = first[(name, shape)]
        ratio = statistics.median(p / s for p, s in zip(seconds[("plain", "-")], seconds[(name, shape)]))
        rates = " ".join(f"{a:.2f}" for a in depth_acceptance(run.traces, d.tree.depth))
        print(f"{name:<18} {shape:<16} {run.tokens_per_pass:>8.2f} {tok_s((name, shape)):>8.1f} {ratio:>8.2f} "
              f"{str(rows == plain_rows):<5}  {rates}", flush=True)


if __name__ == "__main__":
    main()
