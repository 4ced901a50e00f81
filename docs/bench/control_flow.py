"""Data-dependent loops and conditionals in generate's whole loop traced for CUDA
(`aot.control_flow`: `while` and `cond` in the jaxpr; on a GPU each reads its predicate back to
the host), for the drafters and sampling kinds of tests/test_aot.py's tiny pair, and for the
Llama-3.2-1B pair over a 640-slot cache (the blockwise attention). Traced only: nothing compiles.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/control_flow.py
"""

import collections

import jax

from specjax.tools import aot
from specjax.config import ModelConfig
from specjax.drafters import DraftModel, Eagle3, EarlyExit, PromptLookup
from specjax.tree import Tree
from tests import real_configs as rc
from tests.test_aot import DRAFT, TARGET

cpu = aot.on_device(jax.devices("cpu")[0])
eagle3 = jax.eval_shape(lambda: Eagle3.init(TARGET, jax.random.key(0)))
big, big_draft = (aot.abstract_model(ModelConfig.from_hf_config(c))
                  for c in (rc.LLAMA_3_2_1B, rc.with_layers(rc.LLAMA_3_2_1B, 2)))
specs = [aot.loop_program(TARGET, None, cpu, name="plain"),
         aot.loop_program(TARGET, DRAFT, cpu, num_draft_tokens=4, name="chain 4, greedy"),
         aot.loop_program(TARGET, DRAFT, cpu, num_draft_tokens=4, temperature=0.7, name="chain 4, T=0.7"),
         aot.loop_program(TARGET, DRAFT, cpu, num_draft_tokens=4, temperature=0.7, top_p=0.9,
                          name="chain 4, T=0.7, top-p"),
         aot.loop_program(TARGET, DraftModel(DRAFT, Tree(3, 2, 6)), cpu, name="Tree(3,2,6), greedy"),
         aot.loop_program(TARGET, eagle3, cpu, num_draft_tokens=4, name="EAGLE-3"),
         aot.loop_program(TARGET, EarlyExit(1), cpu, num_draft_tokens=3, name="early exit"),
         aot.loop_program(TARGET, PromptLookup(), cpu, num_draft_tokens=3, name="prompt lookup"),
         aot.loop_program(big, big_draft, cpu, num_draft_tokens=4, prompt_len=128, max_new_tokens=384,
                          name="1B pair, chain 4, 640 slots")]
for spec in specs:
    found = aot.control_flow(spec)
    where = collections.Counter(f"{b.op} at {b.source}" for b in found)
    print(f"{spec.name:<30} {len(found):>3}: " + "; ".join(f"{n} x {w}" for w, n in where.items()), flush=True)
