"""Benchmark: autoregressive vs speculative `generate`, timed side by side in one run.

    python -m specjax.bench                 # GPT-2-small-sized random target (124M params)
    python -m specjax.bench --size tiny     # a seconds-long smoke run

With no checkpoints to download, it builds its models: a random GPT-2-small-shaped target
whose layers past the first `--draft-layers` write only faintly into the residual stream
(their output projections scaled by 0.01), so that the target's own first layers make a
small draft that really agrees with it; and the target itself as a perfect draft (every
token accepted, cost ratio 1). For each it prints tokens/s, the speedup over autoregressive
decoding, acceptance, tokens per target pass, the measured time of one draft step and one
target pass, and the speedup theory predicts from those (`specjax.theory`), so that
measured / predicted shows what the loop wastes. Times are medians over --repeats runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import theory
from specjax.cache import KVCache
from specjax.config import ModelConfig
from specjax.generate import generate, pad_prompts
from specjax.models import Model, apply, init

SIZES = {
    "gpt2-small": dict(vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12,
                       intermediate_size=3072, max_position_embeddings=1024),
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4,
                 intermediate_size=256, max_position_embeddings=256),
}
RESIDUAL_OUTPUTS = (("attn", "o_kernel"), ("attn", "o_bias"), ("mlp", "proj_kernel"), ("mlp", "proj_bias"))


def build_pair(size: str, draft_layers: int, seed: int = 0):
    """(target, draft): the draft is the target's first `draft_layers` layers and head."""
    shape = SIZES[size]
    config = ModelConfig(model_type="gpt2", num_kv_heads=shape["num_heads"],
                         head_dim=shape["hidden_size"] // shape["num_heads"], norm_eps=1e-5,
                         tie_word_embeddings=True, qkv_bias=True, out_bias=True, mlp_bias=True,
                         **shape)
    target = init(config, jax.random.key(seed), jnp.float32)
    params = jax.tree.map(lambda x: x, target.params)  # a copy we may edit
    layers = params["layers"]
    for module, name in RESIDUAL_OUTPUTS:
        w = layers[module][name]
        layers[module][name] = w.at[draft_layers:].multiply(0.01)
    # Spread the embeddings so logits are far from uniform and greedy choices are stable.
    params["embedding"] = params["embedding"] * 10.0
    target = Model(config, params)
    draft_config = dataclasses.replace(config, num_layers=draft_layers)
    draft_params = dict(params, layers=jax.tree.map(lambda x: x[:draft_layers], params["layers"]))
    return target, Model(draft_config, draft_params)


def median_time(fn, repeats: int) -> float:
    fn()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pass_time(model: Model, batch: int, T: int, cache_len: int, repeats: int) -> float:
    """Median seconds of one cached forward pass over T tokens per row."""
    cache = KVCache.init(model.config, batch, cache_len, model.dtype)
    tokens = jnp.ones((batch, T), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + cache_len // 2, (batch, T))
    step = jax.jit(apply)
    return median_time(lambda: jax.block_until_ready(step(model, tokens, positions, cache)), repeats)


def run(size="gpt2-small", draft_layers=2, ks=(1, 2, 4, 6), batch=1, prompt_len=32,
        max_new_tokens=64, repeats=3, seed=0):
    target, small = build_pair(size, draft_layers, seed)
    rng = np.random.RandomState(seed)
    prompts, lengths = pad_prompts(
        [list(rng.randint(0, target.config.vocab_size, prompt_len)) for _ in range(batch)], bucket=32)
    cache_len = prompts.shape[1] + max_new_tokens

    def timed(draft, K):
        result = {}

        def call():
            result["out"] = jax.block_until_ready(generate(
                target, prompts, lengths, draft=draft, max_new_tokens=max_new_tokens,
                num_draft_tokens=K))
        seconds = median_time(call, repeats)
        out = result["out"]
        return seconds, int(out.num_tokens.sum()), out

    print(f"target: {size}, {target.config.num_params() / 1e6:.1f}M params; small draft: its first "
          f"{draft_layers} layers, {small.config.num_params() / 1e6:.1f}M params; "
          f"{jax.default_backend()} float32, batch {batch}, prompt {prompt_len}, "
          f"{max_new_tokens} new tokens, median of {repeats}")
    ar_seconds, ar_tokens, ar_out = timed(None, 0)
    ar_rate = ar_tokens / ar_seconds
    def passes(model, T):
        return pass_time(model, batch, T, cache_len, repeats * 5)

    t_target_1 = passes(target, 1)
    t_draft = {"target": (t_target_1, passes(target, 2)), "small": (passes(small, 1), passes(small, 2))}
    print(f"one target pass (1 token): {t_target_1 * 1e3:.2f} ms; one small-draft step: "
          f"{t_draft['small'][0] * 1e3:.2f} ms (c = {t_draft['small'][0] / t_target_1:.3f})")
    print(f"\n{'drafter':<8} {'K':>2} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'tok/pass':>8} "
          f"{'verify ms':>9} {'theory':>7} {'passes':>7} {'meas/theory':>11} {'meas/passes':>11}  exact")
    print(f"{'none':<8} {0:>2} {ar_rate:>8.1f} {1.0:>8.2f} {'-':>7} {1.0:>8.2f} "
          f"{t_target_1 * 1e3:>9.2f}")
    rows = []
    for name, draft in (("small", small), ("target", target)):
        for K in ks:
            seconds, tokens, out = timed(draft, K)
            steps, accepted, drafted = (int(x.sum()) for x in (out.stats.steps, out.stats.accepted,
                                                              out.stats.drafted))
            tokens_per_pass = tokens / steps
            alpha = theory.alpha_from_accepted(accepted / steps, K)
            t_step, t_catch_up = t_draft[name]
            predicted = theory.predicted_speedup(alpha, K, t_step / t_target_1)
            t_verify = passes(target, K + 1)
            # The models' own work per step: the draft's two-token catch-up, K-1 single
            # steps, one verification pass. What the loop adds beyond that is waste.
            from_passes = tokens_per_pass * t_target_1 / (t_catch_up + (K - 1) * t_step + t_verify)
            speedup = (tokens / seconds) / ar_rate
            exact = bool(np.array_equal(np.asarray(out.tokens), np.asarray(ar_out.tokens)))
            rows.append(dict(drafter=name, K=K, tokens_per_s=tokens / seconds, speedup=speedup,
                             acceptance=accepted / drafted, tokens_per_pass=tokens_per_pass,
                             predicted=predicted, from_passes=from_passes, exact=exact))
            print(f"{name:<8} {K:>2} {tokens / seconds:>8.1f} {speedup:>8.2f} {accepted / drafted:>7.2f} "
                  f"{tokens_per_pass:>8.2f} {t_verify * 1e3:>9.2f} {predicted:>7.2f} {from_passes:>7.2f} "
                  f"{speedup / predicted:>11.2f} {speedup / from_passes:>11.2f}  {exact}")
    print("\naccept: accepted / drafted. theory: Leviathan et al., E[tokens per pass] / (K c + 1), "
          "alpha fitted to the accepted drafts per step. passes: tokens per pass x the time of "
          "one target pass / the measured time of the step's model passes (draft catch-up, K-1 "
          "draft steps, verification). exact: output equals autoregressive decoding.")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="gpt2-small")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("-k", "--ks", type=int, nargs="+", default=[1, 2, 4, 6])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    run(args.size, args.draft_layers, tuple(args.ks), args.batch, args.prompt_len,
        args.max_new_tokens, args.repeats)


if __name__ == "__main__":
    main()
