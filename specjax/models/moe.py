"""A mixture of experts: the router, and the experts computed over the tokens routed to them.

Every token goes to each of the top_k experts its router chose, none dropped: a speculative
verification must score exactly what plain decoding would, so there is no capacity factor.
Assignments (token, expert) are computed in one of two forms, chosen by the pass's shape:

- `gathered`: each assignment multiplies its token by its own expert's weights, taken by
  index ([A, E] x [A, E, I]): a pass of few tokens (a decode step, a verification pass at a
  small batch) reads only the experts it routed to, and each assignment's result depends
  on that assignment alone (models/exact.py computes MoE layers this way);
- `grouped`: assignments sorted by expert into tiles of TILE rows, each tile all one
  expert's, padded (a grouped matmul, as megablox's): `jax.lax.ragged_dot` on a TPU, which
  lowers it natively; elsewhere a loop over the used tiles, each reading its expert's
  weights once (XLA's CPU and GPU lower `ragged_dot` densely, every expert times every
  token). Compute is the routed tokens' plus at most a tile per expert.

Expert weights are three [X, ...] arrays (`experts_gate`, `experts_up` [X, E, I],
`experts_down` [X, I, E]): gate and up apart, so that a mesh splits I (or X) without
splitting a fused axis. gpt-oss adds what each form takes beside them: biases of each
expert's three projections (`bias`), its clamped activation (`act`: `clamped_swiglu`),
and a router with a bias whose top k logits are softmaxed (`route`).

With an `expert` mesh axis each device holds X / n experts and computes its own experts'
assignments, summed over the axis (models/transformer.py builds that program; this module
computes one device's share given which experts it holds).

It knows nothing of caches, attention, checkpoints or which platform runs it beyond the
form its caller asks for.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from specjax.config import ModelConfig
from specjax.models.layers import MLP, init, matmul

TILE = 8  # rows of a grouped tile: compute wasted is < one tile per expert used
FORMS = ("gathered", "grouped", "ragged_dot")


def route(c: ModelConfig, logits):
    """Router logits float32 [N, X] -> (weights float32 [N, k], experts int32 [N, k]):
    Moe.router's "softmax" (over all X, the top k kept, renormalised where norm_topk says) or
    "topk_softmax" (gpt-oss: the k largest logits, then a softmax over those k)."""
    m = c.moe
    if m.router == "topk_softmax":
        top, experts = jax.lax.top_k(logits.astype(jnp.float32), m.top_k)
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, m.top_k)
    if m.norm_topk:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def choose_form(platform: str, assignments: int, num_experts: int) -> str:
    """How a pass of `assignments` (token, expert) pairs computes them (see the module
    docstring): gathered when there are no more than a quarter as many as experts, grouped
    otherwise (ragged_dot on a TPU)."""
    if 4 * assignments <= num_experts:
        return "gathered"
    return "ragged_dot" if platform == "tpu" else "grouped"


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


def gathered(x, experts, gate, up, down, bias=None, act=swiglu):
    """x [A, E] (each assignment's token), experts int32 [A] (its expert, in [0, X); one
    outside: a zero result) -> [A, E], each row by its own expert's weights. bias: None, or
    the experts' (gate [X, I], up [X, I], down [X, E]) biases; act: the activation."""
    X = gate.shape[0]
    held = (experts >= 0) & (experts < X)
    e = jnp.where(held, experts, 0)
    g = jnp.einsum("ae,aei->ai", x, gate[e])
    u = jnp.einsum("ae,aei->ai", x, up[e])
    if bias is not None:
        g, u = g + bias[0][e], u + bias[1][e]
    y = jnp.einsum("ai,aie->ae", act(g, u), down[e])
    if bias is not None:
        y = y + bias[2][e]
    return jnp.where(held[:, None], y, 0)


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
        g = jax.lax.ragged_dot(xs, gate, sizes)
        u = jax.lax.ragged_dot(xs, up, sizes)
        if bias is not None:  # each sorted row's expert's (rows of none: any, dropped below)
            e = jnp.minimum(experts[order], X - 1)
            e = jnp.where(experts[order] < 0, 0, e)
            g, u = g + bias[0][e], u + bias[1][e]
        ys = jax.lax.ragged_dot(act(g, u), down, sizes)  # [A, E]; rows past sum(sizes): 0
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
    expert_of = jnp.clip(jnp.searchsorted(jnp.cumsum(sizes), j, side="right"), 0, X - 1)  # [A]
    padded = tile_start[expert_of] * m + j - row_start[expert_of]  # [A]: row in the tiled buffer
    valid = j < sizes.sum()
    padded = jnp.where(valid, padded, n * m)  # rows of no held expert: dropped
    buf = jnp.zeros((n * m, E), xs.dtype).at[padded].set(xs, mode="drop")
    tile_expert = jnp.clip(jnp.searchsorted(tile_end, jnp.arange(n), side="right"), 0, X - 1)  # [n]

    def body(t, out):
        e = tile_expert[t]
        rows = jax.lax.dynamic_slice_in_dim(buf, t * m, m)  # [m, E]
        g = matmul("me,ei->mi", rows, gate[e])
        u = matmul("me,ei->mi", rows, up[e])
        if bias is not None:
            g, u = g + bias[0][e], u + bias[1][e]
        y = matmul("mi,ie->me", act(g, u), down[e])
        if bias is not None:
            y = y + bias[2][e]
        return jax.lax.dynamic_update_slice_in_dim(out, y, t * m, 0)

    out = jax.lax.fori_loop(0, tile_end[-1], body, jnp.zeros_like(buf))
    return jnp.where(valid[:, None], out[jnp.minimum(padded, n * m - 1)], 0)


