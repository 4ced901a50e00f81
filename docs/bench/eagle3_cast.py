"""The EAGLE-3 speculative loop on one v5e chip (compiled here, run nowhere), Llama-3.2-1B
target, bf16, a float32 EAGLE-3 drafter as training leaves it: temporaries and converts of
a weight's shape (`aot.large_copies`).

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 python docs/bench/eagle3_cast.py

Run at a tree before and after the drafter's weights were cast when bound (eagle3_cast.txt).
"""

import jax

from specjax.tools import aot
from specjax.config import ModelConfig
from specjax.drafters import Eagle3
from tests import real_configs as rc

target = aot.abstract_model(ModelConfig.from_hf_config(rc.LLAMA_3_2_1B))
eagle3 = jax.eval_shape(lambda: Eagle3.init(target, jax.random.key(0)))
where = aot.on_device(aot.tpu_slice("v5e:1x1").devices[0])
program = aot.compile_spec(aot.loop_program(target, eagle3, where, batch=1, num_draft_tokens=4,
                                            name="loop EAGLE-3, K=4"))
converts = [c for c in program.copies if c.op == "convert"]
print(f"{program.name}: temporaries {program.temporaries / 2**20:.1f} MB, weights {program.weights / 2**20:.1f} MB, "
      f"{len(converts)} weight-shaped converts ({sum(c.bytes for c in converts) / 2**20:.1f} MB)")
for c in converts:
    print(f"  {c.op} {c.shape} {c.bytes / 2**20:.1f} MB at {c.source}")
