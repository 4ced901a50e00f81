"""One decoder for GPT-2, the Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3) and the
Gemma family (Gemma 2, Gemma 3 text). Where families differ, the difference is a named
piece of layers.py (norms, activation, soft-caps, q/k norms, post-norms) or, here, the
embedding scale and final soft-cap of Gemma and each layer's rotary frequencies.

`Decoder` is a pure function of (params, tokens [B, T], positions [B, T], cache) returning
(logits [B, T, V] float32, hidden [B, T, E], cache). Layers are stacked ([L, ...] leaves)
and run with `nn.scan`, so compile time does not grow with depth. With a cache, each layer
writes its new keys/values at each row's own positions and attends over the whole buffer,
masked by position; without one, it attends over the T tokens given (a full causal pass).

A `Placement` (cache.py) overrides "slot = position, causal" for one pass: token trees
write their nodes at consecutive slots and let each see only its ancestors.

The decoder does not touch `cache.lengths`: which written entries are valid is decided by
whoever drives it (the decoding loop). It knows nothing about checkpoints or sampling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from specjax.cache import KVCache, Placement, attention_mask, placement_mask, write
from specjax.config import ModelConfig, layer_inv_freqs
from specjax.models.layers import MLP, Attention, Norm, dequantize, init, softcap
from specjax.quant import Int8


class Block(nn.Module):
    """One pre-norm decoder layer. Scanned over layers: carry is (x, cache k, cache v).
    (Gemma's attention and MLP also norm their own outputs: see layers.py.)"""

    config: ModelConfig

    @nn.compact
    def __call__(self, carry, layer, positions, slots, masks):
        x, cache_k, cache_v = carry  # x [B, T, E]; cache_k/v [L, B, S, G, D] or None
        attn = Attention(self.config, name="attn")
        q, k, v = attn.project_qkv(Norm(self.config, name="attn_norm")(x), positions,
                                   layer.get("inv_freq"))
        if cache_k is not None:
            i = layer["index"]
            cache_k, cache_v = write(cache_k, i, k, slots), write(cache_v, i, v, slots)
            k, v = cache_k[i], cache_v[i]  # [B, S, G, D]
        full_mask, window_mask, kv_limit = masks
        mask = full_mask if window_mask is None else jnp.where(layer["sliding"], window_mask, full_mask)
        x = x + attn.attend(q, k, v, mask, kv_limit)
        x = x + MLP(self.config, name="mlp")(Norm(self.config, name="mlp_norm")(x))
        return (x, cache_k, cache_v), None


class Decoder(nn.Module):
    """Activations take the parameters' dtype; logits are always float32."""

    config: ModelConfig
    exit_layer: int | None = None  # run only the first exit_layer layers, then norm and head

    @nn.compact
    def __call__(self, tokens, positions, cache: KVCache | None = None, placement: Placement | None = None):
        c = self.config
        embedding = self.param("embedding", init, (c.vocab_size, c.hidden_size))
        x = embed_tokens(c, embedding, tokens)  # [B, T, E]
        if c.family == "gpt2":
            pos_embedding = self.param("pos_embedding", init,
                                       (c.max_position_embeddings, c.hidden_size))
            x = x + pos_embedding[jnp.minimum(positions, c.max_position_embeddings - 1)]

        slots, masks = slots_and_masks(c, positions, cache, placement)
        layers = layer_table(c)
        stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=c.num_layers)
        carry = (x, None, None) if cache is None else (x, cache.k, cache.v)
        if self.exit_layer is None or self.is_initializing():
            (x, cache_k, cache_v), _ = stack(c, name="layers")(carry, layers, positions, slots, masks)
        else:
            # Early exit: the first exit_layer layers, each read in place from the stacked
            # weights (no copy of the slice), writing the shared cache's own layers.
            stacked = self.variables["params"]["layers"]

            def run_layer(i, carry):
                params = jax.tree.map(lambda w: w[i], stacked)
                layer = jax.tree.map(lambda a: a[i], layers)
                return Block(c).apply({"params": params}, carry, layer, positions, slots, masks)[0]

            x, cache_k, cache_v = jax.lax.fori_loop(0, self.exit_layer, run_layer, carry)
        hidden = Norm(c, name="final_norm")(x)
        head = embedding if c.tie_word_embeddings else self.param(
            "lm_head", init, (c.hidden_size, c.vocab_size))
        logits = read_out(c, head, hidden, transposed=c.tie_word_embeddings)
        if cache is not None:
            cache = cache.replace(k=cache_k, v=cache_v)
        return logits, hidden, cache


def embed_tokens(c: ModelConfig, embedding, tokens):
    """The embedding rows of tokens [B, T] (int8 or float): [B, T, E], Gemma's scaled by
    sqrt(E) and rounded to the dtype as transformers does."""
    x = embedding.rows(tokens) if isinstance(embedding, Int8) else embedding[tokens]
    if c.family == "gemma":
        x = x * jnp.asarray(c.hidden_size ** 0.5, x.dtype)
    return x


def slots_and_masks(c: ModelConfig, positions, cache: KVCache | None, placement: Placement | None):
    """Where T tokens at positions [B, T] are written in the cache (slots [B, T]) and what
    they see: (full mask, window mask or None, kv_limit), the masks bool [B, T, S] (S: the
    cache's length, or T without a cache). Without a placement, slot = position and
    attention is causal. kv_limit (int32 [], with a cache; None without): one past the
    highest slot any query of the pass sees, so that long-cache attention reads no block
    beyond it (see layers.attention)."""
    window = next((w for w in c.layer_windows() if w is not None), None)
    if placement is not None:
        full = placement_mask(positions, placement)
        masks = (full, None if window is None else placement_mask(positions, placement, window))
    else:
        kv_positions = positions if cache is None else jnp.arange(cache.max_len)[None, :]
        full = attention_mask(positions, kv_positions)
        masks = (full, None if window is None else attention_mask(positions, kv_positions, window))
    slots = positions if placement is None else placement.slots
    if cache is None:
        return slots, masks + (None,)
    seen = full.any(axis=(0, 1))  # [S]: slots some query sees
    kv_limit = jnp.max(jnp.where(seen, jnp.arange(full.shape[-1], dtype=jnp.int32) + 1, 0))
    return slots, masks + (kv_limit,)


def layer_table(c: ModelConfig, num_layers: int | None = None) -> dict:
    """What each scanned layer is given besides its weights: its index, whether it slides
    and (rotary families) its inverse frequencies [L, D/2]. num_layers: the first few only."""
    L = c.num_layers if num_layers is None else num_layers
    table = {"index": jnp.arange(L), "sliding": jnp.array([w is not None for w in c.layer_windows()][:L])}
    if c.family != "gpt2":
        table["inv_freq"] = jnp.asarray(layer_inv_freqs(c))[:L]
    return table


def read_out(c: ModelConfig, head, hidden, transposed: bool = False):
    """float32 logits [..., V] from final hidden states [..., E] through a head [E, V] (or
    the embedding [V, E] when transposed: tied), int8 or float, with Gemma's final soft-cap."""
    head = dequantize(head)
    logits = jnp.einsum("...e,ve->...v" if transposed else "...e,ev->...v", hidden, head,
                        preferred_element_type=jnp.float32)
    if c.gemma and c.gemma.final_softcap is not None:
        logits = softcap(logits, c.gemma.final_softcap)
    return logits
