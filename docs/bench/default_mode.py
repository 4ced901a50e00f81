"""Cheaper fixes for the default (not deterministic) mode in bfloat16, measured: do they make
a verification pass and a one-token pass agree more often, and what do they cost?

The shipped target in bfloat16 reads 128 held-out sequences (48 prompt tokens, then 96 more,
teacher-forced). The 96 positions are scored twice, by one-token passes (plain decoding)
and by passes of 5 tokens (a verification of K=4), over a cache that the same prompt pass
filled. Counted per variant: positions whose argmax differs between the two (where greedy
speculative and plain decoding can part), the median and largest |logit difference|
between the two, and positions whose one-token argmax differs from the float32 model's.
The cost is the one-token step's time (median of 100) at batch 1 and 4.

Variants: bfloat16 as shipped; a float32 residual stream (norm outputs rounded to bfloat16
before each matmul, the residual additions in float32); the same with the final hidden
state kept float32 into the head.

    python docs/bench/default_mode.py > docs/bench/default_mode.txt
"""

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import specjax  # noqa: E402
from specjax.tools import measure  # noqa: E402
from specjax.cache import KVCache, write  # noqa: E402
from specjax.models.layers import MLP, Attention, Norm  # noqa: E402
from specjax.models.transformer import embed_tokens, read_out, rotary_tables, slots_and_masks  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints")
PROMPT, NEW, K = 48, 96, 4


def decode_wide(c, params, tokens, positions, cache, float32_head):
    """transformer.decode with a float32 residual stream (cache passes, Llama family)."""
    dtype = params["embedding"].dtype
    x = embed_tokens(c, params["embedding"], tokens).astype(jnp.float32)
    slots, masks, kv_limit = slots_and_masks(c, positions, cache, None)
    angles = rotary_tables(c, positions)
    k_all, v_all = list(cache.k), list(cache.v)
    attn = Attention(c)
    for i, p in enumerate(params["layers"]):
        h = Norm(c).apply({"params": p["attn_norm"]}, x).astype(dtype)
        q, k, v = attn.apply({"params": p["attn"]}, h, angles[False], method=Attention.project_qkv)
        k_all[i], v_all[i] = write(k_all[i], k, slots), write(v_all[i], v, slots)
        x = x + attn.apply({"params": p["attn"]}, q, k_all[i], v_all[i], masks[False], kv_limit,
                           method=Attention.attend).astype(jnp.float32)
        h = Norm(c).apply({"params": p["mlp_norm"]}, x).astype(dtype)
        x = x + MLP(c).apply({"params": p["mlp"]}, h).astype(jnp.float32)
    hidden = Norm(c).apply({"params": params["final_norm"]}, x)
    head = params["embedding"]
    if float32_head:
        head = head.astype(jnp.float32)
    logits = read_out(c, head, hidden if float32_head else hidden.astype(dtype), transposed=True)
    return logits, cache.replace(k=tuple(k_all), v=tuple(v_all))


def variants(model):
    c = model.config

    def shipped(tokens, positions, cache):
        logits, _, cache = specjax.models.apply(model, tokens, positions, cache)
        return logits, cache
    return {"bfloat16 as shipped": shipped,
            "float32 residual": lambda t, p, cache: decode_wide(c, model.params, t, p, cache, False),
            "float32 residual and head": lambda t, p, cache: decode_wide(c, model.params, t, p, cache, True)}


def score(step, sequences, width):
    """float32 [B, NEW, V]: the logits at positions PROMPT-1 .. PROMPT+NEW-2 (each predicting
    the next token), by passes of `width` tokens after one prompt pass."""
    B = sequences.shape[0]
    run = jax.jit(step)
    cache = KVCache.init(_config, B, PROMPT + NEW, jnp.bfloat16)
    positions = jnp.broadcast_to(jnp.arange(PROMPT + NEW, dtype=jnp.int32), sequences.shape)
    logits, cache = run(sequences[:, :PROMPT - 1], positions[:, :PROMPT - 1], cache)
    out = []
    for start in range(PROMPT - 1, PROMPT - 1 + NEW, width):
        logits, cache = run(sequences[:, start:start + width], positions[:, start:start + width], cache)
        out.append(logits)
    return np.asarray(jnp.concatenate(out, axis=1)[:, :NEW])


def step_seconds(step, batch):
    cache = KVCache.init(_config, batch, PROMPT + NEW, jnp.bfloat16)
    run = jax.jit(step)
    tokens = jnp.ones((batch, 1), jnp.int32)
    positions = jnp.full((batch, 1), PROMPT, jnp.int32)
    jax.block_until_ready(run(tokens, positions, cache))
    times = []
    for _ in range(100):
        start = time.perf_counter()
        jax.block_until_ready(run(tokens, positions, cache))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main():
    global _config
    model = specjax.load_model(f"{ROOT}/target", dtype=jnp.bfloat16)
    reference = specjax.load_model(f"{ROOT}/target", dtype=jnp.float32)
    _config = model.config
    tokenizer = specjax.load_tokenizer(f"{ROOT}/target")
    sequences = jnp.asarray(measure.held_out_prompts(tokenizer, 128, PROMPT + NEW, seed=3), jnp.int32)
    truth = score(variants(reference)["bfloat16 as shipped"], sequences, 1).argmax(-1)
    print(f"cpu; shipped target, 128 held-out sequences, {NEW} teacher-forced positions each after a "
          f"{PROMPT}-token prompt; one-token passes against passes of {K + 1}")
    print(f"{'variant':<27} {'argmax differs':>14} {'median |d|':>10} {'max |d|':>8} {'vs float32':>10} "
          f"{'step ms, B=1':>12} {'B=4':>6}")
    for name, step in variants(model).items():
        one, chunk = score(step, sequences, 1), score(step, sequences, K + 1)
        d = np.abs(one - chunk)
        flips = int((one.argmax(-1) != chunk.argmax(-1)).sum())
        off = int((one.argmax(-1) != truth).sum())
        t1, t4 = step_seconds(step, 1), step_seconds(step, 4)
        print(f"{name:<27} {flips:>6} of {one.shape[0] * NEW:<5} {np.median(d):>10.2e} {d.max():>8.3f} "
              f"{off:>10} {t1 * 1e3:>12.3f} {t4 * 1e3:>6.3f}", flush=True)


if __name__ == "__main__":
    main()
