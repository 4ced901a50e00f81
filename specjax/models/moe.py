"""A mixture of experts: the router, and the experts computed over the tokens routed to them.

Every token goes to each of the top_k experts its router chose, none dropped: a speculative
verification must score exactly what plain decoding would, so there is no capacity factor.
Assignments (token, expert) are computed in one of these forms, chosen by the pass's shape
(`choose_form`):

- `sliced`: each assignment multiplies its token by its own expert's weights, each taken by
  a dynamic slice of its own (unrolled: up to SLICED assignments, a decode step or a small
  verification pass), which compilers read in place: the pass reads only the experts it
  routed to (docs/bench/moe_reads.txt measures the bytes a compiled pass moves);
- `gathered`: the same by one gather of the weights ([A, E] x [A, E, I]); each assignment's
  result depends on that assignment alone, which is what models/exact.py needs;
- `grouped`: assignments sorted by expert into tiles of TILE rows, each tile all one
  expert's, padded (a grouped matmul, as megablox's), a loop over the used tiles, each
  reading its expert's weights once; compute is the routed tokens' plus at most a tile per
  expert (XLA's CPU and GPU lower `ragged_dot` densely, every expert times every token);
- `ragged_dot`: the sorted assignments through `jax.lax.ragged_dot`, which a TPU lowers
  to its grouped matmul.

Expert weights are three [X, ...] arrays (`experts_gate`, `experts_up` [X, E, I],
`experts_down` [X, I, E]): gate and up apart, so that a mesh splits I (or X) without
splitting a fused axis. gpt-oss adds what each form takes beside them: biases of each
expert's three projections (`bias`), its clamped activation (`act`: `clamped_swiglu`),
and a router with a bias whose top k logits are softmaxed (`route`).

Each of the three may be int8 (quant.py's `Int8`: values [X, ...] and a scale per expert per
output channel, [X, 1, I] or [X, 1, E]). Every form then reads the int8 values of the experts
it routes to and converts them inside its matmuls, and applies the scales to those matmuls'
outputs, each row by its own expert's (`_take` picks an expert's values and scales alike;
`_ragged` scales ragged_dot's sorted rows); no form writes a dequantised copy of the experts.

On a mesh (`split_experts_out`) each device holds a share of the experts (X / n over the
`expert` axis, or over `model` where the mesh has none) and of each one's width, computes
its rows' assignments to its own experts by hand in a manual shard_map, and the shares are
summed: one all-reduce of the rows' activations a layer, no weight moved.

It knows nothing of caches, attention or checkpoints, and of the program only the platform
and mesh its caller passes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from specjax.config import ModelConfig
from specjax.models.layers import MLP, init, matmul
from specjax.quant import Int8

TILE = 8  # rows of a grouped tile: compute wasted is < one tile per expert used
SLICED = 16  # at most this many assignments a pass are computed `sliced` (unrolled)
FORMS = ("gathered", "sliced", "grouped", "ragged_dot")


def route(c: ModelConfig, logits, bias=None):
    """Router logits float32 [N, X] -> (weights float32 [N, k], experts int32 [N, k]):
    Moe.router's "softmax" (over all X, the top k kept, renormalised where norm_topk says),
    "topk_softmax" (gpt-oss: the k largest logits, then a softmax over those k) or
    "sigmoid_grouped" (DeepSeek-V3, GLM-4.5; bias: its per-expert bias [X], which only chooses)."""
    m = c.moe
    if m.router == "sigmoid_grouped":
        return _route_grouped(m, logits, bias)
    if m.router == "topk_softmax":
        top, experts = jax.lax.top_k(logits.astype(jnp.float32), m.top_k)
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, m.top_k)
    if m.norm_topk:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _route_grouped(m, logits, bias):
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter, GLM-4.5's Glm4MoeTopkRouter): sigmoid scores; experts
    chosen by score + bias within the top_groups groups whose two best biased scores sum
    highest; weighted by their unbiased scores, renormalised where norm_topk, times
    routed_scale."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))  # [N, X]
    choice = scores + bias.astype(jnp.float32)
    N, X = choice.shape
    grouped = choice.reshape(N, m.groups, X // m.groups)
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, groups]
    kept = jax.nn.one_hot(jax.lax.top_k(group_scores, m.top_groups)[1], m.groups, dtype=bool).any(1)  # [N, groups]
    choice = jnp.where(jnp.repeat(kept, X // m.groups, axis=1), choice, -jnp.inf)
    experts = jax.lax.top_k(choice, m.top_k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if m.norm_topk:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * m.routed_scale, experts.astype(jnp.int32)


def choose_form(platform: str, assignments: int) -> str:
    """How a pass of `assignments` (token, expert) pairs computes them (see the module
    docstring): sliced up to SLICED of them, else grouped (ragged_dot on a TPU)."""
    if assignments <= SLICED:
        return "sliced"
    return "ragged_dot" if platform == "tpu" else "grouped"


def differentiable_form(platform: str) -> str:
    """A form reverse-mode differentiation runs through, for training: ragged_dot on a TPU
    (its grouped matmul), gathered elsewhere (`grouped` loops over a count of tiles known
    only at run time, which jax.grad refuses)."""
    return "ragged_dot" if platform == "tpu" else "gathered"


def swiglu(gate, up):
    return jax.nn.silu(gate) * up


def clamped_swiglu(gate, up, limit: float, alpha: float):
    """gpt-oss's activation (transformers' GptOssExperts._apply_gate): gate clamped above at
    limit, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def activation(c: ModelConfig):
    """The experts' activation (gate, up) -> [.., I]: SwiGLU, or gpt-oss's clamped one where
    Moe.swiglu_limit is set."""
    m = c.moe
    return swiglu if m.swiglu_limit is None else functools.partial(
        clamped_swiglu, limit=m.swiglu_limit, alpha=m.swiglu_alpha)


