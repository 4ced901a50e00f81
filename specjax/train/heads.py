"""Training draft heads (Medusa, EAGLE, EAGLE-3, an MTP layer) on a frozen target by
self-distillation: each head learns the target's own distribution at the position it
guesses, on the corpus (and on the target's own continuations, where the command mixes them in).
EAGLE-3 learns it over several unrolled drafting steps ("training-time test"), each step
reading the drafter's own outputs of the step before, weighted 0.8^j as its authors do.
Both run through the shared `fit` loop (optax, orbax checkpoints with exact resume,
held-out evaluation), so they resume exactly as targets and drafts do.

Held-out evaluation reports the distillation loss and, per depth k, the fraction of
positions where the drafter's top-1 guesses for depths 1..k all equal the target's argmax
(Medusa: every depth, as its heads guess all at once; EAGLE: depth 1, as deeper guesses
read its own predicted features; EAGLE-3: every unrolled depth), and, with a probe, what the drafter gets in the real
loop on held-out prompts: tokens per target pass and acceptance by depth.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.drafters.eagle import Eagle, eagle_step
from specjax.drafters.eagle3 import Eagle3, unrolled
from specjax.drafters.published import PublishedEagle3
from specjax.drafters.medusa import Medusa, heads_logits
from specjax.drafters.mtp import Mtp, mtp_layer, mtp_logits
from specjax.drafters.vocab import draft_vocabulary
from specjax.models import Model, apply
from specjax.models.moe import differentiable_form
from specjax.sharding import replicate
from specjax.train import losses
from specjax.train.loop import TrainConfig, fit
from specjax.tree import Tree

FEATURE_WEIGHT = 1.0  # EAGLE: weight of the feature regression (smooth L1) beside the KL
TTT_STEPS = 4  # EAGLE-3: drafting steps unrolled in training (its authors use 7)
TTT_DECAY = 0.8  # EAGLE-3: step j's loss weighs TTT_DECAY ** j


def _target_pass(target: Model, tokens):
    """The frozen target on tokens [B, T]: (logits [B, T, V], final hidden [B, T, E])."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits, hidden, _ = apply(target, tokens, positions)
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(hidden)


def _chain_acceptance(matches: list) -> dict:
    """matches[k] bool [B, T]: depth k+1's guess equals the target's argmax -> the fraction
    of positions whose first k+1 guesses all match, for each depth."""
    out, ok = {}, None
    for k, m in enumerate(matches):
        ok = m if ok is None else ok & m
        out[f"depth_{k + 1}"] = ok.mean()
    return out


def medusa_objective(target: Model, num_heads: int, cfg: TrainConfig):
    """(loss_fn, metrics_fn) over Medusa params and batches [B, T+1]. Head i at position t
    learns the target's distribution at t+i+1 (the token i+2 ahead)."""
    def per_head(params, batch):
        p, h = _target_pass(target, batch)
        q = heads_logits(params, target, h)  # [B, T, H, V]
        T = batch.shape[1]
        return [(q[:, : T - 1 - i, i], p[:, i + 1:]) for i in range(num_heads)]

    def loss_fn(params, batch):
        return sum(losses.distill_loss(q, p, None, cfg.loss, cfg.temperature)
                   for q, p in per_head(params, batch)) / num_heads

    def metrics_fn(params, batch):
        pairs = per_head(params, batch)
        T = batch.shape[1] - num_heads  # positions every head can be scored at
        out = {"loss": sum(losses.distill_loss(q, p, None, "kl") for q, p in pairs) / num_heads}
        out.update(_chain_acceptance([jnp.argmax(q[:, :T], -1) == jnp.argmax(p[:, :T], -1) for q, p in pairs]))
        return out

    return loss_fn, metrics_fn


