"""specjax's programs as XLA optimises them for an H100, compiled here without a GPU
(`aot.gpu_slice`: jax's CUDA plugin compiles deviceless), read three ways: the bytes their
kernels move over the bytes a step must read (`hlo.traffic`: weights plus the live cache),
their temporaries, and their weight- or cache-sized copies (`hlo.large_copies`).

Attention three ways: "auto" (what a bfloat16 model takes on a GPU: cuDNN's fused attention
where it applies), "prefix" (the kernels with cuDNN hidden, so that cached passes take
specjax's Pallas prefix kernel: what `gpubench.py attention` times as "prefix") and
"portable" (what a sharded, float32 or soft-capped model takes).

    pip install 'jax[cuda12]'   # the plugin and CUDA's libraries; no GPU, no driver
    JAX_PLATFORMS=cpu PYTHONPATH=$PWD python docs/bench/gpu_compiled.py > docs/bench/gpu_compiled.txt

A custom call (cuDNN, a Pallas kernel) counts its operands whole: what it skips past a
row's length, or re-reads, is not known here. Only a GPU says how long any of it takes.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the plugin loads without a driver when CUDA is not asked for

import jax  # noqa: E402

from specjax.tools import aot  # noqa: E402
from specjax.tools import hlo  # noqa: E402
from specjax.config import ModelConfig  # noqa: E402
from specjax.memory import GB, MB  # noqa: E402
from specjax.models import attention as paths  # noqa: E402
from tests import real_configs as rc  # noqa: E402


def compiled(spec: aot.Spec, attention: str):
    """The spec compiled for its GPU; "prefix" hides cuDNN while it traces."""
    available = paths._cudnn_available
    if attention == "prefix":
        paths._cudnn_available = lambda: False
    try:
        start = time.perf_counter()
        program = spec.fn.lower(*spec.args, **spec.kwargs).compile()
        return program, time.perf_counter() - start
    finally:
        paths._cudnn_available = available


def row(label: str, spec: aot.Spec, attention: str, ratio: bool = True) -> str:
    """One program's line; ratio=False for a program of several steps (a loop's body counts
    once, an engine call's steps each read the weights), whose moved bytes compare only with
    the same program's under another attention."""
    program, seconds = compiled(spec, attention)
    text = program.as_text()
    moved = hlo.traffic(text)
    copies = hlo.large_copies(text, 16 * MB)
    temps = program.memory_analysis().temp_size_in_bytes
    where = "; ".join(f"{c.op} {c.shape} at {c.source}" for c in copies[:2]) + (
        f"; +{len(copies) - 2} more" if len(copies) > 2 else "")
    share = f"{moved / spec.must_read:6.3f}" if ratio else f"{'-':>6}"
    return (f"{label:<34} {attention:<9} {spec.must_read / GB:8.2f}G {moved / GB:8.2f}G {share} "
            f"{temps / MB:9.1f}M {seconds:6.1f}s  {len(copies)} {where}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default="h100", help="h100 or h200")
    parser.add_argument("--layers", type=int, default=None, help="target layers (default: all)")
    args = parser.parse_args()
    gpu = aot.gpu_slice(args.gpu)
    where = aot.on_device(gpu.devices[0])
    big, small = rc.LLAMA_3_1_8B, rc.LLAMA_3_2_1B
    if args.layers:
        big, small = rc.with_layers(big, args.layers), rc.with_layers(small, args.layers)
    target, draft = (aot.abstract_model(ModelConfig.from_hf_config(c)) for c in (big, small))
    print(f"# {' '.join(sys.argv)}\n# jax {jax.__version__}, {time.strftime('%Y-%m-%d')}; compiled for "
          f"{gpu.devices[0].device_kind} here (no GPU); Llama-3.1-8B shape ({target.config.num_layers} layers), "
          f"draft Llama-3.2-1B shape, bf16")
    print(f"{'program':<34} {'attention':<9} {'must read':>9} {'moved':>9} {'ratio':>6} {'temps':>10} "
          f"{'compile':>7}  copies >= 16 MB")
    for batch, context in ((1, 1024), (8, 8192)):
        for tokens in (1, 6):
            for attention in ("auto", "prefix", "portable"):
                model = target.replace(attention="portable" if attention == "portable" else "auto")
                spec = aot.pass_program(model, where, batch=batch, context=context, tokens=tokens)
                name = "one-token pass" if tokens == 1 else "verify K=5"
                print(row(f"{name}, batch {batch}, {context // 1024}K", spec, attention), flush=True)
    quantized = aot.abstract_model(target.config, quantize="int8")
    for batch, context, tokens in ((1, 1024, 1), (8, 8192, 6)):  # int8 weights: converted inside the matmuls?
        spec = aot.pass_program(quantized, where, batch=batch, context=context, tokens=tokens)
        name = "one-token pass" if tokens == 1 else "verify K=5"
        print(row(f"int8 {name}, batch {batch}, {context // 1024}K", spec, "auto"), flush=True)
    for attention in ("auto", "portable"):
        t, d = (m.replace(attention=attention) for m in (target, draft))
        spec = aot.engine_program(t, d, where, slots=8, max_len=4096, K=4, steps=4)
        print(row("engine call K=4 x4, 8 slots x 4K", spec, attention, ratio=False), flush=True)
        spec = aot.loop_program(t, d, where, batch=8, prompt_len=1024, max_new_tokens=1024, num_draft_tokens=4)
        print(row("generate, chain K=4, 8 x 2K", spec, attention, ratio=False), flush=True)


if __name__ == "__main__":
    main()
