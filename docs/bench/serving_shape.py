"""generate's speculative loop at a serving shape, compiled here for TPU slices (specjax/tools/aot.py):
the Llama-3.2-1B-shaped pair (a 2-layer draft of its shape, replicated on a mesh), 8 rows of
128 prompt tokens and 1,920 new (a 2,048-slot cache), a chain of 4, greedy; on one v5e chip
and on a v5e 2x2 slice (data 2 x model 2). Per device: temporaries, and every copy of 4 MB or
more in the optimised program (a layer's target cache is 8.4 MB a device on 2x2, the draft's
16.8 MB; a weight matrix 4-134 MB) with the source line behind it.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/serving_shape.py > docs/bench/serving_shape.txt
"""

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from specjax.tools import aot  # noqa: E402
from specjax.config import ModelConfig  # noqa: E402
from tests import real_configs as rc  # noqa: E402


def main():
    target = aot.abstract_model(ModelConfig.from_hf_config(rc.LLAMA_3_2_1B))
    draft = aot.abstract_model(ModelConfig.from_hf_config(rc.with_layers(rc.LLAMA_3_2_1B, 2)))
    print(f"# {' '.join(sys.argv)}\n# jax {jax.__version__}, {time.strftime('%Y-%m-%d')}; 1b pair, bf16, 8 rows, "
          "prompt 128 + 1920 new, chain K=4, greedy")
    for name in ("v5e:1x1", "v5e:2x2"):
        slice_ = aot.tpu_slice(name)
        if slice_.chips == 1:
            where, draft_rules = aot.on_device(slice_.devices[0]), None
        else:
            where, draft_rules = aot.on_mesh(slice_.mesh(2, 2)), (("batch", "data"),)
        spec = aot.loop_program(target, draft, where, batch=8, prompt_len=128, max_new_tokens=1920,
                                num_draft_tokens=4, draft_rules=draft_rules)
        program = aot.compile_spec(spec, copies_threshold=4 * 2**20)
        copies = {}
        for c in program.copies:
            copies[(c.op, c.shape, c.source)] = copies.get((c.op, c.shape, c.source), 0) + 1
        print(f"\n## {name}: compile {program.compile_seconds:.1f} s, temporaries {program.temporaries / 2**20:.1f} MB, "
              f"{len(program.copies)} copies >= 4 MB")
        for (op, shape, source), n in sorted(copies.items(), key=lambda kv: -kv[1]):
            print(f"  {n:>3} x {op} {shape} at {source}")


if __name__ == "__main__":
    main()