def eagle_objective(target: Model, config, cfg: TrainConfig):
    """(loss_fn, metrics_fn) over EAGLE params and batches [B, T+1]. At position t, from
    (token t+1, the target's f_t), it learns the target's distribution at t+1 (KL) and its
    feature f_{t+1} (smooth L1)."""
    def pairs(batch):
        p, h = _target_pass(target, batch)
        T = batch.shape[1] - 1
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (batch.shape[0], T))
        return p, h, positions

    def loss_fn(params, batch):
        p, h, positions = pairs(batch)
        q, f, _ = eagle_step(config, params, target, batch[:, 1:], h[:, :-1], positions)
        feature = smooth_l1(f, h[:, 1:])
        return losses.distill_loss(q, p[:, 1:], None, cfg.loss, cfg.temperature) + FEATURE_WEIGHT * feature

    def metrics_fn(params, batch):
        p, h, positions = pairs(batch)
        q, f, _ = eagle_step(config, params, target, batch[:, 1:], h[:, :-1], positions)
        return {"loss": losses.distill_loss(q, p[:, 1:], None, "kl"), "feature_loss": smooth_l1(f, h[:, 1:]),
                "depth_1": (jnp.argmax(q, -1) == jnp.argmax(p[:, 1:], -1)).mean()}

    return loss_fn, metrics_fn


def eagle3_objective(target: Model, drafter: Eagle3, cfg: TrainConfig, steps: int = TTT_STEPS):
    """(loss_fn, metrics_fn) over EAGLE-3 params and batches [B, T+1]. Unrolled step j at
    position t drafts depth j+1 from the root t-j and learns the target's distribution at
    t+1; positions t < j have no root and are left out. A drafter with a reduced draft
    vocabulary learns the target's distribution restricted to it (renormalised over its
    ids); its agreement is still with the target's argmax over the whole vocabulary."""
    vocab = drafter.vocab

    def run(params, batch):
        positions = jnp.broadcast_to(jnp.arange(batch.shape[1], dtype=jnp.int32), batch.shape)
        p, taps, _ = apply(target, batch, positions, taps=drafter.feature_layers)
        p, taps = jax.lax.stop_gradient(p), jax.lax.stop_gradient(taps)
        q = unrolled(drafter, params, target, batch[:, 1:], taps[:, :-1], steps)  # [steps, B, T, Vd]
        return q, p[:, 1:]

    def restricted(p):  # the target's logits [B, T, V] at the draft vocabulary's ids [B, T, Vd]
        return p if vocab is None else p[..., vocab]

    def loss_fn(params, batch):
        q, p = run(params, batch)
        p = restricted(p)
        weights = [TTT_DECAY ** j for j in range(steps)]
        return sum(w * losses.distill_loss(q[j, :, j:], p[:, j:], None, cfg.loss, cfg.temperature)
                   for j, w in enumerate(weights)) / sum(weights)

    def metrics_fn(params, batch):
        q, p = run(params, batch)
        roots = p.shape[1] - steps + 1  # roots whose whole unrolled chain lies in the window
        target_top = jnp.argmax(p, -1)
        draft_top = jnp.argmax(q, -1) if vocab is None else vocab[jnp.argmax(q, -1)]  # target ids
        matches = [draft_top[j, :, j:j + roots] == target_top[:, j:j + roots] for j in range(steps)]
        return {"loss": losses.distill_loss(q[0], restricted(p), None, "kl"), **_chain_acceptance(matches)}

    return loss_fn, metrics_fn


def mtp_objective(target: Model, drafter: Mtp, cfg: TrainConfig):
    """(loss_fn, metrics_fn) over an MTP layer's params and batches [B, T+1]. At position t,
    from (token t+1, the target's final-normed h_t), it learns the target's distribution at
    t+1, i.e. of token t+2 (KL), as DeepSeek-V3's depth-1 MTP module does; the target's head
    and embedding stay frozen (they are not in params)."""
    def run(params, batch):
        p, h = _target_pass(target, batch)
        T = batch.shape[1] - 1
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (batch.shape[0], T))
        x, _ = mtp_layer(drafter.config, params, target, batch[:, 1:], h[:, :-1], positions, drafter.sparse,
                         moe_form=differentiable_form(target.runs_on.platform))
        return mtp_logits(drafter.config, params, target, x), p[:, 1:]  # [B, T, V] each: token t+2's

    def loss_fn(params, batch):
        q, p = run(params, batch)
        return losses.distill_loss(q, p, None, cfg.loss, cfg.temperature)

    def metrics_fn(params, batch):
        q, p = run(params, batch)
        return {"loss": losses.distill_loss(q, p, None, "kl"),
                "depth_1": (jnp.argmax(q, -1) == jnp.argmax(p, -1)).mean()}

    return loss_fn, metrics_fn


