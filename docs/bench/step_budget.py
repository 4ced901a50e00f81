"""Where one speculative step's time goes on this CPU, and what that allows: float32, the
shipped checkpoints, batch 1, medians (each call jitted, timed alone, dispatch included).

1. Weight reads: a stack of 12 [384, 2048] float32 matrices (37.7 MB, more than the 2 MB
   L2 each core has) multiplied by M rows: what a pass that reads every weight once costs
   as it scores more tokens.
2. The target's pass over W tokens (a KV cache of 256 slots, at position 100), W = 1..8.
3. One draft step of each drafter (1 token): the draft model, EAGLE, the shipped EAGLE-3
   (a 1024-token draft vocabulary) and the same EAGLE-3 read out by the target's whole
   head instead (4096 tokens), with the bytes of weights each reads.
4. ms per step of the whole compiled loop on one held-out prompt (96 new tokens): plain,
   prompt lookup (drafting costs almost nothing there: the step is verification and
   acceptance), the draft model and the two EAGLE-3s, chains of 5 (the second's layer was
   trained for its own head, so only its ms per step, not its steps, means anything).

    python docs/bench/step_budget.py > docs/bench/step_budget.txt
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import specjax  # noqa: E402
from specjax.cache import KVCache  # noqa: E402
from specjax.tools.measure import held_out_prompts, median_time  # noqa: E402
from specjax.memory import nbytes  # noqa: E402
from specjax.models import apply  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints")


def median_ms(f, *args, n=200):
    return median_time(lambda: jax.block_until_ready(f(*args)), n) * 1e3


def weight_reads():
    ws = [jax.random.normal(jax.random.key(i), (384, 2048)) for i in range(12)]
    total = sum(w.size * 4 for w in ws)
    f = jax.jit(lambda x, ws: sum((x @ w).sum() for w in ws))
    out = []
    for M in (1, 2, 4, 6, 8):
        ms = median_ms(f, jnp.ones((M, 384)), ws)
        out.append(f"M={M} {ms:.3f} ms ({total / ms / 1e6:.0f} GB/s)")
    print(f"1. {total / 1e6:.1f} MB of weights times M rows: " + "; ".join(out))


def target_widths(target):
    cache = KVCache.init(target.config, 1, 256)
    out = []
    for W in (1, 2, 4, 6, 8):
        tokens, positions = jnp.ones((1, W), jnp.int32), 100 + jnp.arange(W, dtype=jnp.int32)[None]
        f = jax.jit(lambda m, c, tokens=tokens, positions=positions: apply(m, tokens, positions, c)[0])
        out.append(f"W={W} {median_ms(f, target, cache):.3f}")
    print(f"2. the target's pass ({nbytes(target.params) / 1e6:.1f} MB of weights), ms: " + "; ".join(out))


def draft_steps(target, draft, drafters):
    tokens, positions = jnp.ones((1, 1), jnp.int32), jnp.full((1, 1), 100, jnp.int32)
    cache = KVCache.init(draft.config, 1, 256)
    f = jax.jit(lambda m, c: apply(m, tokens, positions, c)[0])
    out = [f"draft model {median_ms(f, draft, cache):.3f} ms ({nbytes(draft.params) / 1e6:.1f} MB)"]
    for name, d in drafters.items():
        d = d.bind(target)
        cache = KVCache.init(d.config, 1, 256)
        features = jnp.zeros((1, 1, target.config.hidden_size))  # a deeper step: the drafter's own output

        def step(d, cache):
            x, cache = d.advance(target, tokens, features, positions, cache)
            return d.read(target, x)

        head = target.config.vocab_size if getattr(d, "vocab", None) is None else d.vocab.shape[0]
        mb = (nbytes(d.params) + 4 * head * target.config.hidden_size * ("head" not in d.params)) / 1e6
        out.append(f"{name} {median_ms(jax.jit(step), d, cache):.3f} ms ({mb:.1f} MB with the head it reads)")
    print("3. one draft step: " + "; ".join(out))


def loop_steps(target, prompt, drafters):
    lengths = jnp.array([prompt.shape[1]])
    out = []
    for name, d in drafters.items():
        K = None if d is None else 5
        f = lambda d=d, K=K: specjax.generate(target, prompt, lengths, draft=d, num_draft_tokens=K,  # noqa: E731
                                              max_new_tokens=96)
        steps = int(f().stats.steps[0])
        ms = median_time(lambda: jax.block_until_ready(f().tokens), 7) * 1e3
        out.append(f"{name} {ms / steps:.2f} ms x {steps} steps "
                   f"({96 / steps:.2f} tok/step)")
    print("4. the loop, ms per step (prefill included): " + "; ".join(out))


def main():
    target = specjax.load_model(f"{ROOT}/target", dtype=jnp.float32)
    draft = specjax.load_model(f"{ROOT}/draft", dtype=jnp.float32)
    eagle3 = specjax.load_drafter(f"{ROOT}/eagle3")
    whole = eagle3.replace(params={k: v for k, v in eagle3.params.items() if k != "head"}, vocab=None)
    print(f"{jax.devices()[0].platform} float32, batch 1, the shipped checkpoints")
    weight_reads()
    target_widths(target)
    draft_steps(target, draft, {"EAGLE": specjax.load_drafter(f"{ROOT}/eagle"), "EAGLE-3": eagle3,
                                "EAGLE-3 4096": whole})
    prompt = jnp.asarray(np.array(held_out_prompts(specjax.load_tokenizer(f"{ROOT}/target"), 1, 64, seed=11)),
                         jnp.int32)
    loop_steps(target, prompt, {"plain": None, "prompt lookup": specjax.PromptLookup(),
                                "draft model": specjax.DraftModel(draft), "EAGLE-3": eagle3,
                                "EAGLE-3 4096": whole})


if __name__ == "__main__":
    main()
