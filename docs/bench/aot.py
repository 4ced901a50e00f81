"""What a step costs on TPU slices we cannot reach, read from programs compiled here
(specjax/tools/aot.py): for a Llama-3.2-1B-shaped target with a 2-layer draft of its shape and a
Llama-3.1-8B-shaped target with Llama-3.2-1B as its draft (tests/real_configs.py), per
program (the one-token pass, the verification pass of K=4, the draft step, generate's
whole loop with a chain of 4, and the plain loop): compile time, per-device memory,
temporaries over weights, the weight- or cache-sized copies found in the optimised TPU
program, and the CUDA lowering's bytes accessed over the bytes the program must read.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/aot.py [--pairs 1b,8b]
        [--slices v5e:1x1,v5e:2x2,v6e:2x2] [--layers N] [--attention kernels] > docs/bench/aot.txt

--attention kernels: both models opt in to the attention kernels (Model.attention; a sharded
program keeps only the prefix kernel, under shard_map).
--layers N compiles N target layers (the draft keeps its own) to bound the time: every
layer is the same program, so weights and temporaries per layer scale, the head does not.
The loop's CUDA figure counts its while body once and its prefill too, so read it as a
ratio between programs, not as traffic per step.
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


def pair(name: str, layers: int | None, attention: str = "portable"):
    if name == "1b":
        target, draft = rc.LLAMA_3_2_1B, rc.with_layers(rc.LLAMA_3_2_1B, 2)
    elif name == "8b":
        target, draft = rc.LLAMA_3_1_8B, rc.LLAMA_3_2_1B
    else:
        raise SystemExit(f"unknown pair {name!r}: 1b or 8b")
    if layers:
        target = rc.with_layers(target, layers)
    return tuple(aot.abstract_model(ModelConfig.from_hf_config(c)).replace(attention=attention) for c in (target, draft))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="1b,8b")
    parser.add_argument("--slices", default="v5e:1x1,v5e:2x2,v6e:2x2")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--context", type=int, default=512, help="prompt + new tokens")
    parser.add_argument("--attention", default="portable", choices=("portable", "kernels"))
    args = parser.parse_args()
    print(f"# {' '.join(sys.argv)}\n# jax {jax.__version__}, {time.strftime('%Y-%m-%d')}; bf16; batch 1 on one chip, "
          f"2 on a slice (mesh data 2 x model 2, the draft replicated); prompt 128, context {args.context}; "
          f"attention {args.attention}")
    for name in args.pairs.split(","):
        target, draft = pair(name, args.layers, args.attention)
        for slice_name in args.slices.split(","):
            slice_ = aot.tpu_slice(slice_name)
            title = (f"\n## {name} pair ({target.config.num_layers} target layers, {draft.config.num_layers}-layer "
                     f"draft) on {slice_name} ({slice_.chips} chips, {slice_.hbm / 2**30:.0f} GiB each)")
            aot.instrument(target, draft, slice_name, context=args.context, prompt_len=128, title=title,
                           log=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
