"""A training run for the SIGKILL test (test_heads.py): `python tests/resume_child.py KIND RUN_DIR`
trains KIND (medusa | eagle | lm) through the shared `fit` loop on a tiny target and a
Markov-chain corpus, checkpointing every step, resuming from RUN_DIR's latest checkpoint,
and writes its final params to RUN_DIR/params.npz. It prints "step N" as it goes."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specjax.config import ModelConfig  # noqa: E402
from specjax.drafters.trained import flatten  # noqa: E402
from specjax.models import init  # noqa: E402
from specjax.train import TrainConfig, heads, train  # noqa: E402

V, STEPS = 64, 10
CFG = TrainConfig(steps=STEPS, batch=4, seq_len=16, lr=3e-3, warmup=2, eval_every=5, eval_batches=1,
                  checkpoint_every=1)


def main(kind: str, run_dir: str):
    config = ModelConfig(model_type="llama", vocab_size=V, hidden_size=32, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=128,
                         norm_eps=1e-5, tie_word_embeddings=True)
    target = init(config, jax.random.key(0), jnp.float32)
    rng = np.random.RandomState(0)
    stream = rng.randint(0, V, 4000).astype(np.int32)
    log = lambda line: print(line, flush=True)  # noqa: E731
    if kind == "medusa":
        params = heads.train_medusa(target, 3, stream, stream[-500:], CFG, run_dir, progress=False, log=log)[0].params
    elif kind == "eagle":
        params = heads.train_eagle(target, stream, stream[-500:], CFG, run_dir, progress=False, log=log)[0].params
    else:
        params = train(target, stream, stream[-500:], CFG, run_dir, progress=False, log=log)[0].params
    np.savez(os.path.join(run_dir, "params.npz"), **flatten(params))
    print("finished", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
