"""What merging the engine's sampling kinds would cost (issue 59: fewer programs): greedy
requests served by the greedy program (as the engine does), and by the sampled and the
filtered program (`kind_of` forced), whose per-row selects serve greedy rows too. The
shipped pair, float32, 8 slots of 192, greedy, 128 new tokens a request; one request alone
and 8 at once; plain and the draft at K=4. Median of 5 after a warm-up, in one process;
the outputs of each kind checked equal.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/engine_kinds.py
"""

from pathlib import Path

import specjax
import specjax.serve.engine as engine_module
from specjax.sampling import KINDS
from specjax.tools.measure import median_time

ROOT = Path(__file__).resolve().parents[2]
target = specjax.load_model(ROOT / "checkpoints" / "target")
draft = specjax.DraftModel.load(ROOT / "checkpoints" / "draft")
prompts = [list(range(5 + i, 69 + i)) for i in range(8)]
real = engine_module.kind_of

for name, d, K in (("plain", None, None), ("draft K=4", draft, 4)):
    for n in (1, 8):
        row, outputs = [], {}
        for kind in KINDS:
            engine_module.kind_of = lambda *a, kind=kind: max(real(*a), kind, key=KINDS.index)
            engine = specjax.Engine(target, draft=d, slots=8, max_len=192, num_draft_tokens=K)

            def load():
                requests = [engine.submit(p, max_new_tokens=128) for p in prompts[:n]]
                return [r.result() for r in requests]

            with engine:  # the warm-up load compiles what the load needs
                outputs[kind] = load()
                seconds = median_time(load, 5)
            row.append(f"{kind} {seconds:.3f} s")
        assert all(o == outputs[KINDS[0]] for o in outputs.values()), name
        print(f"{name}, {n} request(s) at once: " + "; ".join(row), flush=True)
engine_module.kind_of = real
