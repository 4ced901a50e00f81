"""CPU cost of the weights' layout: plain and draft-model (K=5) generate of the shipped pair, float32,
one random 64-token prompt, 128 new tokens, median of 5. Run from the repository root with
PYTHONPATH pointing at the specjax tree to measure, and a label: python docs/bench/layout_cpu.py LABEL."""
import sys, time, numpy as np, jax, jax.numpy as jnp, specjax
t = specjax.load_model("checkpoints/target", dtype=jnp.float32)
d = specjax.load_model("checkpoints/draft", dtype=jnp.float32)
prompts = np.random.RandomState(0).randint(5, 4000, (1, 64)).astype(np.int32)
def timed(**kw):
    jax.block_until_ready(specjax.generate(t, prompts, np.array([64], np.int32), max_new_tokens=128, **kw))
    xs = []
    for _ in range(5):
        s = time.perf_counter(); jax.block_until_ready(specjax.generate(t, prompts, np.array([64], np.int32), max_new_tokens=128, **kw)); xs.append(time.perf_counter() - s)
    return float(np.median(xs))
plain = timed(); spec = timed(draft=d, num_draft_tokens=5)
print(sys.argv[1], f"plain {plain*1e3:.0f} ms, draft K=5 {spec*1e3:.0f} ms, speedup {plain/spec:.2f}x")
