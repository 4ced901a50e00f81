"""Deterministic passes: every token computed by bodies of one fixed shape, so that its bits
do not depend on what else the pass computes.

Greedy speculative decoding equals greedy plain decoding only if the target's logits at a
position are the same bits whichever pass computed them: a K+1-token verification pass, a
one-token step, a tree of candidates, a batch of 1 or of 8. In float32 near-ties are rare
enough never to be seen; in bfloat16 they flip rows. XLA picks a matmul's algorithm by its
shape (on CPU a [1, E] x [E, F] product is a matrix-vector loop; [2, E] and [5, E] reduce
in different orders: measured, docs/bench/exact.txt), and it fuses each program its own
way. So here:

- Every per-token computation (embedding, norms, projections, rotary, MLP, head) runs in
  a `lax.map` over chunks of ROWS tokens (the pass's B·T tokens, padded), in a body fenced
  by optimization barriers: the same computation of the same shapes in every program.
  Within one such matmul a row's result depends on that row alone (measured).
- Attention runs one query at a time, over key blocks of BLOCK slots with an online
  softmax, visiting blocks 0 .. position // BLOCK: a block past the query's position is
  never read, and a fully masked one changes nothing, so neither the cache's length nor
  the other queries matter. The keys a query sees are gathered in position order: a tree
  node's ancestors come from where the tree lies (the pass's own slots, or the cache's held
  tree), so a node attends exactly as a one-token pass at its position does.

The price: weights are read once per chunk of ROWS tokens rather than once per pass, and
attention is sequential over queries (docs/bench/exact.txt measures it). Kernels chosen for
speed (cuDNN, splash) are not used. This module knows nothing of drafting or decoding, and
nothing of backends: whether a backend keeps these promises is measured, not assumed
(`generate` allows deterministic=True where it was).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.cache import KVCache, Pending, Placement, join, write
from specjax.config import ModelConfig
from specjax.rope import rope_cos_sin_factor, rope_inv_freq
from specjax.models.attention import values
from specjax.models.layers import MLP, Norm, rotary_angles, softcap
from specjax.models.moe import MoE
from specjax.models.transformer import attention_layer, embed_tokens, read_out

ROWS = 16  # tokens per fixed-shape body (a pass of fewer is padded to it): docs/bench/exact.txt
BLOCK = 128  # key slots per attention block


def _fenced(fn):
    """fn with optimization barriers around its inputs and outputs: XLA fuses nothing of it
    with what surrounds it, so it compiles alike in every program."""
    def body(args):
        return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(args)))
    return body


def rowwise(fn, *xs):
    """fn(*chunks) over xs [N, ...] in chunks of ROWS rows (N padded with zeros), one
    fixed-shape fenced body per chunk, one after another. Returns fn's outputs [N, ...]."""
    N = xs[0].shape[0]
    n = -(-N // ROWS)
    chunks = tuple(jnp.pad(x, [(0, n * ROWS - N)] + [(0, 0)] * (x.ndim - 1)).reshape(n, ROWS, *x.shape[1:])
                   for x in xs)
    out = jax.lax.map(_fenced(fn), chunks)
    return jax.tree.map(lambda y: y.reshape(n * ROWS, *y.shape[2:])[:N], out)


def _slot_of_position(positions, cache_len: int, placement: Placement | None):
    """int32 [B, T, S'] (S' = cache_len rounded up to BLOCK): for each query, where the key
    of each position it may see lies. Slot = position, except a tree's nodes that it sees: an
    own region's at their slots (start + r), a held tree's at S + r (its index r past the
    cache: `_attend_one`)."""
    B, T = positions.shape
    S = cache_len
    padded = -(-S // BLOCK) * BLOCK
    base = jnp.minimum(jnp.arange(padded, dtype=jnp.int32), S - 1)  # past S: masked, any slot
    if placement is None:
        return jnp.broadcast_to(base, (B, T, padded))
    R = placement.sees.shape[-1]
    first = placement.start[:, None] if placement.own else jnp.full((B, 1), S, jnp.int32)
    lies = first + jnp.arange(R, dtype=jnp.int32)[None]  # [B, R]: where each in-flight key lies
    stands_for = jnp.where(placement.sees, placement.region_positions[:, None, :], padded)  # unseen: dropped

    def one(target, where):  # [R], [R] -> [S']
        return base.at[target].set(where, mode="drop")
    return jax.vmap(jax.vmap(one, (0, None)))(stands_for, lies)


def _attend_one(q, k, v, b, where, position, scale, cap, window, tree_kv=None, pages=None, sinks=None):
    """One query's attention: q [H, D]; k, v [B, G, S, D] (the layer's cache; with a page
    table pages int32 [B, M], pools [P, G, page, D] read through row b's); b its row; where
    int32 [S'] (`_slot_of_position`); position its position; tree_kv: None, or the layer's
    held tree (k, v) [B, R, G, D], whose key r `where` names S + r; sinks: None, or the
    layer's attention sinks [H] (one more logit in each head's softmax, of value zero:
    attention.py). -> [H, D]. Zero-width values (latent attention's) are the keys
    (`attention.values`)."""
    v = values(k, v)
    tree_kv = None if tree_kv is None else (tree_kv[0], values(*tree_kv))
    G, D = k.shape[1], k.shape[3]
    S = k.shape[2] * (1 if pages is None else pages.shape[1])
    H = q.shape[0]
    qg = q.reshape(G, H // G, D)

    def gather(buf, held, slots):  # [G, BLOCK, D]
        slots_in = jnp.minimum(slots, S - 1)
        if pages is None:
            got = buf[b][:, slots_in]
        else:  # the same entries, where the row's table puts them
            got = jnp.swapaxes(buf[pages[b, slots_in // buf.shape[2]], :, slots_in % buf.shape[2]], 0, 1)
        if held is None:
            return got
        from_tree = jnp.swapaxes(held[b][jnp.clip(slots - S, 0, held.shape[1] - 1)], 0, 1)
        return jnp.where((slots >= S)[None, :, None], from_tree, got)

    def visit(j, carry):
        m, l, acc = carry  # [G, R], [G, R], [G, R, D] float32
        slots = jax.lax.dynamic_slice_in_dim(where, j * BLOCK, BLOCK)
        kb, vb = (gather(buf, held, slots) for buf, held in zip((k, v), tree_kv or (None, None)))
        s = jnp.einsum("grd,gsd->grs", qg, kb, preferred_element_type=jnp.float32) * scale
        if cap is not None:
            s = softcap(s, cap)
        seen = j * BLOCK + jnp.arange(BLOCK) <= position
        if window is not None:
            seen &= position - (j * BLOCK + jnp.arange(BLOCK)) < window
        s = jnp.where(seen, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(seen, jnp.exp(s - safe[..., None]), 0.0)
        correction = jnp.exp(m - safe)
        pv = jnp.einsum("grs,gsd->grd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        return m_new, l * correction + p.sum(-1), acc * correction[..., None] + pv

    R = H // G
    init = (jnp.full((G, R), -jnp.inf, jnp.float32), jnp.zeros((G, R), jnp.float32),
            jnp.zeros((G, R, D), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, position // BLOCK + 1, visit, init)
    if sinks is not None:  # (a query sees itself: m is finite)
        l = l + jnp.exp(sinks.astype(jnp.float32).reshape(G, R) - m)
    return (acc / l[..., None]).reshape(H, D).astype(v.dtype)


def decode(c: ModelConfig, params: dict, tokens, positions, cache: KVCache | None = None,
           placement: Placement | None = None, num_layers: int | None = None, taps: tuple | None = None,
           defer: bool = False, flat: bool = False):
    """transformer.decode, computed deterministically (see the module docstring): the same
    arguments and results, (logits float32 [B, T, V], hidden [B, T, E], cache), and with
    defer the pass's keys and values (`Pending`), which it writes too: its queries read their
    keys from the cache. (Under a placement with an offset they join the held tree instead.)
    flat: the q/k/v matmul's CPU form (`layers.qkv_matmul`)."""
    B, T = tokens.shape
    N = B * T
    flat_positions = positions.reshape(N)
    local = c.local_rope_theta is not None

    def embed(tok, pos):  # [ROWS] -> [ROWS, E]
        x = embed_tokens(c, params["embedding"], tok)
        if c.family == "gpt2":
            x = x + params["pos_embedding"][jnp.minimum(pos, c.max_position_embeddings - 1)]
        return x

    x = rowwise(embed, tokens.reshape(N), flat_positions)  # [N, E]
    pages = None if cache is None else cache.pages  # int32 [B, M]: a paged cache's table
    if cache is None:  # a full causal pass: its own keys are the cache
        own = KVCache.init(c, B, T, x.dtype)
        k_all, v_all, slots, length = list(own.k), list(own.v), positions, T
    else:
        k_all, v_all, length = list(cache.k), list(cache.v), cache.max_len
        slots = positions if placement is None else placement.slots
    held = placement is not None and not placement.own
    if placement is not None and cache is None:
        raise ValueError("a placement places tokens in a cache: pass one")
    tree_k, tree_v = map(list, (cache.held_tree().k, cache.held_tree().v)) if held else (None, None)
    where = _slot_of_position(positions, length, placement).reshape(N, -1)  # [N, S']
    rows = jnp.repeat(jnp.arange(B, dtype=jnp.int32), T)  # [N]
    windows = c.layer_windows()
    attn = attention_layer(c)

    def angles(pos, local):  # [ROWS] -> this pass's rotary (cos, sin), each [ROWS, 1, D]
        cos, sin = rotary_angles(pos[None], jnp.asarray(rope_inv_freq(c, local=local), jnp.float32),
                                 rope_cos_sin_factor(c, local=local))
        return cos[0], sin[0]

    # Once per pass, by fenced bodies like the rest (None for GPT-2): {sliding: (cos, sin)}
    rotations = {} if c.family == "gpt2" else {
        sliding: rowwise(lambda pos, sliding=sliding: angles(pos, sliding), flat_positions)
        for sliding in {local and w is not None for w in windows}}

    tapped = {}  # layer number -> the residual stream after it, for `taps`
    fresh_k, fresh_v = [], []  # per layer [B, T, G, D]
    for i in range(c.num_layers if num_layers is None else num_layers):
        p = params["layers"][i]
        sliding = local and windows[i] is not None

        def project(x, *cos_sin, p=p):  # [ROWS, E] -> q [ROWS, H, D], k, v [ROWS, G, D]
            h = Norm(c).apply({"params": p["attn_norm"]}, x[None])
            rotation = tuple(a[None] for a in cos_sin) or None
            q, k, v = attn.apply({"params": p["attn"]}, h, rotation, flat, method="project_qkv")
            return q[0], k[0], v[0]

        q, k, v = rowwise(project, x, *rotations.get(sliding, ()))
        fresh_k.append(k.reshape(B, T, *k.shape[1:]))
        fresh_v.append(v.reshape(B, T, *v.shape[1:]))
        if held:
            tree_k[i], tree_v[i] = (join(buf[i], new[-1], placement.offset)
                                    for buf, new in ((tree_k, fresh_k), (tree_v, fresh_v)))
        else:
            k_all[i] = write(k_all[i], fresh_k[-1], slots, pages=pages)
            v_all[i] = write(v_all[i], fresh_v[-1], slots, pages=pages)
        heads = jax.lax.map(_fenced(lambda q, b, w, pos, i=i: _attend_one(
            q, k_all[i], v_all[i], b, w, pos, attn.scale, attn.cap, windows[i],
            (tree_k[i], tree_v[i]) if held else None, pages, p["attn"].get("sinks") if c.attn_sinks else None)),
            (q, rows, where, flat_positions))

        def finish(x, heads, p=p, i=i):  # the residual stream after attention and MLP, [ROWS, E]
            x = x + attn.apply({"params": p["attn"]}, heads[None], method="project_out")[0]
            h = Norm(c).apply({"params": p["mlp_norm"]}, x)
            if c.sparse(i):  # each assignment by its own expert's weights: independent of the others
                return x + MoE(c).apply({"params": p["moe"]}, h[None], form="gathered")[0]
            return x + MLP(c).apply({"params": p["mlp"]}, h[None])[0]

        x = rowwise(finish, x, heads)
        if taps and i + 1 in taps:
            tapped[i + 1] = x

    tied = c.tie_word_embeddings

    def head(x):  # [ROWS, E] -> logits [ROWS, V], hidden [ROWS, E]
        hidden = Norm(c).apply({"params": params["final_norm"]}, x)
        return read_out(c, params["embedding" if tied else "lm_head"], hidden, transposed=tied), hidden

    logits, hidden = rowwise(head, x)
    if taps:
        hidden = jnp.concatenate([tapped[i] for i in taps], axis=-1)
    if cache is not None:
        cache = cache.replace(k=tuple(k_all), v=tuple(v_all))
    if held:
        cache = cache.with_tree(tree_k, tree_v)
    logits, hidden = logits.reshape(B, T, -1), hidden.reshape(B, T, -1)
    if defer:
        return logits, hidden, cache, Pending(tuple(fresh_k), tuple(fresh_v), written=True)
    return logits, hidden, cache
