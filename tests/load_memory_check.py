"""Peak host memory of `load_model`, measured in a fresh process (run by test_hf.py, or by
hand). Writes a synthetic multi-shard bfloat16 Llama checkpoint, then loads it in a child
process that reports its peak resident memory (VmHWM) above the baseline it had after
importing jax and specjax. Prints one JSON line.

    python tests/load_memory_check.py --size 1g   # ~1.07 GB, 9 layers
    python tests/load_memory_check.py --size small  # ~150 MB, what CI runs
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# Llama-shaped, untied head, GQA; sizes in bfloat16 bytes (2 per parameter).
SIZES = {
    "small": dict(vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=12, num_key_value_heads=4, head_dim=64),
    "1g": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=9,
               num_attention_heads=16, num_key_value_heads=4, head_dim=128),
}


def write_checkpoint(folder: Path, size: str, shards: int = 4) -> int:
    """A random bfloat16 checkpoint in `shards` files with an index; returns its tensor bytes."""
    import ml_dtypes
    from safetensors.numpy import save_file

    c = SIZES[size]
    E, F, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    H, G, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    shapes = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,), "lm_head.weight": (V, E)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (E,), p + "post_attention_layernorm.weight": (E,),
                       p + "self_attn.q_proj.weight": (H * D, E), p + "self_attn.k_proj.weight": (G * D, E),
                       p + "self_attn.v_proj.weight": (G * D, E), p + "self_attn.o_proj.weight": (E, H * D),
                       p + "mlp.gate_proj.weight": (F, E), p + "mlp.up_proj.weight": (F, E),
                       p + "mlp.down_proj.weight": (E, F)})
    pool = (np.random.RandomState(0).randn(1 << 20) * 0.02).astype(ml_dtypes.bfloat16)
    names = list(shapes)
    groups = [names[i::shards] for i in range(shards)]
    weight_map, total = {}, 0
    for s, group in enumerate(groups):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {n: np.resize(np.roll(pool, k), shapes[n]) for k, n in enumerate(group)}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update({n: file for n in group})
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], **c, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    return total


def hwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(folder: str):
    """Loads the checkpoint; reports peak RSS above the post-import baseline."""
    import jax
    import jax.numpy as jnp

    import specjax

    jax.devices()  # the backend started: part of the baseline, not of the load
    baseline = hwm_kib()
    model = specjax.load_model(folder, dtype=jnp.bfloat16)
    jax.block_until_ready(model.params)
    peak = hwm_kib()
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    # A spot check that what was loaded is the file's content.
    from safetensors import safe_open

    with safe_open(Path(folder) / json.loads((Path(folder) / "model.safetensors.index.json").read_text())[
            "weight_map"]["model.layers.3.mlp.down_proj.weight"], framework="np") as f:
        expected = f.get_tensor("model.layers.3.mlp.down_proj.weight")
    same = bool(np.array_equal(np.asarray(model.params["layers"][3]["mlp"]["down_kernel"]), expected.T))
    print(json.dumps({"baseline_bytes": baseline * 1024, "peak_above_baseline_bytes": (peak - baseline) * 1024,
                      "param_bytes": param_bytes, "content_ok": same}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    with tempfile.TemporaryDirectory() as tmp:
        total = write_checkpoint(Path(tmp), args.size)
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "PYTHONPATH": str(Path(__file__).parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        result = subprocess.run([sys.executable, __file__, "--child", tmp], capture_output=True,
                                text=True, env=env, timeout=900)
        if result.returncode:
            sys.exit(result.stderr[-3000:])
        found = json.loads(result.stdout.strip().splitlines()[-1])
    found.update(checkpoint_bytes=total, ratio=found["peak_above_baseline_bytes"] / total)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
