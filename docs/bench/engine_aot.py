"""The engine's device call compiled for one v5e chip here (run nowhere): the Llama-3.2-1B
target with its 2-layer draft, bf16, 8 slots of 2048 positions, 8 steps a call, K = 0 and 4
(and K = 4 over the first row alone, the call of one live request):
temporaries, weight- or cache-sized copies (`aot.large_copies`), compile time; beside them
generate's plain and speculative loops over the same rows and cache length, to tell the
engine's copies from the step's.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 python docs/bench/engine_aot.py
"""

import time

import jax

from specjax.tools import aot
from specjax.config import ModelConfig
from tests import real_configs as rc

target, draft = (aot.abstract_model(ModelConfig.from_hf_config(c))
                 for c in (rc.LLAMA_3_2_1B, rc.with_layers(rc.LLAMA_3_2_1B, 2)))
where = aot.on_device(aot.tpu_slice("v5e:1x1").devices[0])
specs = [aot.engine_program(target, draft, where, K=K) for K in (0, 4)]
specs.append(aot.engine_program(target, draft, where, K=4, width=1))  # one live request: a narrow call
specs.append(aot.loop_program(target, None, where, batch=8, prompt_len=128, max_new_tokens=2048 - 128,
                              name="generate plain, 8 rows, 2048"))
specs.append(aot.loop_program(target, draft, where, batch=8, prompt_len=128, max_new_tokens=2048 - 128,
                              num_draft_tokens=4, name="generate chain K=4, 8 rows"))
programs = [aot.compile_spec(spec) for spec in specs]
print(f"# docs/bench/engine_aot.py; jax {jax.__version__}, {time.strftime('%Y-%m-%d')}; bf16, v5e:1x1; the state "
      f"holds 8 slots x 2048 positions of the target's and the draft's caches")
print(aot.report(programs))