def acceptance_probe(target: Model, prompts: np.ndarray, make: Callable[[dict], object],
                     max_new_tokens: int = 64, mesh=None) -> Callable[[dict], dict]:
    """probe(params) -> what the drafter (make(params)) gets in the real loop, greedy, on
    held-out prompts [B, P] (on `mesh` if given): tokens per target pass and, per depth k,
    the fraction of steps that accepted at least k drafted tokens
    (`theory.depth_acceptance`). One compilation for all calls."""
    from specjax.generate import generate
    from specjax.sharding import gather
    from specjax.theory import depth_acceptance, row_traces

    lengths = np.full(len(prompts), prompts.shape[1], np.int32)

    def probe(params) -> dict:
        drafter = make(params)
        out = gather(generate(target, prompts, lengths, draft=drafter, max_new_tokens=max_new_tokens,
                              return_trace=True, mesh=mesh))
        rates = depth_acceptance(row_traces(out), drafter.resolve(None).tree.depth)
        return {"tokens_per_pass": float(out.num_tokens.sum() / out.stats.steps.sum()),
                **{f"accepted_{k}": rate for k, rate in enumerate(rates, 1)}}

    return probe


def smooth_l1(pred, target):
    """EAGLE's feature loss: Huber (smooth L1) with delta 1, mean over elements."""
    return optax.huber_loss(pred, target, delta=1.0).mean()


def _fit_drafter(drafter, target: Model, objective, kind: str, model_record: dict, stream, held_out, cfg,
                 run_dir, record, log, progress, probe_prompts, probe_tree: Tree | None, mesh=None):
    """What every head's training shares: fit the drafter's params to `objective`
    ((loss_fn, metrics_fn)), recording kind and model_record, probing the real loop with
    the drafter drafting probe_tree (None: its own shape). mesh: the target lies on it;
    the drafter's params are replicated over it (a copy on every device)."""
    record = {"model": {**model_record, "target": target.config.to_hf_config()}, "kind": kind, **(record or {})}
    probe = None if probe_prompts is None else acceptance_probe(
        target, probe_prompts, lambda params: drafter.replace(params=params, **({} if probe_tree is None else
                                                                                 {"tree": probe_tree})),
        mesh=mesh)
    params = drafter.params if mesh is None else replicate(drafter.params, mesh)
    params, metrics = fit(params, *objective, stream, held_out, cfg, run_dir, record, log, progress, probe,
                          mesh=mesh)
    return drafter.replace(params=params), metrics


def train_medusa(target: Model, num_heads: int, stream: np.ndarray, held_out: np.ndarray,
                 cfg: TrainConfig, run_dir: str | Path, key=None, num_layers: int = 1,
                 record: dict | None = None, log: Callable[[str], None] = print,
                 progress: bool = True, probe_prompts: np.ndarray | None = None, mesh=None) -> tuple[Medusa, dict]:
    """Trains Medusa heads on the frozen target; resumes from run_dir's latest checkpoint.
    probe_prompts [B, P]: held-out prompts on which each evaluation runs the real loop."""
    drafter = Medusa.init(target, num_heads, jax.random.key(0) if key is None else key, num_layers=num_layers)
    return _fit_drafter(drafter, target, medusa_objective(target, num_heads, cfg), "medusa",
                        {"medusa": [num_heads, num_layers]}, stream, held_out, cfg, run_dir, record, log, progress,
                        probe_prompts, None, mesh)


