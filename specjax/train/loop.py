"""Jitted optax training over specjax models: a target from scratch, or a draft distilled
from a frozen target. AdamW with warmup + cosine decay and gradient clipping; batches are a
pure function of (seed, step); orbax checkpoints make an interrupted run resume to the same
parameters as an uninterrupted one. Periodic evaluation reports held-out loss and, for
drafts, the acceptance the draft would get (alpha) and the tokens per target pass it
predicts for K = 1..8.

It knows models and token streams; tokenizers and corpora live in data.py.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from tqdm.auto import tqdm

from specjax import theory
from specjax.checkpoint import CheckpointManager, DamagedCheckpointError
from specjax.config import ModelConfig
from specjax.layouts import from_layout2_layer, from_legacy
from specjax.models import Model, apply, init
from specjax.sharding import place_rows
from specjax.train import losses
from specjax.train.data import batch_at, eval_batches


# The params layout a run's checkpoints hold, recorded with them: 3 is one dict per layer
# with fused qkv [G, R+2, D, E] and gate_up [2, E, F] kernels; 2 had them [E, G, R+2, D] and
# [E, 2, F]; records without one: stacked [L, ...] layers (layouts.py converts both).
PARAMS_LAYOUT = 3


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    batch: int = 16  # windows per step
    seq_len: int = 256  # tokens per window
    lr: float = 1e-3  # peak learning rate
    warmup: int = 100  # linear warmup steps, then cosine decay to lr / 10
    weight_decay: float = 0.1  # on matrices and embeddings only
    clip: float = 1.0  # global gradient-norm clip
    seed: int = 0  # data order
    eval_every: int = 250
    eval_batches: int = 8
    checkpoint_every: int = 250
    # distillation only
    loss: str = "kl"  # kl | tv (see losses.py)
    temperature: float = 1.0
    ce_weight: float = 0.0  # weight of cross-entropy on the data, mixed into the loss


@struct.dataclass
class TrainState:
    params: dict
    opt_state: optax.OptState
    step: jax.Array  # int32 []


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, max(cfg.warmup, 1), max(cfg.steps, cfg.warmup + 1), end_value=cfg.lr / 10)

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: str(path[-1].key).endswith(("kernel", "embedding", "lm_head")), params)

    return optax.chain(optax.clip_by_global_norm(cfg.clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                                   mask=decay_mask))


def _logits(model: Model, params, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return apply(Model(model.config, params), tokens, positions)[0]


def model_objective(model: Model, cfg: TrainConfig, teacher: Model | None):
    """(loss_fn, metrics_fn) of (params, batch [B, T+1]) for a model trained on the data
    (teacher None) or distilled from a frozen teacher (with the acceptance it would get)."""

    def loss_fn(params, batch):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = _logits(model, params, inputs)
        if teacher is None:
            return losses.cross_entropy(logits, targets)
        p_logits = _logits(teacher, teacher.params, inputs)
        return losses.distill_loss(logits, p_logits, targets, cfg.loss, cfg.temperature, cfg.ce_weight)

    def metrics_fn(params, batch):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = _logits(model, params, inputs)
        out = {"loss": losses.cross_entropy(logits, targets)}
        if teacher is not None:
            out.update(losses.acceptance_metrics(logits, _logits(teacher, teacher.params, inputs)))
        return out

    return loss_fn, metrics_fn


def make_step(loss_fn, optimizer: optax.GradientTransformation, shardings=None):
    """One jitted update: (state, batch) -> (state, loss). The state given is donated (its
    buffers become the new state's): pass one nobody else holds. shardings: the state's,
    kept by every step (so that a checkpoint of any step lies as the first state does)."""

    @functools.partial(jax.jit, donate_argnums=0, out_shardings=None if shardings is None else (shardings, None))
    def step(state: TrainState, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params, opt_state, state.step + 1), loss

    return step


def make_eval(metrics_fn):
    metrics = jax.jit(metrics_fn)

    def evaluate(params, batches) -> dict:
        results = [jax.device_get(metrics(params, b)) for b in batches]
        out = {k: float(np.mean([r[k] for r in results])) for k in results[0]}
        if "greedy_alpha" in out:
            out["greedy_tokens_per_pass"] = {
                K: theory.expected_tokens_per_pass(out["greedy_alpha"], K) for K in range(1, 9)}
        return out

    return evaluate


def train(model: Model, stream: np.ndarray, held_out: np.ndarray, cfg: TrainConfig,
          run_dir: str | Path, teacher: Model | None = None, record: dict | None = None,
          log: Callable[[str], None] = print, progress: bool = True, mesh=None) -> tuple[Model, dict]:
    """Trains `model` (from scratch, or distilled from `teacher`) for cfg.steps steps,
    resuming from the latest checkpoint in run_dir/checkpoints if there is one. mesh: the
    mesh a sharded model (`shard_model`) lies on; batches go over its data axis (see `fit`).
    Returns (trained model, last evaluation)."""
    loss_fn, metrics_fn = model_objective(model, cfg, teacher)
    record = {"model": model.config.to_hf_config(), "kind": "lm" if teacher is None else "distill",
              **(record or {})}
    params, metrics = fit(model.params, loss_fn, metrics_fn, stream, held_out, cfg, run_dir, record,
                          log, progress, mesh=mesh)
    return model.replace(params=params), metrics


def fit(params, loss_fn, metrics_fn, stream: np.ndarray, held_out: np.ndarray, cfg: TrainConfig,
        run_dir: str | Path, record: dict, log: Callable[[str], None] = print,
        progress: bool = True, probe: Callable[[dict], dict] | None = None, mesh=None) -> tuple[dict, dict]:
    """The training loop every specjax run shares (targets, drafts, draft heads): AdamW on
    loss_fn(params, batch [B, T+1]) for cfg.steps steps over batches drawn as a pure
    function of (seed, step), metrics_fn on held-out batches every eval_every steps, and
    an orbax checkpoint every checkpoint_every steps. A run resumes from its latest
    checkpoint in run_dir/checkpoints and ends with the params an unbroken run ends with;
    a checkpoint of another run (record's "model", "train", "kind" differ) is refused.
    probe(params) -> dict, if given, adds to each evaluation (e.g. acceptance in the real
    decoding loop). mesh: params lie on it (sharded); each batch's rows go over its data
    axis, built by each process from the same host data, and each process checkpoints its
    own shards — so it runs as one process per host under jax.distributed (every process
    calls fit alike, on a run directory they all see). Returns (params, last evaluation)."""
    optimizer = make_optimizer(cfg)
    evaluate = make_eval(metrics_fn)
    place = (lambda batch: jnp.asarray(batch)) if mesh is None else (lambda batch: place_rows(batch, mesh))
    eval_set = [place(b) for b in eval_batches(held_out, cfg.batch, cfg.seq_len, cfg.eval_batches)]
    manager = CheckpointManager(Path(run_dir) / "checkpoints")
    record = {"train": dataclasses.asdict(cfg), "layout": PARAMS_LAYOUT, **record}

    params = jax.tree.map(jnp.copy, params)  # the step donates the state: not the caller's arrays
    # Built by one program, so that on a mesh every part of the state is a global array.
    state = jax.jit(lambda p: TrainState(p, optimizer.init(p), jnp.zeros((), jnp.int32)))(params)
    step_fn = make_step(loss_fn, optimizer, jax.tree.map(lambda x: x.sharding, state))
    if manager.latest_step() is not None:
        if manager.record().get("layout") != PARAMS_LAYOUT:
            raise ValueError(f"{run_dir} holds a run of an older specjax, whose params were laid out otherwise "
                             f"(layout {manager.record().get('layout', 1)}, today's is {PARAMS_LAYOUT}); it cannot "
                             f"resume (its optimizer state has that layout too). `specjax export "
                             f"{run_dir} OUT` still exports its latest checkpoint; train on in a new run directory")
        # each array comes back as it lies now: on this device, or in its shards on the mesh
        state, saved = manager.restore(jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
        for key in ("model", "train", "kind"):
            if saved.get(key) != record.get(key):
                raise ValueError(f"{run_dir} holds a run with a different {key}: {saved.get(key)} "
                                 f"!= {record.get(key)}; use a new run directory")
        log(f"resumed from step {int(state.step)} in {manager.directory}")

    start = int(state.step)
    tokens_per_step = cfg.batch * cfg.seq_len
    metrics: dict = {}
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not progress,
               dynamic_ncols=True, mininterval=5.0)
    tick, ticked = time.perf_counter(), 0
    for step in bar:
        state, loss = step_fn(state, place(batch_at(stream, step, cfg.batch, cfg.seq_len, cfg.seed)))
        ticked += 1
        done = step + 1
        if done % 10 == 0 or done == cfg.steps:
            loss = float(loss)
            rate = ticked * tokens_per_step / (time.perf_counter() - tick)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:.0f}")
            tick, ticked = time.perf_counter(), 0
        if done % cfg.eval_every == 0 or done == cfg.steps:
            metrics = {"step": done, "train_loss": float(loss), **evaluate(state.params, eval_set),
                       **(probe(state.params) if probe else {})}
            log(f"step {done}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()
                                             if isinstance(v, float)))
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            manager.save(done, state, {**record, "step": done, "metrics": metrics})
    manager.close()
    return state.params, metrics


def restore_model(run_dir: str | Path) -> tuple[Model, dict]:
    """The model of a run's latest checkpoint, and the checkpoint's JSON record. A run of an
    older specjax (layout 2, or layers stacked and no "layout" in its record) is converted."""
    manager = CheckpointManager(Path(run_dir) / "checkpoints")
    record = manager.record()
    config = ModelConfig.from_hf_config(record["model"])
    if record.get("layout") != PARAMS_LAYOUT:
        try:
            params = jax.device_get(manager.restore_saved()["params"])
            if record.get("layout") == 2:
                params = {**params, "layers": [from_layout2_layer(layer) for layer in params["layers"]]}
            else:
                params = from_legacy(params, config)
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise DamagedCheckpointError(f"{run_dir}: its latest checkpoint is neither in today's layout nor in "
                                         f"an older specjax's ({type(e).__name__}: {e})") from None
        manager.close()
        return Model(config, jax.tree.map(jnp.asarray, params)), record

    def abstract(record):  # the state's structure, from the step's own record
        params = jax.eval_shape(lambda: init(ModelConfig.from_hf_config(record["model"]), jax.random.key(0),
                                             jnp.float32).params)
        state = TrainState(params, jax.eval_shape(make_optimizer(TrainConfig(**record["train"])).init, params),
                           jax.ShapeDtypeStruct((), jnp.int32))
        return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), state)

    state, record = manager.restore(abstract)
    manager.close()
    return Model(ModelConfig.from_hf_config(record["model"]), jax.tree.map(jnp.asarray, state.params)), record
