"""One decoder for GPT-2, the Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3, and
DeepSeek-V3's dense layers) and the Gemma family (Gemma 2, Gemma 3 text). Where families
differ, the difference is a named piece of layers.py (norms, activation, soft-caps, q/k
norms, post-norms), DeepSeek-V3's latent attention (mla.py, `attention_layer`) or, here,
the embedding scale and final soft-cap of Gemma and each layer's rotary frequencies.

`decode` is a pure function of (config, params, tokens [B, T], positions [B, T], cache)
returning (logits [B, T, V] float32, hidden [B, T, E], cache). Each layer's weights are
arrays of their own (params["layers"][i]) and the layers run in a Python loop, unrolled
into the program: on a GPU a matmul whose weight is a slice of a stacked [L, ...] array
becomes a fusion that reads it at a third of the memory bandwidth, while a weight of its
own is read at full speed (measured: docs/bench/gpu/README.md). The price is compile
time that grows with depth (docs/bench/compile_time.txt). With a cache, each layer writes
its new keys/values at each row's own positions into its own buffer (unless its caller
defers the writes: a verification pass, which keeps only the accepted path's) and attends
to the committed prefix below the pass (read in place) and to the pass's in-flight keys
under their own mask (`pass_view`, attention.cached_attention); without one, it attends over
the T tokens given (a full causal pass).

A `Placement` (cache.py) overrides "slot = position, causal" for one pass: a token tree's
nodes see the prefix and their ancestors only, and their keys stay out of the cache's
buffers (a verification pass's own, deferred; a drafter's tree held beside them).

The decoder does not touch `cache.lengths`: which written entries are valid is decided by
whoever drives it (the decoding loop). It knows nothing about checkpoints or sampling.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from specjax.backend import Backend
from specjax.cache import KVCache, Pending, Placement, attention_mask, join, write
from specjax.config import ModelConfig
from specjax.rope import rope_cos_sin_factor, rope_inv_freq
from specjax.models.attention import attention, cached_attention, choose
from specjax.models.layers import MLP, Attention, Norm, init, matmul, rotary_angles, softcap
from specjax.models.mla import LatentAttention
from specjax.models.moe import MoE
from specjax.quant import Int8


def attention_layer(c: ModelConfig, in_size: int | None = None, name: str | None = None):
    """A layer's attention projections: latent attention's (DeepSeek-V3: models/mla.py),
    else q/k/v heads (layers.Attention). Both give what attention.py's paths take."""
    if c.mla is not None:
        if in_size is not None:
            raise ValueError("latent attention reads the residual stream: it has no input of its own")
        return LatentAttention(c, name=name)
    return Attention(c, in_size, name=name)


