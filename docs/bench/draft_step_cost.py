"""What one draft step costs against one target pass, on the shipped checkpoints: a
one-token pass of the target, of the draft model and of EAGLE's layer (each with a KV
cache of 256 slots, at position 100), every call jitted and timed alone, dispatch
included; medians of 300 calls, twice.

  python docs/bench/draft_step_cost.py
"""

import statistics
import time

import jax
import jax.numpy as jnp

import specjax
from specjax.cache import KVCache
from specjax.drafters.eagle import eagle_step
from specjax.models import apply


def median_seconds(f, *args, n=300):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(n):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    target = specjax.load_model("checkpoints/target")
    draft = specjax.load_model("checkpoints/draft")
    eagle = specjax.load_drafter("checkpoints/eagle").bind(target)
    tokens, positions = jnp.ones((1, 1), jnp.int32), jnp.full((1, 1), 100, jnp.int32)
    features = jnp.zeros((1, 1, target.config.hidden_size))
    one_pass = jax.jit(lambda m, cache: apply(m, tokens, positions, cache)[0])
    eagle_pass = jax.jit(lambda params, cache: eagle_step(eagle.config, params, target, tokens, features,
                                                          positions, cache)[0])
    caches = {name: KVCache.init(c, 1, 256) for name, c in
              (("target", target.config), ("draft", draft.config), ("eagle", eagle.config))}
    for _ in range(2):
        t = median_seconds(one_pass, target, caches["target"])
        e = median_seconds(eagle_pass, eagle.params, caches["eagle"])
        d = median_seconds(one_pass, draft, caches["draft"])
        print(f"target pass {t * 1e3:.3f} ms; EAGLE step {e * 1e3:.3f} ms ({e / t:.2f} of a pass); "
              f"draft model step {d * 1e3:.3f} ms ({d / t:.2f})")


if __name__ == "__main__":
    main()
