"""A token tree's speculative loop as XLA optimises it for an H100, compiled here without a
GPU (`aot.gpu_slice`, jax's CUDA plugin): the 1B pair (Llama-3.2-1B shape, a 2-layer draft,
bf16, cuDNN attention) drafting a dynamic Tree(4, 2, 8) at batch 8 (prompt 128 + 384 new),
greedy and sampled (temperature 1), and a sampled chain of 4: the bytes its kernels move (`hlo.traffic`; the loop's
body counted once, the prefill with it), its kernels, and the bytes of acceptance's and
sampling's kernels (a 128,256-token vocabulary).

    pip install 'jax[cuda12]==0.10.2'   # the plugin; no GPU, no driver
    JAX_PLATFORMS=cpu PYTHONPATH=$PWD python docs/bench/gpu_tree.py
"""

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

from aot import pair  # noqa: E402  (docs/bench/aot.py)
from specjax.tools import aot  # noqa: E402
from specjax.tools import hlo  # noqa: E402
from specjax.drafters import DraftModel  # noqa: E402
from specjax.memory import GB, MB  # noqa: E402
from specjax.tree import Tree  # noqa: E402

target, draft = pair("1b", None, "auto")
where = aot.on_device(aot.gpu_slice("h100").devices[0])
print(f"# {' '.join(sys.argv)}\n# jax {jax.__version__}, {time.strftime('%Y-%m-%d')}; compiled for "
      f"{where.device.device_kind} here (no GPU); 1b pair, bf16, batch 8")
for name, drafter, temperature in (("Tree(4, 2, 8)", DraftModel(draft, tree=Tree(4, 2, 8)), 0.0),
                                   ("Tree(4, 2, 8)", DraftModel(draft, tree=Tree(4, 2, 8)), 1.0),
                                   ("chain K=4", DraftModel(draft).resolve(4), 1.0)):
    spec = aot.loop_program(target, drafter, where, batch=8, prompt_len=128, max_new_tokens=384,
                            temperature=temperature)
    text = spec.fn.lower(*spec.args, **spec.kwargs).compile().as_text()
    kernels = hlo.kernels(text)
    part = {name: sum(k.bytes for k in kernels if f"specjax/{name}.py" in k.source) for name in ("acceptance", "sampling")}
    print(f"{name}, temperature {temperature}: moved {hlo.traffic(text) / GB:.3f} GB, {len(kernels)} kernels; acceptance "
          f"{part['acceptance'] / MB:.1f} MB, sampling {part['sampling'] / MB:.1f} MB", flush=True)