class Block(nn.Module):
    """One pre-norm decoder layer. (Gemma's attention and MLP also norm their own outputs:
    see layers.py.) Published EAGLE heads' layers differ at the attention's input: EAGLE-1's
    has no norm there (attn_norm=False), EAGLE-3's projects q, k and v from an input of its
    own (`attn_input`, attn_in_size wide) beside the residual stream x."""

    config: ModelConfig
    attn_norm: bool = True
    attn_in_size: int | None = None
    sparse: bool = False  # its MLP is the config's mixture of experts (models/moe.py)
    moe_form: str | None = None  # how its experts compute (moe.FORMS; None: by the pass's shape)

    @nn.compact
    def __call__(self, x, cos_sin, view: "View", sliding: bool, cache_kv=None, tree_kv=None, attn_input=None):
        """x [B, T, E]; cos_sin: this layer's rotary angles (None for GPT-2); view: what the
        pass's queries see (`pass_view`); sliding: whether this is a sliding-window layer;
        cache_kv: None, or this layer's (k, v) buffers [B', G, S, D] (B' >= B: cache.py);
        tree_kv: None, or the layer's held tree (k, v) [B, R, G, D] (KVCache.tree), which the
        pass's keys join at view.offset. Returns (x, cache_kv with the T new entries written
        unless view.writes is False, the new (k, v) [B, T, G, D], or the held tree with them).
        attn_input: None (the attention reads x, normed where attn_norm), or what it reads
        [B, T, attn_in_size]."""
        attn = attention_layer(self.config, self.attn_in_size, name="attn")
        backend = view.backend
        if attn_input is None:
            attn_input = Norm(self.config, name="attn_norm")(x) if self.attn_norm else x
        q, k, v = attn.project_qkv(attn_input, cos_sin, flat=backend.platform == "cpu")
        if view.offset is not None:  # a tree in flight: the pass's nodes join the earlier ones
            k, v = (join(held, new, view.offset) for held, new in zip(tree_kv, (k, v)))  # [B, R, G, D]
        fresh = k, v
        sinks = attn.sink_logits()
        if cache_kv is None:  # a full pass: its own keys, causal
            out = attention(q, k, v, view.masks[sliding], attn.scale, attn.cap, backend=backend, kernels=view.kernels,
                            sinks=sinks)
        else:
            if view.writes:  # a row's slots are consecutive
                cache_kv = tuple(write(buf, x, view.slots, backend.consecutive_writes, view.pages)
                                 for buf, x in zip(cache_kv, (k, v)))
            B = q.shape[0]  # the buffers' first B rows are this pass's (cache.py)
            if view.dense is not None:  # a kernel's pass: the whole cache under one mask
                out = attention(q, *(buf[:B] for buf in cache_kv), view.dense[sliding], attn.scale, attn.cap,
                                view.kv_limit, backend=backend, kernels=True, heads_first=True, sinks=sinks)
            else:
                out = cached_attention(q, k, v, view.masks[sliding], *cache_kv, view.prefix, view.floors[sliding],
                                       attn.scale, attn.cap, backend=backend, kernels=view.kernels, rules=view.rules,
                                       pages=view.pages, sinks=sinks)
        x = x + attn.project_out(out)
        h = Norm(self.config, name="mlp_norm")(x)
        x = x + (MoE(self.config, name="moe")(h, self.moe_form, platform=backend.platform, mesh=backend.mesh,
                                                 rules=view.rules)
                 if self.sparse
                 else MLP(self.config, name="mlp")(h))
        return x, cache_kv, fresh


def decode(c: ModelConfig, params: dict, tokens, positions, cache: KVCache | None = None,
           placement: Placement | None = None, num_layers: int | None = None, taps: tuple | None = None, *,
           backend: Backend, kernels: bool = False, rules: tuple | None = None, defer: bool = False):
    """Activations take the parameters' dtype; logits are always float32.

    defer: the caller keeps only some of the pass's keys and values and writes those itself
    (`cache.commit`): a verification pass, of whose tokens only the accepted path stays.
    The pass then writes none where its attention does not read them back from the cache
    (the split attention, `cached_attention`), and returns them as a fourth result
    (`cache.Pending`). A kernel over the whole cache (cuDNN's) reads them there, so it
    still writes them (Pending.written). A placement with an offset (a drafter's tree) writes
    nothing to the buffers: its keys join the cache's held tree (KVCache.tree), returned in
    the cache.

    backend: the program's (backend.py): its platform picks the matmul and cache-write forms
    and which kernels exist. kernels: attention takes backend's fused kernel where one
    applies (`attention.choose`; `attention.takes_kernels` of Model.attention); otherwise the
    jnp path. rules: the logical-axis rules the model's params (and so its cache) are laid
    out by on a mesh (Model.rules), which a sharded program's kernel follows.

    num_layers: run only the first num_layers layers, then the final norm and head (early
    exit; the cache's other layers are returned untouched).
    taps: None, or layer numbers i (1..L): `hidden` is then the residual stream after each
    of those layers, concatenated ([B, T, len(taps) E]), instead of the final-normed states."""
    # No fused kernel takes latent attention's keys (D_k = r + rope, zero-width values):
    # its passes attend portably (models/mla.py).
    kernels = kernels and c.mla is None
    x = embed_tokens(c, params["embedding"], tokens)  # [B, T, E]
    if c.family == "gpt2":
        x = x + params["pos_embedding"][jnp.minimum(positions, c.max_position_embeddings - 1)]
    view = pass_view(c, positions, cache, placement, backend, x.dtype if kernels else None, rules, defer)
    angles = rotary_tables(c, positions)
    k, v = (None, None) if cache is None else (list(cache.k), list(cache.v))
    tree = None if view.offset is None else cache.held_tree()
    tapped = {}  # layer number -> the residual stream after it, for `taps`
    fresh_k, fresh_v = [], []  # per layer [B, T, G, D]: the pass's own keys and values
    for i in range(c.num_layers if num_layers is None else num_layers):
        sliding = c.layer_windows()[i] is not None
        kv = None if cache is None else (k[i], v[i])
        held = None if tree is None else (tree.k[i], tree.v[i])
        x, kv, (fresh_k_i, fresh_v_i) = Block(c, sparse=c.sparse(i)).apply(
            {"params": params["layers"][i]}, x, angles[sliding], view, sliding, kv, held)
        fresh_k.append(fresh_k_i)
        fresh_v.append(fresh_v_i)
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
    if tree is not None:  # the held tree, with this pass's nodes
        cache = cache.with_tree(fresh_k, fresh_v)
    if defer:
        fresh = tuple(fresh_k), tuple(fresh_v)
        if not view.writes and backend.platform != "cpu":
            # Computed here, not where they are committed: fused into the commit, their producer
            # keeps its inputs alive through acceptance (on a TPU, and on a GPU the q/k/v
            # matmul's float32 split-K partial sums: docs/bench/aot_tree.txt). Not on a CPU,
            # whose tree loop runs slower behind the barrier (docs/bench/cpu_tree.txt).
            fresh = jax.lax.optimization_barrier(fresh)
        return logits, hidden, cache, Pending(*fresh, written=view.writes)
    return logits, hidden, cache


