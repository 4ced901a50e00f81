"""int8 weight-only quantisation: symmetric, one float scale per output channel.

A quantised weight is an `Int8` pytree (int8 values and their scales) in the params where
the float array was; the layers dequantise it on the fly inside the jitted pass (see
`dequantize` in models/layers.py), so activations, caches and logits keep the model's
float dtype and nothing else changes: the decoding loop does not know.

What is quantised: every matmul weight (q, k, v, o, the MLP's, latent attention's, an
untied lm_head), each with a scale per output channel, a mixture of experts' expert weights
with a scale per expert per output channel (models/moe.py computes every form with them),
and the embedding, with a scale per row (per token): a lookup then dequantises only the
rows it reads, and for a tied head a row is exactly the head's output channel. Norm
scales, biases, routers (small, and their logits choose experts: kept exact) and GPT-2's
position table stay float: they are a rounding error in size and are not large matmuls.

This module knows parameter names and shapes; it does not know models or files.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

QUANTIZATIONS = ("int8",)

# Parameter name -> the axes its matmul contracts over (the input channels), counted from
# the end. A scale is shared across these axes and differs along every other one, so it
# factors out of the matmul: the layers multiply the matmul's output by it (see
# layers.matmul), and the int8 values go into the matmul as they are.
CONTRACTED: dict[str, tuple[int, ...]] = {
    "qkv_kernel": (-1,),  # [G, R+2, D, E]
    "o_kernel": (-3, -2),  # [H, D, E]
    "gate_up_kernel": (-2,),  # [2, E, F]
    "down_kernel": (-2,),  # [F, E]
    "fc_kernel": (-2,),  # [E, F]
    "proj_kernel": (-2,),  # [F, E]
    "lm_head": (-2,),  # [E, V]
    "embedding": (-1,),  # [V, E]: a scale per token, the tied head's output channel
    # latent attention (models/mla.py)
    "q_kernel": (-3,),  # [E, H, n + p]
    "q_a_kernel": (-2,),  # [E, Q]
    "q_b_kernel": (-3,),  # [Q, H, n + p]
    "kv_a_kernel": (-2,),  # [E, r + p]
    "k_b_kernel": (-2,),  # [H, n, r]: q_nope [n] in, the latent's r out
    "v_b_kernel": (-1,),  # [H, v, r]: the latent [r] in, v out
    # a mixture of experts' (models/moe.py): a scale per expert and output channel, [X, 1, I] / [X, 1, E]
    "experts_gate": (-2,),  # [X, E, I]
    "experts_up": (-2,),  # [X, E, I]
    "experts_down": (-2,),  # [X, I, E]
}


@struct.dataclass
class Int8:
    """A weight w ~= value * scale, symmetric (no zero point), per output channel.

    value: int8, w's shape, in [-127, 127]. scale: float (the model's dtype), w's shape with
    the contracted axes of size 1, so it broadcasts against value and shards like it."""

    value: jax.Array
    scale: jax.Array

    @property
    def shape(self):
        return self.value.shape

    @property
    def ndim(self):
        return self.value.ndim

    @property
    def dtype(self):
        """The dtype it dequantises to."""
        return self.scale.dtype

    def dequantize(self) -> jax.Array:
        return self.value.astype(self.scale.dtype) * self.scale

    def rows(self, index) -> jax.Array:
        """value[index] dequantised: an embedding lookup that reads only the rows it needs."""
        return self.value[index].astype(self.scale.dtype) * self.scale[index]


def quantize_array(w, contracted: tuple[int, ...], dtype) -> Int8:
    """Symmetric int8 with one scale per output channel (the max |w| over `contracted`
    maps to 127). Works on numpy (host) and jax arrays alike; the scale is rounded to
    `dtype` before the values are, so value * scale is the closest the stored pair gets."""
    xp = np if isinstance(w, np.ndarray) else jnp
    w = w.astype(xp.float32)
    amax = xp.max(xp.abs(w), axis=contracted, keepdims=True)
    scale = xp.where(amax > 0, amax / 127.0, 1.0).astype(dtype)
    value = xp.clip(xp.round(w / scale.astype(xp.float32)), -127, 127).astype(xp.int8)
    return Int8(value, scale)


def path_names(path) -> tuple[str, ...]:
    """A pytree path (dict keys, list indices) as strings: ("layers", "3", "attn", "qkv_kernel")."""
    return tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def quantizable(path) -> bool:
    """Whether the parameter at `path` (a tuple of names) is a matmul weight we quantise."""
    return path[-1] in CONTRACTED


def check_method(method: str | None):
    if method is not None and method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantize={method!r}; specjax supports {QUANTIZATIONS} "
                         f"(or None: no quantisation)")


def quantize(model, method: str = "int8"):
    """The model with its matmul weights and embedding in int8 (see the module docstring).
    Scales take the model's float dtype. A model quantises on its own: quantise a target
    and its draft each with this (or load both with `load_model(..., quantize="int8")`)."""
    check_method(method)
    dtype = model.dtype

    def one(path, w):
        names = path_names(path)
        if isinstance(w, Int8) or not quantizable(names):
            return w
        return quantize_array(w, CONTRACTED[names[-1]], dtype)

    params = jax.tree_util.tree_map_with_path(one, model.params, is_leaf=lambda x: isinstance(x, Int8))
    return model.replace(params=params)
