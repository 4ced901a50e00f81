"""CPU speed of a sampled token tree before and after a change: the shipped pair, a dynamic
Tree(4, 2, 8), temperature 1, batch 4, 64-token prompts, 128 new tokens; then (with `chain`) a
greedy draft chain of K=4 on the same prompts; the median of 5 timed generate calls after one
that compiles. Run from each checkout, interleaved:

    JAX_PLATFORMS=cpu PYTHONPATH=$ROOT python docs/bench/cpu_tree.py $ROOT [chain]
"""

import sys, time, statistics
import jax, jax.numpy as jnp, numpy as np
import specjax
root = sys.argv[1]
target = specjax.load_model(f"{root}/checkpoints/target")
draft = specjax.load_drafter(f"{root}/checkpoints/draft")
model = draft.model if hasattr(draft, "model") else draft
B, P = 4, 64
prompts = jnp.asarray(np.random.default_rng(0).integers(5, 1000, (B, P)), jnp.int32)
lengths = jnp.full((B,), P, jnp.int32)
cases = {"sampled Tree(4,2,8)": dict(draft=specjax.DraftModel(model, tree=specjax.Tree(4, 2, 8)), temperature=1.0)}
if "chain" in sys.argv[2:]:
    cases["greedy chain K=4"] = dict(draft=specjax.DraftModel(model), num_draft_tokens=4)
for name, kw in cases.items():
    run = lambda: specjax.generate(target, prompts, lengths, key=jax.random.key(0), max_new_tokens=128, **kw)
    jax.block_until_ready(run().tokens)
    ts = []
    for _ in range(5):
        t = time.perf_counter(); out = run(); jax.block_until_ready(out.tokens); ts.append(time.perf_counter() - t)
    print(f"{root}: {name} batch 4, 128 new: median {statistics.median(ts)*1000:.0f} ms "
          f"({', '.join(f'{t*1000:.0f}' for t in ts)}), tokens {int(out.num_tokens.sum())}", flush=True)
