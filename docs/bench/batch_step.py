"""What batching buys a plain step on this machine: `generate` without a draft on the shipped
target (float32), 16-token prompts, N new tokens, batch 1 and batch 8; ms per step and
output tokens/s (median of 3 timed runs after a compile run), then batch 8's tokens/s over
batch 1's: the most a server's eight clients can gain over one before any serving cost.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/batch_step.py [--new 256]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import specjax
from specjax.shipped import default_checkpoint


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--new", type=int, default=256)
    args = p.parse_args()
    target = specjax.load_model(default_checkpoint("target"))
    rates = {}
    for B in (1, 8):
        prompts, lengths = jnp.ones((B, 16), jnp.int32), jnp.full((B,), 16, jnp.int32)

        def run():
            return jax.block_until_ready(specjax.generate(target, prompts, lengths, max_new_tokens=args.new).tokens)

        run()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        rates[B] = B * args.new / seconds
        print(f"batch {B}: {1e3 * seconds / args.new:.2f} ms per step, {rates[B]:.0f} tokens/s")
    print(f"batch 8 / batch 1 tokens/s: {rates[8] / rates[1]:.2f}x")


if __name__ == "__main__":
    main()
