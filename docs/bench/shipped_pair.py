"""The shipped pair as the CPU benchmarks load it (`load_pair`): the target and its draft in
float32, and the target's tokenizer, from this checkout's checkpoints/."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_pair():
    """(target, draft, tokenizer), with the specjax importable here (PYTHONPATH)."""
    import jax.numpy as jnp

    import specjax

    target = specjax.load_model(os.path.join(ROOT, "checkpoints/target"), dtype=jnp.float32)
    draft = specjax.load_model(os.path.join(ROOT, "checkpoints/draft"), dtype=jnp.float32)
    return target, draft, specjax.load_tokenizer(os.path.join(ROOT, "checkpoints/target"))
