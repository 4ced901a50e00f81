"""A reduced draft vocabulary in the compiled speculative loop: a Llama-3.2-1B-shaped target
(128,256 tokens), bf16, an EAGLE-3 drafter drafting from 32,064 of its ids (every fourth),
one draft step (`aot.draft_program`: its catch-up and a chain of 4, or a dynamic tree of 4
deep, 2 wide, 8 nodes) and generate's whole loop (chain of 4) at batch 8, greedy and sampled
(temperature 1), compiled for one v5e chip here (run nowhere): the bytes a draft step's
kernels move (`hlo.traffic`) and the temporaries.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 python docs/bench/draft_vocab_aot.py

Run before and after drafting moved into the draft vocabulary's ids (draft_vocab_aot.txt).
"""

import time

import jax
import jax.numpy as jnp

from specjax.tools import aot
from specjax.tools import hlo
from specjax.config import ModelConfig
from specjax.drafters import Eagle3
from specjax.memory import GB, MB
from specjax.tree import Tree
from tests import real_configs as rc

target = aot.abstract_model(ModelConfig.from_hf_config(rc.LLAMA_3_2_1B))
Vd = len(range(0, target.config.vocab_size, 4))
eagle3 = jax.eval_shape(lambda: Eagle3.init(target, jax.random.key(0)))  # abstract: a head of its own over Vd ids
eagle3 = eagle3.replace(params={**eagle3.params, "head": {"kernel": jax.ShapeDtypeStruct(
    (target.config.hidden_size, Vd), jnp.float32)}}, vocab=jax.ShapeDtypeStruct((Vd,), jnp.int32))
where = aot.on_device(aot.tpu_slice("v5e:1x1").devices[0])
print(f"# jax {jax.__version__}, {time.strftime('%Y-%m-%d')}; v5e:1x1; target V = {target.config.vocab_size}, "
      f"draft vocabulary {Vd}")
for tree in (Tree.chain(4, "sampled"), Tree(4, 2, 8)):
    for temperature in (0.0, 1.0):
        spec = aot.draft_program(target, eagle3.replace(tree=tree), where, batch=8, temperature=temperature)
        start = time.perf_counter()
        program = spec.fn.lower(*spec.args, **spec.kwargs).compile()
        seconds = time.perf_counter() - start
        moved = hlo.traffic(program.as_text())
        temps = program.memory_analysis().temp_size_in_bytes
        print(f"EAGLE-3 {tree}, batch 8, temperature {temperature}: moved {moved / GB:.3f} GB, temporaries "
              f"{temps / MB:.1f} MB, weights {spec.must_read / GB:.3f} GB with the cache, compiled in {seconds:.1f} s")
for temperature in (0.0, 1.0):
    spec = aot.loop_program(target, eagle3, where, batch=8, num_draft_tokens=4, temperature=temperature)
    program = spec.fn.lower(*spec.args, **spec.kwargs).compile()
    print(f"loop EAGLE-3 chain 4, batch 8, temperature {temperature}: temporaries "
          f"{program.memory_analysis().temp_size_in_bytes / MB:.1f} MB")