def train_eagle(target: Model, stream: np.ndarray, held_out: np.ndarray, cfg: TrainConfig,
                run_dir: str | Path, key=None, record: dict | None = None,
                log: Callable[[str], None] = print, progress: bool = True,
                probe_prompts: np.ndarray | None = None, mesh=None) -> tuple[Eagle, dict]:
    """Trains an EAGLE drafter on the frozen target; resumes from run_dir's latest checkpoint.
    probe_prompts [B, P]: held-out prompts on which each evaluation runs the real loop (a
    chain of 6)."""
    drafter = Eagle.init(target, jax.random.key(0) if key is None else key)
    return _fit_drafter(drafter, target, eagle_objective(target, drafter.config, cfg), "eagle",
                        {"eagle": drafter.config.to_hf_config()}, stream, held_out, cfg, run_dir, record, log,
                        progress, probe_prompts, Tree.chain(6, "sampled"), mesh)


def train_eagle3(target: Model, stream: np.ndarray, held_out: np.ndarray, cfg: TrainConfig,
                 run_dir: str | Path, key=None, record: dict | None = None,
                 log: Callable[[str], None] = print, progress: bool = True,
                 probe_prompts: np.ndarray | None = None, steps: int = TTT_STEPS,
                 feature_layers: tuple | None = None, draft_vocab: int | None = None,
                 mesh=None, published: bool = False) -> tuple[Eagle3, dict]:
    """Trains an EAGLE-3 drafter on the frozen target with `steps` unrolled drafting steps;
    resumes from run_dir's latest checkpoint. probe_prompts [B, P]: held-out prompts on
    which each evaluation runs the real loop (a chain of 6). draft_vocab: the size of a
    reduced draft vocabulary, the stream's most frequent tokens (None: the target's whole
    vocabulary). published: the published architecture (a `PublishedEagle3`, whose `save`
    writes speculators' format), else specjax's own `Eagle3`."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"EAGLE-3 trains over >= 1 unrolled steps, got {steps!r}")
    vocab = None if draft_vocab is None else draft_vocabulary(stream, draft_vocab, target.config.vocab_size)
    drafter = (PublishedEagle3 if published else Eagle3).init(target, jax.random.key(0) if key is None else key,
                                                              feature_layers=feature_layers, vocab=vocab)
    return _fit_drafter(drafter, target, eagle3_objective(target, drafter, cfg, steps), "eagle3",
                        {"eagle3": drafter.config.to_hf_config(), "feature_layers": list(drafter.feature_layers),
                         "ttt_steps": steps, "draft_vocab": draft_vocab, "published": published}, stream, held_out,
                        cfg, run_dir, record, log, progress, probe_prompts, Tree.chain(6, "sampled"), mesh)


def train_mtp(target: Model, stream: np.ndarray, held_out: np.ndarray, cfg: TrainConfig,
              run_dir: str | Path, key=None, record: dict | None = None,
              log: Callable[[str], None] = print, progress: bool = True,
              probe_prompts: np.ndarray | None = None, mesh=None, from_last_layer: bool = True) -> tuple[Mtp, dict]:
    """Trains a multi-token-prediction layer for a target that ships none, on the frozen
    target (`mtp_objective`); resumes from run_dir's latest checkpoint. It starts as
    `Mtp.init` makes it (its block a copy of the target's last layer where from_last_layer
    and that layer is of its kind, else random). probe_prompts [B, P]: held-out prompts on
    which each evaluation runs the real loop (a chain of 3). `Mtp.save` writes the result
    beside its target, in DeepSeek-V3's layout."""
    drafter = Mtp.init(target, jax.random.key(0) if key is None else key, from_last_layer=from_last_layer)
    return _fit_drafter(drafter, target, mtp_objective(target, drafter, cfg), "mtp",
                        {"mtp": drafter.config.to_hf_config(), "sparse": drafter.sparse,
                         "from_last_layer": from_last_layer}, stream, held_out, cfg, run_dir, record, log, progress,
                        probe_prompts, Tree.chain(3, "sampled"), mesh)
