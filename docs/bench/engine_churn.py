"""The paged engine under churn, every request checked: several slots, pages of 8, prompts
longer than a prefill chunk (16) among short requests that finish, requests sharing a
cached prefix, cancellations (a request cancelled at its n-th chunk, n drawn), random gaps;
greedy, logprobs on. Each request's tokens and log-probabilities are compared with
`generate` on it alone (a cancelled one's: the first tokens it got), and the engine's rules
are checked every turn (`Scheduler.check`, `Runner.check`: the device's table is the host's
before every run, a row not live is done). tests/tiny.py's Llama, a draft near it or an
untrained EAGLE-3 layer (whose draft cache a wrong chunk start would corrupt); or its
mixtures of experts (Qwen3-MoE; DeepSeek-V3's, with latent attention, and an untrained MTP
layer of its own).

    JAX_PLATFORMS=cpu PYTHONPATH=$PWD python docs/bench/engine_churn.py [--target llama|qwen3_moe|deepseek_v3_moe]
        [--draft none|model|eagle3|mtp]
        [--slots 4] [--requests 40] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import numpy as np

import specjax
from specjax.drafters import Eagle3
from tests import tiny


def alone(target, prompt, budget, cache):
    key = (tuple(prompt), budget)
    if key not in cache:
        prompts, lengths = specjax.pad_prompts([prompt])
        out = specjax.generate(target, prompts, lengths, max_new_tokens=budget, logprobs=0)
        n = int(out.num_tokens[0])
        cache[key] = [int(t) for t in np.asarray(out.tokens[0, :n])], np.asarray(out.logprobs.chosen[0, :n])
    return cache[key]


def churn(engine, target, seed, requests, cache):
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(3, 97, 33)]
    asked = []
    for _ in range(requests):
        kind = rng.choice(["short", "shared", "long"], p=[0.4, 0.25, 0.35])
        prompt = ([int(t) for t in rng.integers(3, 97, rng.integers(1, 12))] if kind == "short" else
                  shared + [int(t) for t in rng.integers(3, 97, rng.integers(1, 9))] if kind == "shared" else
                  [int(t) for t in rng.integers(3, 97, rng.integers(17, 90))])
        cancel_at = int(rng.integers(1, 4)) if rng.random() < 0.2 else None  # its n-th chunk
        asked.append((prompt, int(rng.integers(2, 24)), cancel_at, float(rng.exponential(0.02))))
    errors, turns = [], [0]

    def check(engine):
        turns[0] += 1
        try:
            engine.scheduler.check()
        except AssertionError as e:
            errors.append(e)

    engine.turn_hook, engine.runner.check = check, True
    submitted = []
    with engine:
        for prompt, budget, cancel_at, gap in asked:
            chunks = []

            def listener(tokens, chunks=chunks, cancel_at=cancel_at, at=len(submitted)):
                if tokens:
                    chunks.append(tokens)
                    if len(chunks) == cancel_at:
                        submitted[at].cancel()

            submitted.append(engine.submit(prompt, max_new_tokens=budget, logprobs=0,
                                           listener=listener if cancel_at else None))
            time.sleep(gap)
        outputs = [r.result(timeout=600) for r in submitted]
    wrong, cancelled = [], 0
    for (prompt, budget, _, _), request, got in zip(asked, submitted, outputs):
        tokens, chosen = alone(target, prompt, budget, cache)
        scores = np.array([s for s, _ in request.scores])
        n = len(got)
        cancelled += request.finish_reason == "cancelled"
        full = request.finish_reason == "cancelled" or n == len(tokens)
        if not full or got != tokens[:n] or not np.allclose(scores, chosen[:n], atol=1e-4):
            wrong.append((len(prompt), budget, request.finish_reason))
    stats = engine.stats()
    idle = stats["free_pages"] == stats["kv_pages"] and engine.pages.owners() == []
    return dict(requests=len(asked), equal=len(asked) - len(wrong), wrong=wrong, cancelled=cancelled,
                turns=turns[0], rule_errors=len(errors), preemptions=stats["preemptions"],
                prefix_hits=stats["prefix_cache_hits"], every_page_back=idle)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="llama", choices=["llama", "qwen3_moe", "deepseek_v3_moe"],
                   help="tests/tiny.py's model (a mixture of experts; DeepSeek-V3's latent attention too)")
    p.add_argument("--draft", default="none", choices=["none", "model", "eagle3", "mtp"])
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--kv-pages", type=int, default=48)
    args = p.parse_args()
    folder = tempfile.mkdtemp()
    tiny.build(args.target).save_pretrained(folder)
    target = specjax.load_model(folder)
    draft = {"none": lambda: None, "model": lambda: tiny.noisy(target, 0.002, 1),
             "eagle3": lambda: Eagle3.init(target, jax.random.key(1)),
             "mtp": lambda: specjax.Mtp.init(target, jax.random.key(1))}[args.draft]()
    engine = specjax.Engine(target, draft=draft, slots=args.slots, max_len=128, steps_per_call=4,
                            kv_pages=args.kv_pages, page_size=8, prefill_chunk=16, max_logprobs=0,
                            num_draft_tokens=None if draft is None else (3,) * args.slots)
    cache = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        print(f"{args.target}, draft {args.draft}, {args.slots} slots, {args.kv_pages} pages of 8, seed {seed}:",
              churn(engine, target, seed, args.requests, cache), flush=True)


if __name__ == "__main__":
    main()