def _take(w, e):
    """Expert(s) e of expert weights w [X, ...], float or int8 (an Int8's values and scales
    alike): w[e]."""
    return jax.tree.map(lambda a: a[e], w)


def _ragged(xs, w, sizes, e):
    """jax.lax.ragged_dot(xs [A, K], w [X, K, N], sizes) for a float or int8 w: an int8 w's
    values go into the product as they are (a converted copy of every expert, written each
    pass, was what a TPU program of int8 experts moved most: `specjax plan`), its scales
    [X, 1, N] applied to each sorted row's output by that row's expert e int32 [A] (rows of
    no group: any, their output dropped)."""
    if not isinstance(w, Int8):
        return jax.lax.ragged_dot(xs, w, sizes)
    out = jax.lax.ragged_dot(xs, w.value, sizes, preferred_element_type=xs.dtype)
    return out * w.scale[e, 0].astype(out.dtype)


def gathered(x, experts, gate, up, down, bias=None, act=swiglu):
    """x [A, E] (each assignment's token), experts int32 [A] (its expert, in [0, X); one
    outside: a zero result) -> [A, E], each row by its own expert's weights (float or int8).
    bias: None, or the experts' (gate [X, I], up [X, I], down [X, E]) biases; act: the
    activation."""
    X = gate.shape[0]
    held = (experts >= 0) & (experts < X)
    e = jnp.where(held, experts, 0)
    y = _ffn(x, _take(gate, e), _take(up, e), _take(down, e), None if bias is None else [b[e] for b in bias], act,
             per_row=True)
    return jnp.where(held[:, None], y, 0)


def _ffn(x, gate, up, down, bias, act, per_row: bool = False):
    """One expert's MLP of rows x [..., E] with its weights taken (gate, up [E, I], down
    [I, E], float or int8; per_row: each row its own, [A, E, I] and [A, I, E] for x [A, E])
    and its biases taken alike (gate's, up's, down's; or None) -> [..., E]."""
    into, out = ("ae,aei->ai", "ai,aie->ae") if per_row else ("...e,ei->...i", "...i,ie->...e")
    g, u = matmul(into, x, gate), matmul(into, x, up)
    if bias is not None:
        g, u = g + bias[0], u + bias[1]
    y = matmul(out, act(g, u), down)
    return y if bias is None else y + bias[2]


