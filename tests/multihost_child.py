"""One process of test_multihost.py's runs: `python tests/multihost_child.py JOB PROCESS_ID
NUM_PROCESSES PORT OUT_DIR` joins a `jax.distributed` job of NUM_PROCESSES processes on
this machine (gloo CPU collectives, 4 emulated devices each) and does JOB:

- generate: the shipped pair on a (data=2, model=4) mesh over all processes' devices,
  speculative with a chain and with a tree, against the same calls on this process's first
  device alone (no mesh); a stream= function counts its calls. Writes OUT_DIR/PROCESS_ID.json.
- train: a tiny draft's training run on the mesh (`specjax.train.train`), each process
  checkpointing its own shards; it resumes from OUT_DIR's latest checkpoint and writes its
  final params (gathered) to OUT_DIR/params_PROCESS_ID.npz.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent / "checkpoints"


def generate_job(out_dir: Path):
    import specjax

    mesh = specjax.make_mesh(data=2, model=4)
    target = specjax.load_model(ROOT / "target", dtype=jnp.float32, mesh=mesh)
    draft = specjax.shard_model(specjax.load_model(ROOT / "draft", dtype=jnp.float32), mesh,
                                rules=(("batch", "data"),))
    local_target = specjax.load_model(ROOT / "target", dtype=jnp.float32)
    local_draft = specjax.load_model(ROOT / "draft", dtype=jnp.float32)
    tokenizer = specjax.load_tokenizer(ROOT / "target")
    prompts = [tokenizer.encode("def read_config(path):\n    "), tokenizer.encode("class Stack:\n    def push(")]
    padded, lengths = specjax.pad_prompts(prompts)
    result = {"process": jax.process_index(), "devices": jax.device_count(), "local": jax.local_device_count()}
    for name, tree in (("chain", None), ("tree", specjax.Tree(4, 2, 8))):
        calls = []
        kwargs = dict(max_new_tokens=24, num_draft_tokens=None if tree else 4)
        sharded = specjax.generate(target, padded, lengths, draft=specjax.DraftModel(draft, tree), mesh=mesh,
                                   stream=lambda tokens, counts: calls.append(int(counts.sum())), **kwargs)
        alone = specjax.generate(local_target, padded, lengths, draft=specjax.DraftModel(local_draft, tree), **kwargs)
        result[name] = {"sharded": specjax.gather(sharded.tokens).tolist(),
                        "counts": specjax.gather(sharded.num_tokens).tolist(),
                        "alone": np.asarray(alone.tokens).tolist(), "stream_calls": len(calls),
                        "streamed": sum(calls)}
    (out_dir / f"{jax.process_index()}.json").write_text(json.dumps(result))


def train_job(out_dir: Path):
    import specjax
    from specjax.drafters.trained import flatten
    from specjax.train import TrainConfig, train

    mesh = specjax.make_mesh(data=2, model=4)
    config = specjax.ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                 num_kv_heads=4, head_dim=8, intermediate_size=64, max_position_embeddings=64,
                                 norm_eps=1e-5, tie_word_embeddings=True)
    model = specjax.shard_model(specjax.models.init(config, jax.random.key(0), jnp.float32), mesh)
    stream = np.random.RandomState(0).randint(0, 64, 4000).astype(np.int32)
    cfg = TrainConfig(steps=int(os.environ.get("STEPS", "6")), batch=4, seq_len=16, lr=3e-3, warmup=1,
                      eval_every=3, eval_batches=1, checkpoint_every=1)
    params = train(model, stream, stream[-500:], cfg, out_dir / "run", progress=False,
                   log=lambda line: print(line, flush=True), mesh=mesh)[0].params
    np.savez(out_dir / f"params_{jax.process_index()}.npz", **flatten(jax.tree.map(specjax.gather, params)))


def main(job: str, process_id: int, num_processes: int, port: int, out_dir: str):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=num_processes,
                               process_id=process_id)
    {"generate": generate_job, "train": train_job}[job](Path(out_dir))
    print("finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