def init_params(c: ModelConfig, key: jax.Array) -> dict:
    """Random float32 params (normal(0.02) weights, unit norms (Gemma: zero), zero biases)."""
    keys = jax.random.split(key, c.num_layers + 3)
    E = c.hidden_size
    params = {"embedding": init(keys[0], (c.vocab_size, E), jnp.float32),
              "layers": [init_layer(c, k, c.sparse(i)) for i, k in enumerate(keys[3:])],
              "final_norm": Norm(c).init(keys[1], jnp.zeros((1, 1, E)))["params"]}
    if c.family == "gpt2":
        params["pos_embedding"] = init(keys[2], (c.max_position_embeddings, E), jnp.float32)
    if not c.tie_word_embeddings:
        params["lm_head"] = init(keys[2], (E, c.vocab_size), jnp.float32)
    return params


@functools.partial(jax.jit, static_argnums=(0, 2))
def init_layer(c: ModelConfig, key: jax.Array, sparse: bool = False) -> dict:
    """One layer's random params (compiled once per config and kind of MLP, run once per layer)."""
    x = jnp.zeros((1, 1, c.hidden_size), jnp.float32)
    positions = jnp.zeros((1, 1), jnp.int32)
    angles = rotary_tables(c, positions)
    view = pass_view(c, positions, None, None, Backend("cpu"))  # (shapes alone: any platform's)
    return Block(c, sparse=sparse).init(key, x, angles[False], view, False)["params"]


def embed_tokens(c: ModelConfig, embedding, tokens):
    """The embedding rows of tokens [B, T] (int8 or float): [B, T, E], Gemma's scaled by
    sqrt(E) and rounded to the dtype as transformers does."""
    x = embedding.rows(tokens) if isinstance(embedding, Int8) else embedding[tokens]
    if c.family == "gemma":
        x = x * jnp.asarray(c.hidden_size ** 0.5, x.dtype)
    return x


def rotary_tables(c: ModelConfig, positions) -> dict:
    """{sliding: (cos, sin)}: the rotary angles of full-attention layers (False) and of
    sliding-window layers (True), each computed once per pass; None for GPT-2. (YaRN's
    attention factor scales both cos and sin: `rope_cos_sin_factor`.)"""
    if c.family == "gpt2":
        return {False: None, True: None}

    def angles(local):
        inv_freq = jnp.asarray(rope_inv_freq(c, local=local), jnp.float32)
        return rotary_angles(positions, inv_freq, rope_cos_sin_factor(c, local=local))
    full = angles(False)
    return {False: full, True: full if c.local_rope_theta is None else angles(True)}


