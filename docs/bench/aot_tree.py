"""Whether a token tree's speculative loop copies the cache on a TPU: the 1B pair (Llama-3.2-1B
shape, a 2-layer draft, bf16) drafting a dynamic Tree(4, 2, 8), its whole `generate` loop
compiled here for one v5e chip (prompt 128, 384 new tokens), beside the draft chain at K=4;
temporaries, and every weight- or cache-sized copy in the optimised program. The tree's
verification writes none of its nodes; after acceptance `cache.commit` writes the root and
the accepted path to their positions (one slice per row): does XLA's TPU compiler copy
whole cache buffers around it? (Until the deferred write, the nodes were written to a
region after the prefix and `cache.move` copied the path by point scatters.)

Then the tree's loop at batch 1 and 8, greedy and sampled: its ops (`hlo.kernels`, every loop
body counted once: a TPU program names no trip count), those of the cache's writes
and of the drafter's tree (cache.py: its join of the held tree; until the held tree,
transformer.py's gather of the tree region back from the cache) with the bytes they move, and
its copies.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 python docs/bench/aot_tree.py > docs/bench/aot_tree.txt
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
from specjax.memory import MB  # noqa: E402
from specjax.tree import Tree  # noqa: E402

target, draft = pair("1b", None)
where = aot.on_device(aot.tpu_slice("v5e:1x1").devices[0])
print(f"# {' '.join(sys.argv)}\n# jax {jax.__version__}, {time.strftime('%Y-%m-%d')}; 1b pair on v5e:1x1, bf16, "
      f"batch 1, prompt 128 + 384 new; attention portable")
programs = [aot.compile_spec(aot.loop_program(target, d, where, name=name, max_new_tokens=384, **kw))
            for name, d, kw in (("loop chain K=4", draft, dict(num_draft_tokens=4)),
                                ("loop Tree(4, 2, 8)", DraftModel(draft, tree=Tree(4, 2, 8)), {}))]
print(aot.report(programs))
for batch in (1, 8):
    for temperature in (0.0, 1.0):
        spec = aot.loop_program(target, DraftModel(draft, tree=Tree(4, 2, 8)), where, batch=batch, max_new_tokens=384,
                                temperature=temperature, name=f"loop Tree(4, 2, 8), batch {batch}, T={temperature}")
        start = time.perf_counter()
        program = spec.fn.lower(*spec.args, **spec.kwargs).compile()
        text = program.as_text()
        ops = hlo.kernels(text)
        cache_ops = [k for k in ops if "cache.py" in k.source]
        print(f"{spec.name:<36} compile {time.perf_counter() - start:5.1f}s temps "
              f"{program.memory_analysis().temp_size_in_bytes / MB:7.1f} MB ops {len(ops)} (cache writes, "
              f"held tree: {len(cache_ops)}, {sum(k.bytes for k in cache_ops) / MB:.1f} MB) "
              f"copies {len(hlo.large_copies(text, 4 * 2**20))}", flush=True)
