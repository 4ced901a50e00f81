"""Bytes a pass accesses on a GPU over the bytes it must read, from the CUDA lowering traced
here (specjax/tools/aot.py: `cuda_bytes`, before XLA optimises it: every operand once), for a
Llama-3.1-8B-shaped target in bfloat16: the one-token pass and the verification pass of a
chain of 5 (6 tokens), at batch 1 over a 1K cache and at batch 8 over an 8K cache (where
the cache is about a third of the bytes), with attention portable and with
the model's opt-in kernels (Model.attention="kernels": the prefix through the Pallas prefix
kernel). Must read: every weight a pass reads once, plus the live cache.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/cuda_bytes.py [--layers N] > docs/bench/cuda_bytes.txt

A portable pass over more than layers.ATTENTION_BLOCK slots attends in a loop whose body
the lowering's cost analysis counts once, so its figure at 8K undercounts the cache; the
kernel's custom call is counted by its operands whole.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from specjax.tools import aot  # noqa: E402
from specjax.config import ModelConfig  # noqa: E402
from tests import real_configs as rc  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=None, help="target layers (default: all 32)")
    args = parser.parse_args()
    config = rc.LLAMA_3_1_8B if not args.layers else rc.with_layers(rc.LLAMA_3_1_8B, args.layers)
    model = aot.abstract_model(ModelConfig.from_hf_config(config))
    where = aot.on_device(jax.devices("cpu")[0])
    print(f"# {' '.join(sys.argv)}\n# jax {jax.__version__}, {time.strftime('%Y-%m-%d')}; Llama-3.1-8B shape, "
          f"{model.config.num_layers} layers, bf16; traced for CUDA here (no GPU)")
    print(f"{'program':<16} {'batch':>5} {'cache':>6} {'attention':>10} {'must read':>10} {'accessed':>10} {'ratio':>6}")
    for batch, context in ((1, 1024), (8, 8192)):
        for tokens in (1, 6):
            for attention in ("portable", "kernels"):
                spec = aot.pass_program(model.replace(attention=attention), where, batch=batch, context=context,
                                        tokens=tokens)
                accessed = aot.cuda_bytes(spec)
                name = "one-token pass" if tokens == 1 else "verify K=5"
                print(f"{name:<16} {batch:>5} {context:>6} {attention:>10} {spec.must_read / 1e9:>9.2f}G "
                      f"{accessed / 1e9:>9.2f}G {accessed / spec.must_read:>6.3f}", flush=True)


if __name__ == "__main__":
    main()
