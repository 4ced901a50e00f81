"""Hugging Face tensor names and shapes <-> specjax parameters, one table per family.

Each `Weights` entry says which Hugging Face tensors (names, shapes) become which specjax
parameters and how: transposes, head splits, and the fusions specjax computes with (q, k
and v as one `qkv_kernel` [G, R+2, D, E] whatever the checkpoint fused; gate and up as one
`gate_up_kernel` [2, E, F]). `to_ours` returns numpy views of the files' arrays where a
view exists, and a lazy `Concat` of views where the parameter joins several tensors, so
that a loader reads only the blocks it places; `to_hf` runs the table backwards for saving.

This module knows names, shapes and index arithmetic; it reads no file (see hf.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from specjax.config import ModelConfig


class Concat:
    """np.concatenate(parts, axis), not yet computed: `block(index)` builds only the block
    a tuple of slices asks for, from the parts that overlap it, and `parts_in(index)` says
    which part slices fill which block slices (so that a loader can copy them piecewise)."""

    def __init__(self, parts, axis: int):
        self.parts, self.axis = list(parts), axis
        first = self.parts[0]
        self.dtype = first.dtype
        self.shape = tuple(sum(p.shape[axis] for p in self.parts) if a == axis else n
                           for a, n in enumerate(first.shape))
        self.ndim = len(self.shape)

    def parts_in(self, index: tuple[slice, ...]):
        """(part, the part's index, the block's index) for each part that index overlaps."""
        index = tuple(index) + (slice(None),) * (self.ndim - len(index))
        lo, hi, _ = index[self.axis].indices(self.shape[self.axis])
        offset = 0
        for part in self.parts:
            n = part.shape[self.axis]
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                src = index[:self.axis] + (slice(a - offset, b - offset),) + index[self.axis + 1:]
                dst = (slice(None),) * self.axis + (slice(a - lo, b - lo),)
                yield part, src, dst
            offset += n

    def block(self, index: tuple[slice, ...] = ()) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (self.ndim - len(index))
        shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, self.shape))
        out = np.empty(shape, self.dtype)
        for part, src, dst in self.parts_in(index):
            out[dst] = part[src]
        return out

    def __array__(self, dtype=None, copy=None):
        out = self.block()
        return out if dtype is None else out.astype(dtype)


@dataclasses.dataclass(frozen=True)
class Weights:
    """Hugging Face tensors (names with `{i}` for per-layer ones, and shapes) and the specjax
    parameters they become (paths inside a layer's params for per-layer ones)."""

    hf: tuple[tuple[str, tuple[int, ...]], ...]
    paths: tuple[tuple[str, ...], ...]
    to_ours: Callable  # tuple of hf arrays -> tuple of ours (views or Concats), one per path
    to_hf: Callable  # tuple of our arrays -> tuple of hf arrays, one per name
    layers: tuple[int, ...] | None = None  # the layers a per-layer entry covers (None: every one)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf[0][0]

    def indices(self, num_layers: int) -> list:
        """The layer numbers i its names are formatted with ([None]: not per layer)."""
        if not self.per_layer:
            return [None]
        return list(range(num_layers)) if self.layers is None else list(self.layers)

    def names(self, i: int | None = None) -> tuple[str, ...]:
        return tuple(name.format(i=i) for name, _ in self.hf)


def _same(path, name, shape):
    return Weights(((name, shape),), (path,), lambda ws: ws, lambda ps: ps)


def _linear(path, name, n_in, n_out_shape):
    """A torch Linear weight [out, in] -> kernel [in, *out_shape]."""
    n_out = int(np.prod(n_out_shape))
    return Weights(((name, (n_out, n_in)),), (path,), lambda ws: (ws[0].T.reshape(n_in, *n_out_shape),),
                   lambda ps: (ps[0].reshape(n_in, n_out).T,))


def _linear_out(path, name, in_shape, n_out):
    """A torch Linear weight [out, in] whose input is heads -> kernel [*in_shape, out]."""
    n_in = int(np.prod(in_shape))
    return Weights(((name, (n_out, n_in)),), (path,), lambda ws: (ws[0].T.reshape(*in_shape, n_out),),
                   lambda ps: (ps[0].reshape(n_in, n_out).T,))


def _qkv(c: ModelConfig, names: tuple[str, ...], bias: bool = False) -> Weights:
    """q, k, v projections (three Linear weights [out, E], or Phi-3's one qkv_proj with the
    three stacked along out; or their biases) -> qkv_kernel [G, R+2, D, E] (qkv_bias [G, R+2, D]):
    each a view of the Linear's [out, E] rows."""
    E, H, G, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    R = H // G
    sizes = (H * D, G * D, G * D)
    trail = () if bias else (E,)
    shapes = ((sum(sizes), *trail),) if len(names) == 1 else tuple((n, *trail) for n in sizes)

    def to_ours(ws):
        q, k, v = np.split(ws[0], np.cumsum(sizes)[:-1]) if len(ws) == 1 else ws  # [out, *trail]
        parts = [q.reshape(G, R, D, *trail), k.reshape(G, 1, D, *trail), v.reshape(G, 1, D, *trail)]
        return (Concat(parts, axis=1),)

    def to_hf(ps):
        w = ps[0]  # [G, R+2, D, *trail]
        out = tuple(x.reshape(-1, *trail) for x in (w[:, :R], w[:, R], w[:, R + 1]))
        return (np.concatenate(out),) if len(names) == 1 else out

    return Weights(tuple(zip(names, shapes)), (("attn", "qkv_bias" if bias else "qkv_kernel"),), to_ours, to_hf)


def _gate_up(c: ModelConfig, names: tuple[str, ...], bias: bool = False) -> Weights:
    """gate and up projections (two Linear weights [F, E], or Phi-3's one gate_up_proj [2F, E];
    or their biases) -> gate_up_kernel [2, E, F] (gate_up_bias [2, F])."""
    E, F = c.hidden_size, c.intermediate_size
    shapes = ((2 * F,),) if len(names) == 1 else ((F,), (F,))
    if not bias:
        shapes = tuple(s + (E,) for s in shapes)

    def to_ours(ws):
        gate, up = np.split(ws[0], 2) if len(ws) == 1 else ws
        return (Concat([(w if bias else w.T)[None] for w in (gate, up)], axis=0),)

    def to_hf(ps):
        w = ps[0]
        gate, up = (w[i] if bias else w[i].T for i in (0, 1))
        return (np.concatenate([gate, up]),) if len(names) == 1 else (gate, up)

    return Weights(tuple(zip(names, shapes)), (("mlp", "gate_up_bias" if bias else "gate_up_kernel"),),
                   to_ours, to_hf)


def _experts(c: ModelConfig, prefix: str, names: tuple[str, str, str]) -> list[Weights]:
    """Each expert's gate, up and down Linear weights (prefix + f"{j}.{name}.weight", [I, E]
    and [E, I]) -> experts_gate, experts_up [X, E, I] and experts_down [X, I, E], each the
    transposed weights stacked (a lazy Concat of views)."""
    E, X, I = c.hidden_size, c.moe.num_experts, c.moe.expert_size

    def stacked(path, name, shape):
        def to_ours(ws):
            return (Concat([w.T[None] for w in ws], axis=0),)

        def to_hf(ps):
            return tuple(ps[0][j].T for j in range(X))

        return Weights(tuple((f"{prefix}{j}.{name}.weight", shape) for j in range(X)), (("moe", path),),
                       to_ours, to_hf, sparse_layers(c))

    gate, up, down = names
    return [stacked("experts_gate", gate, (I, E)), stacked("experts_up", up, (I, E)),
            stacked("experts_down", down, (E, I))]


def sparse_layers(c: ModelConfig) -> tuple[int, ...]:
    return tuple(i for i in range(c.num_layers) if c.sparse(i))


def _dense_layers(c: ModelConfig) -> tuple[int, ...] | None:
    return None if c.moe is None else tuple(i for i in range(c.num_layers) if not c.sparse(i))


def gpt_oss_experts(c: ModelConfig) -> list[Weights]:
    """gpt-oss's router (mlp.router.weight [X, E] and bias [X]) and its experts, stored fused:
    mlp.experts.gate_up_proj [X, E, 2I], gate and up interleaved (gate = [..., ::2], up =
    [..., 1::2]), gate_up_proj_bias [X, 2I], down_proj [X, I, E], down_proj_bias [X, E]
    -> experts_gate, experts_up (strided views) and their biases, experts_down as it lies."""
    E, X, I, L = c.hidden_size, c.moe.num_experts, c.moe.expert_size, "model.layers.{i}.mlp."
    on = sparse_layers(c)

    def interleaved(name, shape, paths):
        return Weights(((L + name, shape),), paths, lambda ws: (ws[0][..., ::2], ws[0][..., 1::2]),
                       lambda ps: (np.stack([np.asarray(p) for p in ps], axis=-1).reshape(shape),), on)

    return [
        interleaved("experts.gate_up_proj", (X, E, 2 * I), (("moe", "experts_gate"), ("moe", "experts_up"))),
        interleaved("experts.gate_up_proj_bias", (X, 2 * I),
                    (("moe", "experts_gate_bias"), ("moe", "experts_up_bias"))),
        dataclasses.replace(_same(("moe", "experts_down"), L + "experts.down_proj", (X, I, E)), layers=on),
        dataclasses.replace(_same(("moe", "experts_down_bias"), L + "experts.down_proj_bias", (X, E)), layers=on),
        dataclasses.replace(_linear(("moe", "router"), L + "router.weight", E, (X,)), layers=on),
        dataclasses.replace(_same(("moe", "router_bias"), L + "router.bias", (X,)), layers=on),
    ]


def moe_layout(c: ModelConfig) -> list[Weights]:
    """A sparse layer's router, experts and shared expert (Qwen2/3-MoE's, DeepSeek-V3's and
    GLM-4.5's mlp.*, Mixtral's block_sparse_moe.*, gpt-oss's fused experts: `gpt_oss_experts`)."""
    E, X, L = c.hidden_size, c.moe.num_experts, "model.layers.{i}."
    on_sparse = sparse_layers(c)
    if c.model_type == "gpt_oss":
        return gpt_oss_experts(c)
    if c.model_type == "mixtral":
        base = L + "block_sparse_moe."
        out = _experts(c, base + "experts.", ("w1", "w3", "w2"))
    else:
        base = L + "mlp."
        out = _experts(c, base + "experts.", ("gate_proj", "up_proj", "down_proj"))
    out.append(dataclasses.replace(_linear(("moe", "router"), base + "gate.weight", E, (X,)), layers=on_sparse))
    if c.moe.router == "sigmoid_grouped":  # DeepSeek-V3's and GLM-4.5's
        out.append(dataclasses.replace(_same(("moe", "router_bias"), base + "gate.e_score_correction_bias", (X,)),
                                       layers=on_sparse))
    if c.moe.shared_size:
        shared = dataclasses.replace(c, intermediate_size=c.moe.shared_size)
        s = base + ("shared_experts." if c.moe.router == "sigmoid_grouped" else "shared_expert.")
        out += [dataclasses.replace(w, paths=tuple(("moe", "shared") + p[1:] for p in w.paths), layers=on_sparse)
                for w in (_gate_up(shared, (s + "gate_proj.weight", s + "up_proj.weight")),
                          _linear(("mlp", "down_kernel"), s + "down_proj.weight", c.moe.shared_size, (E,)))]
    if c.moe.shared_gate:
        out.append(Weights(((base + "shared_expert_gate.weight", (1, E)),), (("moe", "shared_gate"),),
                           lambda ws: (ws[0][0],), lambda ps: (ps[0][None],), on_sparse))
    return out


def llama_layout(c: ModelConfig) -> list[Weights]:
    """The Llama and Gemma families: one Linear per projection, except Phi-3, which fuses
    q, k, v into qkv_proj and gate, up into gate_up_proj (concatenated along the output)."""
    E, H, D, F, V = c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size, c.vocab_size
    L = "model.layers.{i}."
    out = [
        _same(("embedding",), "model.embed_tokens.weight", (V, E)),
        _same(("final_norm", "scale"), "model.norm.weight", (E,)),
        _same(("attn_norm", "scale"), L + "input_layernorm.weight", (E,)),
    ]
    if c.family == "gemma":  # a norm before and after each of attention and the MLP
        out += [_same(("attn", "post_norm", "scale"), L + "post_attention_layernorm.weight", (E,)),
                _same(("mlp_norm", "scale"), L + "pre_feedforward_layernorm.weight", (E,)),
                _same(("mlp", "post_norm", "scale"), L + "post_feedforward_layernorm.weight", (E,))]
    else:
        out.append(_same(("mlp_norm", "scale"), L + "post_attention_layernorm.weight", (E,)))
    dense = _dense_layers(c)  # the layers with a dense MLP (None: every one)
    if c.model_type == "phi3":
        out += [_qkv(c, (L + "self_attn.qkv_proj.weight",)), _gate_up(c, (L + "mlp.gate_up_proj.weight",))]
    else:
        out += [_qkv(c, tuple(L + f"self_attn.{n}_proj.weight" for n in "qkv")),
                dataclasses.replace(_gate_up(c, (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight")), layers=dense)]
    out += [_linear_out(("attn", "o_kernel"), L + "self_attn.o_proj.weight", (H, D), E),
            dataclasses.replace(_linear(("mlp", "down_kernel"), L + "mlp.down_proj.weight", F, (E,)), layers=dense)]
    if c.moe is not None:
        out += moe_layout(c)
    if c.qk_norm:
        out += [_same(("attn", "q_norm", "scale"), L + "self_attn.q_norm.weight", (D,)),
                _same(("attn", "k_norm", "scale"), L + "self_attn.k_norm.weight", (D,))]
    if c.qkv_bias:
        out.append(_qkv(c, tuple(L + f"self_attn.{n}_proj.bias" for n in "qkv"), bias=True))
    if c.out_bias:
        out.append(_same(("attn", "o_bias"), L + "self_attn.o_proj.bias", (E,)))
    if c.attn_sinks:
        out.append(_same(("attn", "sinks"), L + "self_attn.sinks", (H,)))
    if c.mlp_bias:
        out += [_gate_up(c, (L + "mlp.gate_proj.bias", L + "mlp.up_proj.bias"), bias=True),
                _same(("mlp", "down_bias"), L + "mlp.down_proj.bias", (E,))]
    if not c.tie_word_embeddings:
        out.append(_linear(("lm_head",), "lm_head.weight", E, (V,)))
    return out


def deepseek_layout(c: ModelConfig) -> list[Weights]:
    """DeepSeek-V3: Llama's norms, MLP (or experts: `moe_layout`) and head around latent attention
    (models/mla.py): q_proj, or q_a_proj, q_a_layernorm and q_b_proj; kv_a_proj_with_mqa and
    kv_a_layernorm; kv_b_proj [H (n + v), r], whose heads' key rows become k_b_kernel
    [H, n, r] and value rows v_b_kernel [H, v, r] (views); o_proj."""
    m = c.mla
    E, H, F, V = c.hidden_size, c.num_heads, c.intermediate_size, c.vocab_size
    n, r, Dv, Dq = m.qk_nope_head_dim, m.kv_lora_rank, m.v_head_dim, m.qk_head_dim
    L, A = "model.layers.{i}.", "model.layers.{i}.self_attn."
    out = [
        _same(("embedding",), "model.embed_tokens.weight", (V, E)),
        _same(("final_norm", "scale"), "model.norm.weight", (E,)),
        _same(("attn_norm", "scale"), L + "input_layernorm.weight", (E,)),
        _same(("mlp_norm", "scale"), L + "post_attention_layernorm.weight", (E,)),
        dataclasses.replace(_gate_up(c, (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight")),
                            layers=_dense_layers(c)),
        dataclasses.replace(_linear(("mlp", "down_kernel"), L + "mlp.down_proj.weight", F, (E,)),
                            layers=_dense_layers(c)),
        _linear(("attn", "kv_a_kernel"), A + "kv_a_proj_with_mqa.weight", E, (m.latent_dim,)),
        _same(("attn", "kv_a_norm", "scale"), A + "kv_a_layernorm.weight", (r,)),
        Weights(((A + "kv_b_proj.weight", (H * (n + Dv), r)),), (("attn", "k_b_kernel"), ("attn", "v_b_kernel")),
                lambda ws: tuple(np.split(ws[0].reshape(H, n + Dv, r), [n], axis=1)),
                lambda ps: (np.concatenate(ps, axis=1).reshape(H * (n + Dv), r),)),
        _linear_out(("attn", "o_kernel"), A + "o_proj.weight", (H, Dv), E),
    ]
    if m.q_lora_rank is None:
        out.append(_linear(("attn", "q_kernel"), A + "q_proj.weight", E, (H, Dq)))
    else:
        Q = m.q_lora_rank
        out += [_linear(("attn", "q_a_kernel"), A + "q_a_proj.weight", E, (Q,)),
                _same(("attn", "q_a_norm", "scale"), A + "q_a_layernorm.weight", (Q,)),
                _linear(("attn", "q_b_kernel"), A + "q_b_proj.weight", Q, (H, Dq))]
    if c.moe is not None:
        out += moe_layout(c)
    if not c.tie_word_embeddings:
        out.append(_linear(("lm_head",), "lm_head.weight", E, (V,)))
    return out


def gpt2_layout(c: ModelConfig) -> list[Weights]:
    """GPT-2 stores Conv1D weights as [in, out] and fuses q, k, v into c_attn [E, 3 H D]."""
    E, H, D, F, V = c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size, c.vocab_size
    L = "transformer.h.{i}."
    out = [
        _same(("embedding",), "transformer.wte.weight", (V, E)),
        _same(("pos_embedding",), "transformer.wpe.weight", (c.max_position_embeddings, E)),
        _same(("final_norm", "scale"), "transformer.ln_f.weight", (E,)),
        _same(("final_norm", "bias"), "transformer.ln_f.bias", (E,)),
        _same(("attn_norm", "scale"), L + "ln_1.weight", (E,)),
        _same(("attn_norm", "bias"), L + "ln_1.bias", (E,)),
        _same(("mlp_norm", "scale"), L + "ln_2.weight", (E,)),
        _same(("mlp_norm", "bias"), L + "ln_2.bias", (E,)),
        # [E, 3 H D] -> [H, 3, D, E]: G = H kv heads, each with R = 1 query head (a view).
        Weights(((L + "attn.c_attn.weight", (E, 3 * H * D)),), (("attn", "qkv_kernel"),),
                lambda ws: (ws[0].reshape(E, 3, H, D).transpose(2, 1, 3, 0),),
                lambda ps: (ps[0].transpose(3, 1, 0, 2).reshape(E, 3 * H * D),)),
        Weights(((L + "attn.c_attn.bias", (3 * H * D,)),), (("attn", "qkv_bias"),),
                lambda ws: (ws[0].reshape(3, H, D).transpose(1, 0, 2),),
                lambda ps: (ps[0].transpose(1, 0, 2).reshape(3 * H * D),)),
        Weights(((L + "attn.c_proj.weight", (H * D, E)),), (("attn", "o_kernel"),),
                lambda ws: (ws[0].reshape(H, D, E),), lambda ps: (ps[0].reshape(H * D, E),)),
        _same(("attn", "o_bias"), L + "attn.c_proj.bias", (E,)),
        _same(("mlp", "fc_kernel"), L + "mlp.c_fc.weight", (E, F)),
        _same(("mlp", "fc_bias"), L + "mlp.c_fc.bias", (F,)),
        _same(("mlp", "proj_kernel"), L + "mlp.c_proj.weight", (F, E)),
        _same(("mlp", "proj_bias"), L + "mlp.c_proj.bias", (E,)),
    ]
    if not c.tie_word_embeddings:
        out.append(_linear(("lm_head",), "lm_head.weight", E, (V,)))
    return out


def layout(c: ModelConfig) -> list[Weights]:
    if c.mla is not None:
        return deepseek_layout(c)
    return gpt2_layout(c) if c.family == "gpt2" else llama_layout(c)


def mtp_block_config(c: ModelConfig, count: int) -> ModelConfig:
    """The target's config grown by its `count` multi-token-prediction (MTP) layers, layers
    L .. L+count-1 after its L: whose table (`layout`) names their decoder blocks' tensors
    as the target's layers' are named, each block's MLP sparse where `ModelConfig.sparse`
    says of its number (DeepSeek-V3's rule: every layer from first_k_dense_replace on). Full
    attention everywhere (layer_types dropped: they list the target's layers alone)."""
    return dataclasses.replace(c, num_layers=c.num_layers + count, layer_types=None)


def mtp_layout(c: ModelConfig, count: int, layers: tuple[int, ...] | None = None,
               embedding: bool = False) -> list[Weights]:
    """The tensors of a target's MTP layers as DeepSeek-V3 ships them (and Kimi-K2 and
    GLM-4.5), layer L+k for k < count (`layers`: those numbers alone; None: all):
    model.layers.{i}.enorm.weight, .hnorm.weight [E], eh_proj.weight [E, 2E] (its input the
    normed embedding, then the normed hidden state), a decoder block named as the target's
    layers are (.self_attn.*, .mlp.*, .input_layernorm, .post_attention_layernorm: `layout`
    of `mtp_block_config`), shared_head.norm.weight [E], shared_head.head.weight [V, E] and,
    with embedding (DeepSeek-V3's files), embed_tokens.weight [V, E]. Paths are inside one
    MTP layer's params: enorm, hnorm {scale}, eh_proj {kernel [2E, E]}, layer (the block's),
    head_norm {scale}, head {kernel [E, V]}, embedding [V, E]."""
    E, V, L = c.hidden_size, c.vocab_size, c.num_layers
    grown = mtp_block_config(c, count)
    on = tuple(range(L, L + count)) if layers is None else tuple(layers)
    if not set(on) <= set(range(L, L + count)):
        raise ValueError(f"MTP layers are {L}..{L + count - 1}, not {sorted(set(on) - set(range(L, L + count)))}")
    P = "model.layers.{i}."
    out = []
    for w in layout(grown):
        if not w.per_layer:  # the target's own embedding, final norm and head
            continue
        mine = tuple(i for i in w.indices(grown.num_layers) if i in on)
        if mine:
            out.append(dataclasses.replace(w, paths=tuple(("layer",) + p for p in w.paths), layers=mine))
    own = [_same(("enorm", "scale"), P + "enorm.weight", (E,)), _same(("hnorm", "scale"), P + "hnorm.weight", (E,)),
           _linear(("eh_proj", "kernel"), P + "eh_proj.weight", 2 * E, (E,)),
           _same(("head_norm", "scale"), P + "shared_head.norm.weight", (E,)),
           _linear(("head", "kernel"), P + "shared_head.head.weight", E, (V,))]
    if embedding:
        own.append(_same(("embedding",), P + "embed_tokens.weight", (V, E)))
    return out + [dataclasses.replace(w, layers=on) for w in own]


def expected_tensors(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name the config implies, with its shape."""
    out = {}
    for w in layout(c):
        for i in w.indices(c.num_layers):
            out.update((name.format(i=i), shape) for name, shape in w.hf)
    return out


# ---- params of older specjax ---------------------------------------------------------------
#
# Layout 1: every layer's weights stacked on a leading [L] axis, q, k, v (and gate, up) as
# separate kernels. Layout 2: one dict per layer, qkv_kernel [E, G, R+2, D] and
# gate_up_kernel [E, 2, F] (E first, which TPUs relaid out in every speculative program).
# Training runs and EAGLE drafters saved then hold them; these functions turn them into
# today's (layout 3), exactly (concatenations and transposes only).


def fuse_legacy_layer(layer: dict, c: ModelConfig) -> dict:
    """One layer's params in layout 1 (attn q/k/v_kernel [E, H|G, D] and biases, mlp
    gate/up_kernel [E, F] and biases; numpy) -> today's (qkv_kernel [G, R+2, D, E],
    gate_up_kernel [2, E, F], ...). Everything else passes through."""
    G, R = c.num_kv_heads, c.num_heads // c.num_kv_heads
    attn, mlp = dict(layer["attn"]), dict(layer["mlp"])
    for kind in ("kernel", "bias"):
        if f"q_{kind}" in attn:
            q, k, v = (np.asarray(attn.pop(f"{n}_{kind}")) for n in "qkv")
            q = q.reshape(*q.shape[:-2], G, R, q.shape[-1])
            qkv = np.concatenate([q, k[..., None, :], v[..., None, :]], axis=-2)  # [(E,) G, R+2, D]
            attn[f"qkv_{kind}"] = np.moveaxis(qkv, 0, -1) if kind == "kernel" else qkv
        if f"gate_{kind}" in mlp:
            gate, up = np.asarray(mlp.pop(f"gate_{kind}")), np.asarray(mlp.pop(f"up_{kind}"))
            mlp[f"gate_up_{kind}"] = np.stack([gate, up])
    return {**layer, "attn": attn, "mlp": mlp}


def from_layout2_layer(layer: dict) -> dict:
    """One layer's params in layout 2 (qkv_kernel [E, G, R+2, D], gate_up_kernel [E, 2, F];
    numpy) -> today's ([G, R+2, D, E], [2, E, F]). Everything else passes through."""
    attn, mlp = dict(layer["attn"]), dict(layer["mlp"])
    if "qkv_kernel" in attn:
        attn["qkv_kernel"] = np.moveaxis(np.asarray(attn["qkv_kernel"]), 0, -1)
    if "gate_up_kernel" in mlp:
        mlp["gate_up_kernel"] = np.swapaxes(np.asarray(mlp["gate_up_kernel"]), 0, 1)
    return {**layer, "attn": attn, "mlp": mlp}


def from_legacy(params: dict, c: ModelConfig) -> dict:
    """A whole model's params in layout 1 (layers stacked [L, ...]; numpy) -> today's."""
    import jax

    stacked = params["layers"]
    layers = [fuse_legacy_layer(jax.tree.map(lambda w, i=i: np.asarray(w)[i], stacked), c)
              for i in range(c.num_layers)]
    return {**params, "layers": layers}