def experts_out(x, weights, experts, gate, up, down, form: str, first: int = 0, bias=None, act=swiglu):
    """The routed experts' weighted sum: x [N, E], weights float32 [N, k], experts int32
    [N, k] -> [N, E]. first: the index of the first expert this device holds (gate etc. are
    its experts [X', ...]); assignments to experts it does not hold add nothing here.
    bias, act: as `gathered` takes them (the device's experts' biases)."""
    N, k = experts.shape
    local = (experts - first).reshape(N * k)
    rows = jnp.repeat(x, k, axis=0)  # [N k, E]
    if form == "gathered":
        y = gathered(rows, local, gate, up, down, bias, act)
    elif form in ("grouped", "ragged_dot"):
        y = grouped(rows, local, gate, up, down, form == "ragged_dot", bias, act)
    else:
        raise ValueError(f"unknown expert form {form!r}; one of {FORMS}")
    y = y.reshape(N, k, -1).astype(jnp.float32) * weights[..., None]
    return y.sum(1).astype(x.dtype)


class MoE(nn.Module):
    """The experts' MLP of a sparse layer: [B, T, E] -> [B, T, E]. Params: `router` [E, X],
    `experts_gate`, `experts_up` [X, E, I], `experts_down` [X, I, E]; with a shared expert a
    dense MLP `shared` (I_s wide) and, gated, `shared_gate` [E]; gpt-oss's `router_bias` [X]
    (Moe.router_bias) and the experts' `experts_gate_bias`, `experts_up_bias` [X, I],
    `experts_down_bias` [X, E] (Moe.expert_bias)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x, form: str | None = None, platform: str = "cpu"):
        """form: one of FORMS, or None: `choose_form` for the pass's shape on `platform`."""
        c = self.config
        m = c.moe
        E, X, I = c.hidden_size, m.num_experts, m.expert_size
        B, T, _ = x.shape
        rows = x.reshape(B * T, E)
        logits = matmul("ne,ex->nx", rows, self.param("router", init, (E, X)))
        if m.router_bias:
            logits = logits + self.param("router_bias", nn.initializers.zeros, (X,))
        weights, chosen = route(c, logits)
        gate = self.param("experts_gate", init, (X, E, I))
        up = self.param("experts_up", init, (X, E, I))
        down = self.param("experts_down", init, (X, I, E))
        bias = None if not m.expert_bias else tuple(
            self.param(f"experts_{name}_bias", nn.initializers.zeros, shape)
            for name, shape in (("gate", (X, I)), ("up", (X, I)), ("down", (X, E))))
        out = experts_out(rows, weights, chosen, gate, up, down, form or choose_form(platform, B * T * m.top_k, X),
                          bias=bias, act=activation(c))
        out = out.reshape(B, T, E)
        if m.shared_size:
            shared = MLP(c, width=m.shared_size, name="shared")(x)
            if m.shared_gate:
                w = self.param("shared_gate", init, (E,))
                shared = shared * jax.nn.sigmoid(matmul("bte,e->bt", x, w))[..., None]
            out = out + shared
        return out
