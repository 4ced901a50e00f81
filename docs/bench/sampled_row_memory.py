"""Temporaries per row of generate's compiled program (XLA's memory_analysis, compiled, not
run) for the chi-square tests' tiny pair (vocabulary 8, 2 layers, 3 new tokens): plain, a
chain of 2, a dynamic tree d3 k3 n8, a static tree with sampled siblings; greedy, sampled
(T=1) and filtered (T=1.3, top-k 6, top-p 0.9). Per row: (temporaries at 2,000 rows -
at 1,000) / 1,000. Runs against any checkout: PYTHONPATH=<checkout> python this file.
"""

import importlib
import sys
from pathlib import Path

import jax
import numpy as np

import specjax
from specjax.tree import Tree

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's tests
from tests.test_sampling import _tiny  # noqa: E402  (the chi-square pair)

compiled_memory = importlib.import_module("specjax.generate").compiled_memory
PROMPT = [1, 2, 3, 1, 2]
STATIC = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0)]  # tests/test_tree.py's


target = _tiny(0, 0.6)
draft = _tiny(1, 0.15, base=target)
drafters = {"plain": (None, None), "chain K=2": (draft, 2),
            "tree d3 k3 n8": (specjax.DraftModel(draft, Tree(depth=3, top_k=3, nodes=8)), None),
            "static tree, sampled siblings": (specjax.DraftModel(draft, Tree.from_paths(STATIC, "sampled")), None)}
settings = {"greedy": (0.0, 0, 1.0), "sampled": (1.0, 0, 1.0), "filtered": (1.3, 6, 0.9)}
print(f"{'drafter':<30} " + " ".join(f"{name:>9}" for name in settings) + "   (KB of temporaries per row)")
for name, (drafter, K) in drafters.items():
    row = []
    for t, k, p in settings.values():
        temp = {}
        for B in (1000, 2000):
            prompts = np.tile(np.array(PROMPT, np.int32), (B, 1))
            temp[B] = compiled_memory(target, prompts, np.full(B, len(PROMPT), np.int32), draft=drafter,
                                      num_draft_tokens=K, key=jax.random.key(0), max_new_tokens=3, temperature=t,
                                      top_k=k, top_p=p).temp_size_in_bytes
        row.append((temp[2000] - temp[1000]) / 1000 / 1e3)
    print(f"{name:<30} " + " ".join(f"{x:>9.1f}" for x in row), flush=True)
