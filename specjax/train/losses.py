"""Training objectives and the metrics that predict speculative performance.

Language modelling is next-token cross-entropy. Distillation trains a draft q toward a
frozen target p, both at temperature `temperature`: forward KL(p || q), or the total
variation distance TV(p, q) = 1/2 sum |p - q|, which is exactly 1 - acceptance rate
(acceptance = sum_v min(p, q)), optionally mixed with cross-entropy on the data.
Everything here is a pure function of logits; it knows nothing about optimizers or files.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

DISTILL_LOSSES = ("kl", "tv")


def cross_entropy(logits, targets):
    """logits [B, T, V], targets int [B, T] -> mean nats per token."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def distill_loss(q_logits, p_logits, targets, kind: str, temperature: float = 1.0, ce_weight: float = 0.0):
    """q_logits (draft) and p_logits (target, no gradient) [B, T, V] -> scalar loss."""
    if kind not in DISTILL_LOSSES:
        raise ValueError(f"distillation loss must be one of {DISTILL_LOSSES}, got {kind!r}")
    p_logits = jax.lax.stop_gradient(p_logits)
    log_q = jax.nn.log_softmax(q_logits / temperature, axis=-1)
    log_p = jax.nn.log_softmax(p_logits / temperature, axis=-1)
    p = jnp.exp(log_p)
    if kind == "kl":
        loss = jnp.sum(p * (log_p - log_q), axis=-1).mean()
    else:
        loss = 0.5 * jnp.sum(jnp.abs(p - jnp.exp(log_q)), axis=-1).mean()
    if ce_weight:
        loss = loss + ce_weight * cross_entropy(q_logits, targets)
    return loss


def acceptance_metrics(q_logits, p_logits):
    """What the draft would be accepted at, without generating. [B, T, V] each ->
    alpha: E[sum_v min(p, q)] at temperature 1; greedy_alpha: P(argmax q == argmax p)."""
    p, q = jax.nn.softmax(p_logits, axis=-1), jax.nn.softmax(q_logits, axis=-1)
    return {"alpha": jnp.minimum(p, q).sum(-1).mean(),
            "greedy_alpha": (jnp.argmax(p, -1) == jnp.argmax(q, -1)).mean()}
