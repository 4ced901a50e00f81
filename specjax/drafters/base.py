"""The drafter interface's two records and the autoregressive proposal loop that model
drafters (a second model, an early exit of the target) share."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from specjax.cache import KVCache
from specjax.sampling import Sampling, sample, warp


@struct.dataclass
class DraftRequest:
    target: Any  # the target Model
    target_cache: KVCache  # valid below length - 1; a drafter may write beyond, and returns it
    tokens: jax.Array  # int32 [B, S]: the loop's token buffer
    length: jax.Array  # int32 [B]: final tokens per row
    key: jax.Array
    sampling: Sampling
    k_limit: jax.Array  # int32 [B]: at most this many drafts per row this step (<= K)
    threshold: jax.Array  # float32 []: stop a row's drafting when the draft's confidence is lower
    K: int = struct.field(pytree_node=False)  # the static maximum


@struct.dataclass
class Proposal:
    drafts: jax.Array  # int32 [B, K]; entries at j >= num_drafted[b] are ignored
    q: jax.Array  # float32 [B, K, V]: what each draft was drawn from
    num_drafted: jax.Array  # int32 [B]


# forward(cache, tokens [B, T], positions [B, T]) -> (cache, logits [B, T, V_target])
Forward = Callable[[Any, jax.Array, jax.Array], tuple[Any, jax.Array]]


def draft_autoregressively(forward: Forward, cache, logits0: jax.Array, request: DraftRequest):
    """Proposes up to K tokens one at a time from logits0 [B, V] (the distribution of the
    token at position length). A row stops at its k_limit or when the draft's own
    (temperature-1) confidence max q falls below the threshold; the loop stops as soon as
    no row goes on, and never runs a forward pass whose output nobody needs.
    Returns (cache, Proposal)."""
    B, V = logits0.shape
    K = request.K

    def distributions(logits):
        return warp(logits, request.sampling), jax.nn.softmax(logits, axis=-1).max(axis=-1)

    def go_on(carry):
        j, _, _, _, _, _, going, _ = carry
        return (j < K) & jnp.any(going)

    def step(carry):
        j, cache, q, confidence, drafts, qs, going, num = carry
        going = going & (j < request.k_limit) & (confidence >= request.threshold)
        token = sample(jax.random.fold_in(request.key, j), q)  # [B]
        drafts = drafts.at[:, j].set(token)
        qs = qs.at[:, j].set(q)
        num = num + going.astype(jnp.int32)

        def feed(cache):
            cache, logits = forward(cache, token[:, None], (request.length + j)[:, None])
            return (cache, *distributions(logits[:, 0]))

        cache, q, confidence = jax.lax.cond((j + 1 < K) & jnp.any(going), feed,
                                            lambda cache: (cache, q, confidence), cache)
        return j + 1, cache, q, confidence, drafts, qs, going, num

    q0, confidence0 = distributions(logits0)
    carry = (jnp.zeros((), jnp.int32), cache, q0, confidence0, jnp.zeros((B, K), jnp.int32),
             jnp.zeros((B, K, V), jnp.float32), jnp.ones((B,), bool), jnp.zeros((B,), jnp.int32))
    _, cache, _, _, drafts, qs, _, num = jax.lax.while_loop(go_on, step, carry)
    return cache, Proposal(drafts, qs, num)
