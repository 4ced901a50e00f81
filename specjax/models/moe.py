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
splitting a fused axis. With an `expert` mesh axis each device holds X / n experts and
computes its own experts' assignments, summed over the axis (models/transformer.py builds
that program; this module computes one device's share given which experts it holds).

It knows nothing of caches, attention, checkpoints or which platform runs it beyond the
form its caller asks for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from specjax.config import ModelConfig
from specjax.models.layers import MLP, init, matmul

TILE = 8  # rows of a grouped tile: compute wasted is < one tile per expert used
FORMS = ("gathered", "grouped", "ragged_dot")


def route(c: ModelConfig, logits, bias=None):
    """Router logits float32 [N, X] -> (weights float32 [N, k], experts int32 [N, k]).
    bias: the sigmoid_grouped router's per-expert bias [X] (`Moe.router`)."""
    m = c.moe
    if m.router == "sigmoid_grouped":
        return _route_grouped(m, logits, bias)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, m.top_k)
    if m.norm_topk:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _route_grouped(m, logits, bias):
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter): sigmoid scores; experts
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


def choose_form(platform: str, assignments: int, num_experts: int) -> str:
    """How a pass of `assignments` (token, expert) pairs computes them (see the module
    docstring): gathered when there are no more than a quarter as many as experts, grouped
    otherwise (ragged_dot on a TPU)."""
    if 4 * assignments <= num_experts:
        return "gathered"
    return "ragged_dot" if platform == "tpu" else "grouped"


def swiglu(gate, up):
    return jax.nn.silu(gate) * up


def gathered(x, experts, gate, up, down):
    """x [A, E] (each assignment's token), experts int32 [A] (its expert, in [0, X); one
    outside: a zero result) -> [A, E], each row by its own expert's weights."""
    X = gate.shape[0]
    held = (experts >= 0) & (experts < X)
    e = jnp.where(held, experts, 0)
    g = jnp.einsum("ae,aei->ai", x, gate[e])
    u = jnp.einsum("ae,aei->ai", x, up[e])
    y = jnp.einsum("ai,aie->ae", swiglu(g, u), down[e])
    return jnp.where(held[:, None], y, 0)


def _sorted(experts, X: int):
    """The assignments sorted by expert: (order [A] (sorted position -> assignment), sizes
    int32 [X] (assignments per expert; those of experts outside [0, X) are left out, sorted
    last))."""
    key = jnp.where((experts >= 0) & (experts < X), experts, X)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=X + 1)[:X].astype(jnp.int32)
    return order, sizes


def grouped(x, experts, gate, up, down, ragged: bool = False):
    """`gathered`'s result by a grouped matmul: x [A, E], experts int32 [A] -> [A, E].
    ragged: by `jax.lax.ragged_dot` (a TPU's); else by a loop over tiles of TILE rows."""
    A, E = x.shape
    X = gate.shape[0]
    order, sizes = _sorted(experts, X)
    xs = x[order]  # [A, E] in expert order
    if ragged:
        g = jax.lax.ragged_dot(xs, gate, sizes)
        u = jax.lax.ragged_dot(xs, up, sizes)
        ys = jax.lax.ragged_dot(swiglu(g, u), down, sizes)  # [A, E]; rows past sum(sizes): 0
    else:
        ys = _tiled(xs, sizes, gate, up, down)
    held = (experts >= 0) & (experts < X)
    return jnp.zeros_like(x).at[order].set(ys) * held[:, None].astype(x.dtype)


def _tiled(xs, sizes, gate, up, down):
    """xs [A, E] sorted by expert, sizes int32 [X] -> [A, E]: each expert's rows padded to
    whole tiles, and a loop over the tiles used, each one matmul per weight of its expert."""
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
        y = matmul("mi,ie->me", swiglu(g, u), down[e])
        return jax.lax.dynamic_update_slice_in_dim(out, y, t * m, 0)

    out = jax.lax.fori_loop(0, tile_end[-1], body, jnp.zeros_like(buf))
    return jnp.where(valid[:, None], out[jnp.minimum(padded, n * m - 1)], 0)


def experts_out(x, weights, experts, gate, up, down, form: str, first: int = 0):
    """The routed experts' weighted sum: x [N, E], weights float32 [N, k], experts int32
    [N, k] -> [N, E]. first: the index of the first expert this device holds (gate etc. are
    its experts [X', ...]); assignments to experts it does not hold add nothing here."""
    N, k = experts.shape
    local = (experts - first).reshape(N * k)
    rows = jnp.repeat(x, k, axis=0)  # [N k, E]
    if form == "gathered":
        y = gathered(rows, local, gate, up, down)
    elif form in ("grouped", "ragged_dot"):
        y = grouped(rows, local, gate, up, down, ragged=form == "ragged_dot")
    else:
        raise ValueError(f"unknown expert form {form!r}; one of {FORMS}")
    y = y.reshape(N, k, -1).astype(jnp.float32) * weights[..., None]
    return y.sum(1).astype(x.dtype)


class MoE(nn.Module):
    """The experts' MLP of a sparse layer: [B, T, E] -> [B, T, E]. Params: `router` [E, X]
    (and DeepSeek-V3's `router_bias` [X]: `Moe.router`),
    `experts_gate`, `experts_up` [X, E, I], `experts_down` [X, I, E]; with a shared expert a
    dense MLP `shared` (I_s wide) and, gated, `shared_gate` [E]."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x, form: str | None = None, platform: str = "cpu"):
        """form: one of FORMS, or None: `choose_form` for the pass's shape on `platform`."""
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
        weights, chosen = route(c, logits, bias)
        gate = self.param("experts_gate", init, (X, E, I))
        up = self.param("experts_up", init, (X, E, I))
        down = self.param("experts_down", init, (X, I, E))
        out = experts_out(rows, weights, chosen, gate, up, down, form or choose_form(platform, B * T * m.top_k, X))
        out = out.reshape(B, T, E)
        if m.shared_size:
            shared = MLP(c, width=m.shared_size, name="shared")(x)
            if m.shared_gate:
                w = self.param("shared_gate", init, (E,))
                shared = shared * jax.nn.sigmoid(matmul("bte,e->bt", x, w))[..., None]
            out = out + shared
        return out
