"""One decoder for GPT-2, the Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3) and the
Gemma family (Gemma 2, Gemma 3 text). Where families differ, the difference is a named
piece of layers.py (norms, activation, soft-caps, q/k norms, post-norms) or, here, the
embedding scale and final soft-cap of Gemma and each layer's rotary frequencies.

`decode` is a pure function of (config, params, tokens [B, T], positions [B, T], cache)
returning (logits [B, T, V] float32, hidden [B, T, E], cache). Each layer's weights are
arrays of their own (params["layers"][i]) and the layers run in a Python loop, unrolled
into the program: on a GPU a matmul whose weight is a slice of a stacked [L, ...] array
becomes a fusion that reads it at a third of the memory bandwidth, while a weight of its
own is read at full speed (measured: docs/bench/gpu/README.md). The price is compile
time that grows with depth (docs/bench/compile_time.txt). With a cache, each layer writes
its new keys/values at each row's own positions into its own buffer and attends over it,
masked by position; without one, it attends over the T tokens given (a full causal pass).

A `Placement` (cache.py) overrides "slot = position, causal" for one pass: token trees
write their nodes at consecutive slots and let each see only its ancestors.

The decoder does not touch `cache.lengths`: which written entries are valid is decided by
whoever drives it (the decoding loop). It knows nothing about checkpoints or sampling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from specjax.cache import KVCache, Placement, attention_mask, placement_mask, write
from specjax.config import ModelConfig, rope_inv_freq
from specjax.models.layers import MLP, Attention, Norm, init, matmul, rotary_angles, softcap, kernel_platform
from specjax.quant import Int8


class Block(nn.Module):
    """One pre-norm decoder layer. (Gemma's attention and MLP also norm their own outputs:
    see layers.py.)"""

    config: ModelConfig

    @nn.compact
    def __call__(self, x, cos_sin, slots, mask, kv_limit, cache_kv=None):
        """x [B, T, E]; cos_sin: this layer's rotary angles (None for GPT-2); slots int32
        [B, T]; mask bool [B, T, S]; cache_kv: None, or this layer's (k, v) buffers [B, S, G, D].
        Returns (x, cache_kv with the T new entries written)."""
        attn = Attention(self.config, name="attn")
        q, k, v = attn.project_qkv(Norm(self.config, name="attn_norm")(x), cos_sin)
        if cache_kv is not None:  # a row's slots are consecutive; one TPU wants them written so
            consecutive = kernel_platform() == "tpu"  # (a sharded program's rows: not measured better)
            cache_kv = tuple(write(buf, x, slots, consecutive) for buf, x in zip(cache_kv, (k, v)))
            k, v = cache_kv
        x = x + attn.attend(q, k, v, mask, kv_limit)
        x = x + MLP(self.config, name="mlp")(Norm(self.config, name="mlp_norm")(x))
        return x, cache_kv


def decode(c: ModelConfig, params: dict, tokens, positions, cache: KVCache | None = None,
           placement: Placement | None = None, num_layers: int | None = None, taps: tuple | None = None):
    """Activations take the parameters' dtype; logits are always float32.

    num_layers: run only the first num_layers layers, then the final norm and head (early
    exit; the cache's other layers are returned untouched).
    taps: None, or layer numbers i (1..L): `hidden` is then the residual stream after each
    of those layers, concatenated ([B, T, len(taps) E]), instead of the final-normed states."""
    x = embed_tokens(c, params["embedding"], tokens)  # [B, T, E]
    if c.family == "gpt2":
        x = x + params["pos_embedding"][jnp.minimum(positions, c.max_position_embeddings - 1)]
    slots, masks, kv_limit = slots_and_masks(c, positions, cache, placement)
    angles = rotary_tables(c, positions)
    k, v = (None, None) if cache is None else (list(cache.k), list(cache.v))
    tapped = {}  # layer number -> the residual stream after it, for `taps`
    for i in range(c.num_layers if num_layers is None else num_layers):
        sliding = c.layer_windows()[i] is not None
        kv = None if cache is None else (k[i], v[i])
        x, kv = Block(c).apply({"params": params["layers"][i]}, x, angles[sliding], slots, masks[sliding],
                               kv_limit, kv)
        if cache is not None:
            k[i], v[i] = kv
        if taps and i + 1 in taps:
            tapped[i + 1] = x
    hidden = Norm(c).apply({"params": params["final_norm"]}, x)
    tied = c.tie_word_embeddings
    logits = read_out(c, params["embedding" if tied else "lm_head"], hidden, transposed=tied)
    if taps:
        hidden = jnp.concatenate([tapped[i] for i in taps], axis=-1)
    if cache is not None:
        cache = cache.replace(k=tuple(k), v=tuple(v))
    return logits, hidden, cache


def init_params(c: ModelConfig, key: jax.Array) -> dict:
    """Random float32 params (normal(0.02) weights, unit norms (Gemma: zero), zero biases)."""
    keys = jax.random.split(key, c.num_layers + 3)
    E = c.hidden_size
    params = {"embedding": init(keys[0], (c.vocab_size, E), jnp.float32),
              "layers": [init_layer(c, k) for k in keys[3:]],
              "final_norm": Norm(c).init(keys[1], jnp.zeros((1, 1, E)))["params"]}
    if c.family == "gpt2":
        params["pos_embedding"] = init(keys[2], (c.max_position_embeddings, E), jnp.float32)
    if not c.tie_word_embeddings:
        params["lm_head"] = init(keys[2], (E, c.vocab_size), jnp.float32)
    return params


@functools.partial(jax.jit, static_argnums=0)
def init_layer(c: ModelConfig, key: jax.Array) -> dict:
    """One layer's random params (compiled once per config, run once per layer)."""
    x = jnp.zeros((1, 1, c.hidden_size), jnp.float32)
    positions = jnp.zeros((1, 1), jnp.int32)
    slots, masks, kv_limit = slots_and_masks(c, positions, None, None)
    angles = rotary_tables(c, positions)
    return Block(c).init(key, x, angles[False], slots, masks[False], kv_limit)["params"]


def embed_tokens(c: ModelConfig, embedding, tokens):
    """The embedding rows of tokens [B, T] (int8 or float): [B, T, E], Gemma's scaled by
    sqrt(E) and rounded to the dtype as transformers does."""
    x = embedding.rows(tokens) if isinstance(embedding, Int8) else embedding[tokens]
    if c.family == "gemma":
        x = x * jnp.asarray(c.hidden_size ** 0.5, x.dtype)
    return x


def rotary_tables(c: ModelConfig, positions) -> dict:
    """{sliding: (cos, sin)}: the rotary angles of full-attention layers (False) and of
    sliding-window layers (True), each computed once per pass; None for GPT-2."""
    if c.family == "gpt2":
        return {False: None, True: None}
    full = rotary_angles(positions, jnp.asarray(rope_inv_freq(c), jnp.float32))
    if c.local_rope_theta is None:
        return {False: full, True: full}
    return {False: full, True: rotary_angles(positions, jnp.asarray(rope_inv_freq(c, local=True), jnp.float32))}


def slots_and_masks(c: ModelConfig, positions, cache: KVCache | None, placement: Placement | None):
    """Where T tokens at positions [B, T] are written in the cache (slots [B, T]), what they
    see ({sliding: mask bool [B, T, S]}, S the cache's length, or T without a cache: the
    full-attention layers' mask and the sliding-window layers') and kv_limit (int32 [B], with
    a cache; None without): one past the highest slot any query of row b sees, so that
    attention reads no block beyond it (see layers.attention). Without a placement, slot =
    position and attention is causal."""
    window = next((w for w in c.layer_windows() if w is not None), None)
    if placement is not None:
        full = placement_mask(positions, placement)
        windowed = None if window is None else placement_mask(positions, placement, window)
    else:
        kv_positions = positions if cache is None else jnp.arange(cache.max_len)[None, :]
        full = attention_mask(positions, kv_positions)
        windowed = None if window is None else attention_mask(positions, kv_positions, window)
    masks = {False: full, True: windowed}
    slots = positions if placement is None else placement.slots
    if cache is None:
        return slots, masks, None
    seen = full.any(axis=1)  # [B, S]: slots some query of the row sees
    kv_limit = jnp.max(jnp.where(seen, jnp.arange(full.shape[-1], dtype=jnp.int32) + 1, 0), axis=1)
    return slots, masks, kv_limit


def read_out(c: ModelConfig, head, hidden, transposed: bool = False):
    """float32 logits [..., V] from final hidden states [..., E] through a head [E, V] (or
    the embedding [V, E] when transposed: tied), int8 or float, with Gemma's final soft-cap."""
    logits = matmul("...e,ve->...v" if transposed else "...e,ev->...v", hidden, head, jnp.float32)
    if c.gemma and c.gemma.final_softcap is not None:
        logits = softcap(logits, c.gemma.final_softcap)
    return logits
