"""The engine's device call per sampling kind compiled for one v5e chip here (run nowhere),
for the state as this tree holds it: the Llama-3.2-1B target with its 2-layer draft, bf16,
8 slots of 2048 positions, 8 steps a call at K = 4, greedy, sampled and filtered rows (and,
where the tree has structured output, a filtered call whose rows hold the engine's default
room for a grammar): temporaries and weight- or cache-sized copies (`aot.large_copies`). Run at two revisions
(PYTHONPATH) to see what a change to the sampling state costs on a TPU.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 python docs/bench/sampling_aot.py
"""

import subprocess
import time

import jax

from specjax.sampling import KINDS
from specjax.tools import aot
from specjax.config import ModelConfig
from tests import real_configs as rc

target, draft = (aot.abstract_model(ModelConfig.from_hf_config(c))
                 for c in (rc.LLAMA_3_2_1B, rc.with_layers(rc.LLAMA_3_2_1B, 2)))
where = aot.on_device(aot.tpu_slice("v5e:1x1").devices[0])
specs = [aot.engine_program(target, draft, where, K=4, kind=kind, name=f"engine call K=4, 8 slots, {kind}")
         for kind in KINDS]
try:  # where rows may hold a grammar: the engine's default room for one, and the filtered call that walks it
    from specjax.serve.sizing import grammar_capacity

    room = grammar_capacity(None, None, target.config.vocab_size)
    specs.append(aot.engine_program(target, draft, where, K=4, kind="filtered", grammar=room,
                                    name=f"engine call K=4, 8 slots, filtered, grammar {room[0]} states"))
except ImportError:
    pass
programs = [aot.compile_spec(spec) for spec in specs]
rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(f"# docs/bench/sampling_aot.py at {rev}; jax {jax.__version__}, {time.strftime('%Y-%m-%d')}; bf16, v5e:1x1")
print(aot.report(programs))
