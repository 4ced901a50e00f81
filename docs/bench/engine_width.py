"""One request alone in an 8-slot engine, 128 new tokens, the shipped pair, float32, greedy:
a device call that steps only the rows in use (the engine's live widths) against one that
steps all eight (widths forced to (8,)), beside `generate` on the request alone. Median of 5
after a warm-up, in one process.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/engine_width.py
"""

from pathlib import Path

import numpy as np

import specjax
from specjax.tools.measure import median_time

ROOT = Path(__file__).resolve().parents[2]
target = specjax.load_model(ROOT / "checkpoints" / "target")
draft = specjax.DraftModel.load(ROOT / "checkpoints" / "draft")
prompt = list(range(5, 69))

for name, d, K in (("plain", None, None), ("draft K=4", draft, 4)):
    prompts, lengths = specjax.pad_prompts([prompt])
    alone = median_time(lambda: np.asarray(specjax.generate(target, prompts, lengths, draft=d, num_draft_tokens=K,
                                                            max_new_tokens=128).tokens), 5)
    row = [f"{name}: generate {alone:.3f} s"]
    for label, widths in (("live widths", None), ("all 8 rows", (8,))):
        engine = specjax.Engine(target, draft=d, slots=8, max_len=192, num_draft_tokens=K)
        if widths:
            engine.programs.widths = widths
        with engine.compile_all():
            row.append(f"engine, {label} {median_time(lambda: engine.submit(prompt, max_new_tokens=128).result(), 5):.3f} s")
    print("; ".join(row), flush=True)
