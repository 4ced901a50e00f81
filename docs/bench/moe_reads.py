"""What a mixture of experts' pass reads: a Qwen3-30B-A3B-shaped target (from its config
alone, as `specjax plan` works: 128 experts of width 768, 8 a token, 48 layers; here
LAYERS of them, the rest of its shape as is) compiled here for a TPU slice (XLA's TPU
compiler through libtpu; nothing runs) and for this CPU, one-token and verification
passes at batch 1. For each: the bytes its kernels move per device (`tools.hlo.traffic`:
a fusion reads only the slices it takes of an operand), against the bytes of the weights a
token routes to (`ModelConfig.num_active_params`, this device's share) and all the
weights; and the weight-sized copies XLA put in the program (`tools.hlo.large_copies`).

    python docs/bench/moe_reads.py [--layers 4] [--topology v5e:2x2] [--mesh 1,4]

Prints one table; docs/bench/moe_reads.txt holds a run. A pass of T tokens reads at most
the experts its T k assignments chose (`theory.expected_experts`); a one-token pass, k.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax import theory
from specjax.config import ModelConfig
from specjax.memory import MB
from specjax.tools import aot, hlo

QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False}


def measure(config: ModelConfig, where, dtype, tokens: int, devices: int) -> dict:
    model = aot.abstract_model(config, dtype)
    spec = aot.pass_program(model, where, batch=1, context=256, tokens=tokens)
    text = spec.fn.lower(*spec.args, **spec.kwargs).compile().as_text()
    size = jnp.dtype(dtype).itemsize
    m = config.moe
    expert = 3 * config.hidden_size * m.expert_size * config.num_layers  # one expert, every layer
    touched = theory.expected_experts(m.num_experts, m.top_k, tokens)
    routed = (config.num_active_params() - config.vocab_size * config.hidden_size
              + (touched - m.top_k) * expert)  # the weights the pass's tokens route to, head included
    copies = hlo.large_copies(text, 2 * MB)
    return {"tokens": tokens, "moved_MB": hlo.traffic(text) / MB, "routed_MB": routed * size / devices / MB,
            "all_MB": aot.pass_reads(model) / devices / MB, "copies": [str(c) for c in copies[:3]],
            "copy_count": len(copies)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--topology", default="v5e:2x2")
    parser.add_argument("--mesh", default="1,4", help="DATA,MODEL on the TPU slice")
    args = parser.parse_args()
    config = dataclasses.replace(ModelConfig.from_hf_config(QWEN3_30B_A3B), num_layers=args.layers)
    tpu = aot.tpu_slice(args.topology)
    data, model = (int(n) for n in args.mesh.split(","))
    targets = [(f"{args.topology} mesh {data}x{model}", aot.on_mesh(tpu.mesh(data, model)), jnp.bfloat16, data * model),
               ("cpu", aot.on_device(jax.devices("cpu")[0]), jnp.float32, 1)]
    print(f"Qwen3-30B-A3B's shape, {args.layers} of its 48 layers; per device, batch 1, context 256")
    print(f"{'where':24} {'tokens':>6} {'moved MB':>9} {'routed MB':>10} {'ratio':>6} {'all MB':>8}  weight-sized copies")
    rows = []
    for name, where, dtype, devices in targets:
        for tokens in (1, 4):
            r = measure(config, where, dtype, tokens, devices)
            rows.append({"where": name, **r})
            print(f"{name:24} {tokens:>6} {r['moved_MB']:>9.1f} {r['routed_MB']:>10.1f} "
                  f"{r['moved_MB'] / r['routed_MB']:>6.2f} {r['all_MB']:>8.1f}  {r['copy_count']} "
                  f"{'; '.join(r['copies'])}")
    Path("/tmp/moe_reads.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
