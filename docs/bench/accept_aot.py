"""Acceptance in the sampled speculative loop, compiled for one v5e chip here (run nowhere):
the 1B pair (Llama-3.2-1B shape, 128,256 ids, a 2-layer draft, bf16) at batch 8, temperature
1, drafting a chain of 4 (sampled siblings: q over the vocabulary) and a dynamic Tree(4, 2, 8)
(top-k siblings: deterministic candidates): the ops acceptance.py leaves in the optimised
program and the bytes they move (`hlo.kernels`), the whole program's, and its temporaries.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 python docs/bench/accept_aot.py
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

from aot import pair  # noqa: E402  (docs/bench/aot.py)
from specjax.tools import aot  # noqa: E402
from specjax.tools import hlo  # noqa: E402
from specjax.drafters import DraftModel  # noqa: E402
from specjax.memory import GB, MB  # noqa: E402
from specjax.tree import Tree  # noqa: E402

target, draft = pair("1b", None)
where = aot.on_device(aot.tpu_slice("v5e:1x1").devices[0])
print(f"# {' '.join(sys.argv)}\n# jax {jax.__version__}, {time.strftime('%Y-%m-%d')}; 1b pair on v5e:1x1, bf16, "
      f"batch 8, temperature 1")
for name, drafter, kwargs in (("chain K=4", draft, dict(num_draft_tokens=4)),
                              ("Tree(4, 2, 8)", DraftModel(draft, tree=Tree(4, 2, 8)), {})):
    spec = aot.loop_program(target, drafter, where, batch=8, max_new_tokens=384, temperature=1.0, **kwargs)
    program = spec.fn.lower(*spec.args, **spec.kwargs).compile()
    text = program.as_text()
    kernels = hlo.kernels(text)
    accepting = [k for k in kernels if "specjax/acceptance.py" in k.source]
    print(f"loop {name:<14} moved {hlo.traffic(text) / GB:.3f} GB, temps {program.memory_analysis().temp_size_in_bytes / MB:.1f} MB; "
          f"acceptance: {len(accepting)} ops, {sum(k.bytes for k in accepting) / MB:.1f} MB", flush=True)