class View(NamedTuple):
    """What the T queries of one pass see, for full-attention layers (key False of each
    dict) and sliding-window ones (True; None where the model has none)."""

    slots: jax.Array  # int32 [B, T]: where the pass writes its keys in the cache (its positions without one)
    masks: dict  # {sliding: bool [B, T, N]}: what each query sees of the N in-flight keys
    prefix: jax.Array | None  # int32 [B]: every query of row b sees the cache's slots below it (None: no cache)
    floors: dict  # {sliding: int32 [B, T] or None}: a window's query sees only prefix slots above its floor
    offset: jax.Array | None  # int32 []: where the pass's keys join the cache's held tree (None: its own are in flight)
    dense: dict | None  # {sliding: bool [B, T, S]}: the same as one mask over the cache, where a kernel reads it
    kv_limit: jax.Array | None  # int32 [B]: one past the highest slot any query of row b sees (with `dense`)
    backend: Backend  # the program's: its platform, mesh, and whether attention must be portable
    kernels: bool  # whether the pass may take a kernel of backend's (the model asks: Model.attention)
    rules: tuple | None = None  # the model's logical-axis rules on a mesh (Model.rules), which a kernel follows
    writes: bool = True  # whether the pass writes its keys into the cache (see decode's `defer`)
    pages: jax.Array | None = None  # int32 [B, M]: a paged cache's page table (KVCache.pages)


def pass_view(c: ModelConfig, positions, cache: KVCache | None, placement: Placement | None, backend: Backend,
              dtype=None, rules: tuple | None = None, defer: bool = False) -> View:
    """What T tokens at positions [B, T] see. Without a cache: each other, causally. With
    one: the committed prefix (slots below the first position, or the placement's start),
    read in place, and the in-flight keys under their own mask: the pass's own, causally by
    position, or a placement's region (a tree: what `sees` marks), the pass's own or the
    cache's held tree. A sliding window bounds both by position. backend: the program's.
    dtype: the activations', where the pass may take one of backend's attention kernels
    (None: it attends portably); where one takes a cached pass (`attention.choose`), the view
    also holds the [B, T, S] mask of the whole cache it reads.
    rules: the model's (Model.rules), for a sharded program's prefix kernel. defer: see `decode`."""
    window = next((w for w in c.layer_windows() if w is not None), None)
    kinds = (False,) if window is None else (False, True)

    def within(mask, kv_positions, sliding):  # the window's bound on a [B, T, N] mask
        return mask & (positions[:, :, None] - kv_positions[:, None, :] < window) if sliding else mask

    if placement is None:
        causal = positions[:, None, :] <= positions[:, :, None]  # [B, T, T]
        masks = {w: within(causal, positions, w) for w in kinds}
        offset, prefix = None, positions[:, 0]
    else:
        masks = {w: within(placement.sees, placement.region_positions, w) for w in kinds}
        offset, prefix = placement.offset, placement.start
    if cache is None and placement is not None:
        raise ValueError("a placement places tokens in a cache: pass one")
    if defer and (cache is None or offset is not None):
        raise ValueError("only a cached pass over its own keys (no placement, or Placement.own) may defer its "
                         "cache writes")
    if cache is None:
        return View(positions, masks, None, {}, None, None, None, backend, dtype is not None, rules)
    floors = {w: positions - window if w else None for w in kinds}
    dense, kv_limit = None, None
    cap = c.gemma.attn_softcap if c.gemma else None
    if (dtype is not None and offset is None and cache.pages is None
            and choose(backend, dtype, positions.shape[1], cache.max_len, c.head_dim, cap, c.attn_sinks) != "portable"):
        if placement is None:
            kv_positions = jnp.arange(cache.max_len)[None, :]  # [1, S]: slot = position
            visible = attention_mask(positions, kv_positions)
        else:
            kv_positions, visible = placement.dense(cache.max_len)
        dense = {w: within(visible, kv_positions, w) for w in kinds}
        seen = visible.any(axis=1)  # [B, S]: slots some query of the row sees
        kv_limit = jnp.max(jnp.where(seen, jnp.arange(cache.max_len, dtype=jnp.int32) + 1, 0), axis=1)
    writes = offset is None and (not defer or dense is not None)
    return View(positions if placement is None else placement.slots, masks, prefix, floors, offset, dense, kv_limit,
                backend, dtype is not None, rules, writes=writes, pages=cache.pages)


def read_out(c: ModelConfig, head, hidden, transposed: bool = False):
    """float32 logits [..., V] from final hidden states [..., E] through a head [E, V] (or
    the embedding [V, E] when transposed: tied), int8 or float, with Gemma's final soft-cap."""
    logits = matmul("...e,ve->...v" if transposed else "...e,ev->...v", hidden, head, jnp.float32)
    if c.gemma and c.gemma.final_softcap is not None:
        logits = softcap(logits, c.gemma.final_softcap)
    return logits