def sliced(x, experts, gate, up, down, bias=None, act=swiglu, some_elsewhere: bool = False):
    """`gathered`'s result with each assignment's expert weights taken by a dynamic slice
    of its own (an unrolled loop: few assignments only), which every compiler reads in place.
    bias, act: as `gathered` takes them. some_elsewhere: some experts lie on other devices
    (`split_experts_out`): an assignment to one of them is skipped by a branch, reading
    nothing, rather than computed on a stand-in expert and dropped."""
    X = gate.shape[0] if not isinstance(gate, Int8) else gate.value.shape[0]
    held = (experts >= 0) & (experts < X)
    e = jnp.where(held, experts, 0)
    out = []
    for a in range(x.shape[0]):
        def one(a=a):
            take = lambda w: jax.tree.map(  # noqa: E731  (an Int8's values and scales alike)
                lambda v: jax.lax.dynamic_index_in_dim(v, e[a], keepdims=False), w)
            return _ffn(x[a], take(gate), take(up), take(down), None if bias is None else [take(b) for b in bias], act)

        out.append(jax.lax.cond(held[a], one, lambda: jnp.zeros_like(x[a])) if some_elsewhere else one())
    return jnp.where(held[:, None], jnp.stack(out), 0)


def _sorted(experts, X: int):
    """The assignments sorted by expert: (order [A] (sorted position -> assignment), sizes
    int32 [X] (assignments per expert; those of experts outside [0, X) are left out, sorted
    last))."""
    key = jnp.where((experts >= 0) & (experts < X), experts, X)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=X + 1)[:X].astype(jnp.int32)
    return order, sizes


def grouped(x, experts, gate, up, down, ragged: bool = False, bias=None, act=swiglu):
    """`gathered`'s result by a grouped matmul: x [A, E], experts int32 [A] -> [A, E].
    ragged: by `jax.lax.ragged_dot` (a TPU's); else by a loop over tiles of TILE rows.
    bias, act: as `gathered` takes them."""
    A, E = x.shape
    X = gate.shape[0]
    order, sizes = _sorted(experts, X)
    xs = x[order]  # [A, E] in expert order
    if ragged:
        e = jnp.minimum(experts[order], X - 1)  # each sorted row's expert (rows of none: any, dropped below)
        e = jnp.where(experts[order] < 0, 0, e)
        g = _ragged(xs, gate, sizes, e)
        u = _ragged(xs, up, sizes, e)
        if bias is not None:
            g, u = g + bias[0][e], u + bias[1][e]
        ys = _ragged(act(g, u), down, sizes, e)  # [A, E]; rows past sum(sizes): 0
        if bias is not None:
            ys = ys + bias[2][e]
    else:
        ys = _tiled(xs, sizes, gate, up, down, bias, act)
    held = (experts >= 0) & (experts < X)
    return jnp.zeros_like(x).at[order].set(ys) * held[:, None].astype(x.dtype)


