"""What deterministic=True costs and buys on this machine (CPU, bfloat16, the shipped pair).

1. Why: XLA's CPU matmul of [M, E] x [E, F] (bfloat16 in, float32 accumulation) gives a row
   other bits for other M, and a row of one matmul the same bits wherever it sits.
2. Rows of greedy speculative output that differ from plain greedy output, and tokens/s,
   without and with the flag: held-out prompts (48 tokens), 96 new tokens, batch 1 and 4;
   the draft model (K=4), the target drafting for itself (K=4) and EAGLE as a tree.
3. Whether a row decoded alone equals the same row decoded in a batch of 4.
4. The width of the fixed-shape bodies (specjax.models.exact.ROWS): plain and draft-model
   (K=4) tokens/s with the flag, batch 1 and 4.

    python docs/bench/exact.py > docs/bench/exact.txt
"""

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import specjax  # noqa: E402
from specjax.tools import measure  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints")


def matmul_rows():
    rng = np.random.RandomState(0)
    w = jnp.asarray(rng.randn(384, 1024) * 0.05, jnp.bfloat16)
    x = jnp.asarray(rng.randn(8, 384), jnp.bfloat16)
    f = jax.jit(lambda x, w: jnp.einsum("me,ef->mf", x, w, preferred_element_type=jnp.float32))
    ref = np.asarray(f(x[:2], w)[0])
    print("1. [M, 384] x [384, 1024], bfloat16 in, float32 out: row 0's bits against M = 2")
    for M in (1, 2, 3, 5, 8):
        print(f"   M={M}: {'same' if np.array_equal(np.asarray(f(x[:M], w)[0]), ref) else 'different'}")
    moved = x[:5].at[4].set(x[0]).at[0].set(x[3])
    print(f"   M=5, the row at index 4 instead of 0: "
          f"{'same' if np.array_equal(np.asarray(f(moved, w)[4]), np.asarray(f(x[:5], w)[0])) else 'different'}")


def timed(target, padded, lengths, draft, K, deterministic):
    """(output, median seconds of 3 runs) of generate compiled ahead of time: 96 new tokens."""
    run = specjax.compile_generate(target, padded, lengths, draft=draft, num_draft_tokens=K, max_new_tokens=96,
                                   deterministic=deterministic)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        out = jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return out, float(np.median(times))


def main():
    matmul_rows()
    target = specjax.load_model(f"{ROOT}/target", dtype=jnp.bfloat16)
    draft = specjax.load_model(f"{ROOT}/draft", dtype=jnp.bfloat16)
    itself = specjax.load_model(f"{ROOT}/target", dtype=jnp.bfloat16)
    eagle = specjax.load_drafter(f"{ROOT}/eagle", specjax.Tree(4, 2, 8))
    tokenizer = specjax.load_tokenizer(f"{ROOT}/target")
    prompts = measure.held_out_prompts(tokenizer, 8, 48, seed=3)
    drafters = {"plain": (None, None), "draft model K=4": (draft, 4), "itself K=4": (itself, 4),
                "EAGLE tree(4,2,8)": (eagle, None)}
    print("\n2. held-out prompts of 48 tokens, 96 new tokens, bfloat16 on CPU; rows differing from plain "
          "greedy decoding with the same flag, and from plain greedy decoding with the flag on; tokens/s: "
          "median of 3 runs")
    print(f"{'batch':>5} {'drafter':<20} {'flag':<5} {'tok/s':>7} {'vs plain, same flag':>20} "
          f"{'vs plain, flag on':>18}")
    first_rows = {}  # (drafter, flag) -> the first prompt's row at each batch size
    for batch in (1, 4):
        padded, lengths = specjax.pad_prompts(prompts[:batch])
        references = {}
        for deterministic in (True, False):
            for name, (d, K) in drafters.items():
                out, seconds = timed(target, padded, lengths, d, K, deterministic)
                rows = [r[:n] for r, n in zip(np.asarray(out.tokens).tolist(), np.asarray(out.num_tokens))]
                references.setdefault(deterministic, rows)
                first_rows.setdefault((name, deterministic), []).append(rows[0])

                def differing(reference):
                    return f"{sum(a != b for a, b in zip(rows, reference))} of {batch}"
                print(f"{batch:>5} {name:<20} {'on' if deterministic else 'off':<5} "
                      f"{sum(map(len, rows)) / seconds:>7.1f} {differing(references[deterministic]):>20} "
                      f"{differing(references[True]):>18}", flush=True)
    print("\n3. the first prompt's row at batch 1 against its row at batch 4")
    for (name, deterministic), (alone, in_batch) in first_rows.items():
        print(f"   {name:<20} flag {'on ' if deterministic else 'off'}: {'equal' if alone == in_batch else 'different'}")
    chunk_widths(target, draft, prompts)


def chunk_widths(target, draft, prompts):
    from specjax.models import exact

    shipped = exact.ROWS
    print(f"\n4. body width (ROWS; shipped: {shipped}): tokens/s with the flag, median of 3")
    print(f"{'ROWS':>4} {'batch':>5} {'plain':>7} {'K=4':>7} {'ratio':>6}")
    for rows in (8, 16, 32):
        exact.ROWS = rows
        jax.clear_caches()  # the loop is traced again with this width
        for batch in (1, 4):
            padded, lengths = specjax.pad_prompts(prompts[:batch])
            rate = {}
            for name, d, K in (("plain", None, None), ("draft", draft, 4)):
                out, seconds = timed(target, padded, lengths, d, K, True)
                rate[name] = int(np.asarray(out.num_tokens).sum()) / seconds
            print(f"{rows:>4} {batch:>5} {rate['plain']:>7.1f} {rate['draft']:>7.1f} "
                  f"{rate['draft'] / rate['plain']:>6.2f}", flush=True)
    exact.ROWS = shipped


if __name__ == "__main__":
    main()
