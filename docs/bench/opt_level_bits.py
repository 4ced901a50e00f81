"""Whether XLA's CPU backend at --xla_backend_optimization_level=0 (LLVM unoptimised: about a
third less compile time) computes the same bits as at its default: a hash over generate's
tokens and top-3 logprobs (the shipped pair, float32 and bfloat16, plain, a chain at K=4 and
a tree, greedy and sampled) and the target's logits over the prompts. Run it under both
flags and compare the printed hashes (tests/children.py compiles the suite's children at 0;
the suite's own processes keep the default, where these differ).

    JAX_PLATFORMS=cpu python docs/bench/opt_level_bits.py
    XLA_FLAGS=--xla_backend_optimization_level=0 JAX_PLATFORMS=cpu python docs/bench/opt_level_bits.py
"""

import hashlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import specjax

ROOT = Path(__file__).resolve().parents[2]
target = specjax.load_model(ROOT / "checkpoints" / "target")
draft = specjax.DraftModel.load(ROOT / "checkpoints" / "draft")
prompts, lengths = specjax.pad_prompts([list(range(5, 40)), list(range(100, 130)), [7, 8, 9]])
h = hashlib.sha256()
for dtype in (jnp.float32, jnp.bfloat16):
    t = target.replace(params=jax.tree.map(lambda w: w.astype(dtype), target.params))
    for d in (None, draft, specjax.DraftModel(draft.model, specjax.Tree(3, 2, 6))):
        for temperature in (0.0, 0.8):
            out = specjax.generate(t, prompts, lengths, draft=d, key=jax.random.key(0), max_new_tokens=32,
                                   temperature=temperature, top_k=20, logprobs=3)
            for x in (out.tokens, out.logprobs.chosen, out.logprobs.top):
                h.update(np.asarray(x).tobytes())
    h.update(np.asarray(specjax.forward(t, prompts), np.float32).tobytes())
print(h.hexdigest())