def _tiled(xs, sizes, gate, up, down, bias=None, act=swiglu):
    """xs [A, E] sorted by expert, sizes int32 [X] -> [A, E]: each expert's rows padded to
    whole tiles, and a loop over the tiles used, each one matmul per weight of its expert
    (bias, act: as `gathered` takes them)."""
    A, E = xs.shape
    X = gate.shape[0]
    m = TILE
    tiles = -(-sizes // m)  # [X] tiles per expert
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    row_start = jnp.cumsum(sizes) - sizes  # [X] first sorted row of each expert
    n = -(-A // m) + min(A, X)  # tiles at most (static): each used expert pads less than one
    j = jnp.arange(A, dtype=jnp.int32)
    expert_of = jnp.minimum(_count_at_most(jnp.cumsum(sizes), j), X - 1)  # [A]
    padded = tile_start[expert_of] * m + j - row_start[expert_of]  # [A]: row in the tiled buffer
    valid = j < sizes.sum()
    padded = jnp.where(valid, padded, n * m)  # rows of no held expert: dropped
    buf = jnp.zeros((n * m, E), xs.dtype).at[padded].set(xs, mode="drop")
    tile_expert = jnp.minimum(_count_at_most(tile_end, jnp.arange(n, dtype=jnp.int32)), X - 1)  # [n]

    def body(t, out):
        e = tile_expert[t]
        rows = jax.lax.dynamic_slice_in_dim(buf, t * m, m)  # [m, E]
        y = _ffn(rows, _take(gate, e), _take(up, e), _take(down, e), None if bias is None else [b[e] for b in bias],
                 act)
        return jax.lax.dynamic_update_slice_in_dim(out, y, t * m, 0)

    out = jax.lax.fori_loop(0, tile_end[-1], body, jnp.zeros_like(buf))
    return jnp.where(valid[:, None], out[jnp.minimum(padded, n * m - 1)], 0)


def _count_at_most(ends, j):
    """searchsorted(ends, j, side="right") for sorted ends [X] and j [M], as a comparison
    count (jnp.searchsorted fails inside shard_map in jax 0.10)."""
    return (ends[None, :] <= j[:, None]).sum(-1).astype(jnp.int32)


def experts_out(x, weights, experts, gate, up, down, form: str, first=0, out_dtype=None, bias=None, act=swiglu,
                some_elsewhere: bool = False):
    """The routed experts' weighted sum: x [N, E], weights float32 [N, k], experts int32
    [N, k] -> [N, E] (in out_dtype, default x's). first: the index of the first expert this
    device holds (gate etc. are its experts [X', ...]); assignments to experts it does not
    hold add nothing here (some_elsewhere: there are such experts, `sliced` skips theirs).
    bias, act: as `gathered` takes them (the device's experts' biases)."""
    N, k = experts.shape
    local = (experts - first).reshape(N * k)
    rows = jnp.repeat(x, k, axis=0)  # [N k, E]
    if form == "gathered":
        y = gathered(rows, local, gate, up, down, bias, act)
    elif form == "sliced":
        y = sliced(rows, local, gate, up, down, bias, act, some_elsewhere)
    elif form in ("grouped", "ragged_dot"):
        y = grouped(rows, local, gate, up, down, form == "ragged_dot", bias, act)
    else:
        raise ValueError(f"unknown expert form {form!r}; one of {FORMS}")
    y = y.reshape(N, k, -1).astype(jnp.float32) * weights[..., None]
    return y.sum(1).astype(out_dtype or x.dtype)


def split_experts_out(x, weights, experts, gate, up, down, form: str, mesh, bias=None, act=swiglu, rules=None):
    """`experts_out` on a mesh, each device computing by hand (a fully manual shard_map, so
    that no collective of XLA's choosing lands inside the grouped form's loop, whose trip
    count differs between devices): its rows (over `data`), its experts and its slice of
    each expert's width, as the weights lie by `rules` (the model's; default
    sharding.DEFAULT_RULES: experts over `expert`, else over `model`; the width over `model`
    where the experts do not take it). `first` is a device's first expert; the float32
    shares are summed over the axes the experts and width split, one all-reduce of its rows
    [N', E] a layer. No weight moves. bias, act: as `gathered` takes them (the down
    projection's bias is added by the first device of the width's axis only). An int8
    weight's scales [X, 1, I] ([X, 1, E]) are split as its values are, so that each device
    holds the scales of the experts and width it holds (`sharding.scale_spec`)."""
    from jax.sharding import PartitionSpec as P

    from specjax import sharding
    from specjax.sharding import DATA, scale_spec

    N = x.shape[0]
    value = lambda w: w.value if isinstance(w, Int8) else w  # noqa: E731
    laid = sharding.spec(value(gate).shape, sharding.LOGICAL_AXES["experts_gate"], mesh,
                         rules or sharding.DEFAULT_RULES)
    held, width = laid[0], laid[2]  # the mesh axes (or None) the experts and their width lie over
    rows = P(DATA if mesh.shape.get(DATA, 1) > 1 and N % mesh.shape[DATA] == 0 else None)
    summed = tuple(a for a in (held, width) if a is not None)

    def local(x, weights, experts, gate, up, down, *bias):
        first = 0 if held is None else jax.lax.axis_index(held) * value(gate).shape[0]
        if bias and width is not None:  # the width's shares sum: one of them adds down's bias
            bias = bias[:2] + (bias[2] * (jax.lax.axis_index(width) == 0).astype(bias[2].dtype),)
        share = experts_out(x, weights, experts, gate, up, down, form, first, jnp.float32, bias or None, act,
                            some_elsewhere=held is not None)
        return jax.lax.psum(share, summed) if summed else share

    def weight(w, spec):  # an Int8's values as the weight, its scales alike
        return Int8(spec, scale_spec(spec, w.scale.shape)) if isinstance(w, Int8) else spec

    specs = (rows, rows, rows, weight(gate, P(held, None, width)), weight(up, P(held, None, width)),
             weight(down, P(held, width, None)))
    if bias is not None:
        specs += (P(held, width), P(held, width), P(held, None))
    out = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=rows, check_vma=False)(
        x, weights, experts, gate, up, down, *(bias or ()))
    return out.astype(x.dtype)


class MoE(nn.Module):
    """The experts' MLP of a sparse layer: [B, T, E] -> [B, T, E]. Params: `router` [E, X]
    (and DeepSeek-V3's and GLM-4.5's `router_bias` [X]: `Moe.router`),
    `experts_gate`, `experts_up` [X, E, I], `experts_down` [X, I, E]; with a shared expert a
    dense MLP `shared` (I_s wide) and, gated, `shared_gate` [E]; gpt-oss's `router_bias` [X]
    (Moe.router_bias) and the experts' `experts_gate_bias`, `experts_up_bias` [X, I],
    `experts_down_bias` [X, E] (Moe.expert_bias)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x, form: str | None = None, platform: str = "cpu", mesh=None, rules=None):
        """form: one of FORMS, or None: `choose_form` for the pass's shape on `platform`.
        mesh: the program's, whose `expert` axis (if any, and > 1) splits the experts."""
        c = self.config
        m = c.moe
        E, X, I = c.hidden_size, m.num_experts, m.expert_size
        B, T, _ = x.shape
        rows = x.reshape(B * T, E)
        router = self.param("router", init, (E, X))
        bias = None
        if m.router == "sigmoid_grouped":  # in float32, as transformers keeps it
            logits = matmul("ne,ex->nx", rows.astype(jnp.float32), router.astype(jnp.float32))
            bias = self.param("router_bias", nn.initializers.zeros, (X,))
        else:
            logits = matmul("ne,ex->nx", rows, router)
            if m.router_bias:
                logits = logits + self.param("router_bias", nn.initializers.zeros, (X,))
        weights, chosen = route(c, logits, bias)
        gate = self.param("experts_gate", init, (X, E, I))
        up = self.param("experts_up", init, (X, E, I))
        down = self.param("experts_down", init, (X, I, E))
        biases = None if not m.expert_bias else tuple(
            self.param(f"experts_{name}_bias", nn.initializers.zeros, shape)
            for name, shape in (("gate", (X, I)), ("up", (X, I)), ("down", (X, E))))
        form = form or choose_form(platform, B * T * m.top_k)
        if mesh is not None and mesh.size > 1:
            out = split_experts_out(rows, weights, chosen, gate, up, down, form, mesh, biases, activation(c), rules)
        else:
            out = experts_out(rows, weights, chosen, gate, up, down, form, bias=biases, act=activation(c))
        out = out.reshape(B, T, E)
        if m.shared_size:
            shared = MLP(c, width=m.shared_size, name="shared")(x)
            if m.shared_gate:
                w = self.param("shared_gate", init, (E,))
                shared = shared * jax.nn.sigmoid(matmul("bte,e->bt", x, w))[..., None]
            out = out + shared
        return out
