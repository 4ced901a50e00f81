"""KVCache: fixed-shape key/value buffers with per-row lengths.

Slot s of row b holds the key/value of the token at position s of that row. A row's
entries at slots < lengths[b] are valid; entries at or beyond it are stale and are never
cleared: attention masks are derived from positions (a query at position t sees slots
<= t), and every pass writes its own positions before attending, so a stale slot is always
overwritten before any query can see it. Rolling back rejected draft tokens is therefore
only a matter of lowering `lengths`.

The cache knows nothing about models beyond their shapes, nor about decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.config import ModelConfig


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, G, D]
    v: jax.Array  # [L, B, S, G, D]
    lengths: jax.Array  # int32 [B]: slots < lengths[b] hold valid entries

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
        shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def write(buffer: jax.Array, layer: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Writes new[b, t] into buffer[layer, b, positions[b, t]]: each row at its own offset.

    buffer [L, B, S, G, D], new [B, T, G, D], positions int32 [B, T]. One scatter into the
    carried buffer (in place inside a loop). Writes at positions >= S are dropped."""
    rows = jnp.arange(buffer.shape[1])[:, None]  # [B, 1]
    return buffer.at[layer, rows, positions].set(new.astype(buffer.dtype), mode="drop")


def attention_mask(q_positions: jax.Array, kv_positions: jax.Array,
                   window: int | None = None) -> jax.Array:
    """bool [B, T, S]: a query at position t sees a key at position s iff s <= t, and
    t - s < window when there is one. q_positions [B, T]; kv_positions [B, S] (or [1, S]:
    for a cache, slot s holds position s)."""
    q = q_positions[:, :, None]  # [B, T, 1]
    kv = kv_positions[:, None, :]  # [B, 1, S]
    mask = kv <= q
    if window is not None:
        mask &= q - kv < window
    return mask
