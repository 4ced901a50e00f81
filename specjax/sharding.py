"""Meshes, logical axes and shardings: tensor parallel over `model`, batch over `data`.

Every weight and cache dimension has a logical name (LOGICAL_AXES below); one rules table
maps logical names to mesh axes (Megatron-style: heads, kv heads, MLP width and vocabulary
over `model`; batch over `data`), and users may pass their own. A dimension that does not
divide its mesh axis is not sharded on it; a weight that then has no `model` dimension
left falls back to its head_dim or embed dimension, so that weights are always split and
never gathered whole. GSPMD keeps the arithmetic exact whatever the layout.

This module knows shapes and names; it does not know what the models compute.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from specjax.cache import KVCache

DATA, MODEL = "data", "model"

# Logical axes of each parameter by its name; per-layer weights get a leading "layers".
LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "embedding": ("vocab", "embed"),
    "pos_embedding": ("positions", "embed"),
    "lm_head": ("embed", "vocab"),
    "scale": ("embed",),  # norms
    "bias": ("embed",),
    "q_kernel": ("embed", "heads", "head_dim"),
    "k_kernel": ("embed", "kv_heads", "head_dim"),
    "v_kernel": ("embed", "kv_heads", "head_dim"),
    "o_kernel": ("heads", "head_dim", "embed"),
    "q_bias": ("heads", "head_dim"),
    "k_bias": ("kv_heads", "head_dim"),
    "v_bias": ("kv_heads", "head_dim"),
    "o_bias": ("embed",),
    "gate_kernel": ("embed", "mlp"),
    "up_kernel": ("embed", "mlp"),
    "fc_kernel": ("embed", "mlp"),
    "down_kernel": ("mlp", "embed"),
    "proj_kernel": ("mlp", "embed"),
    "gate_bias": ("mlp",),
    "up_bias": ("mlp",),
    "fc_bias": ("mlp",),
    "down_bias": ("embed",),
    "proj_bias": ("embed",),
}
CACHE_AXES = KVCache(k=("layers", "batch", "cache_seq", "kv_heads", "head_dim"),
                     v=("layers", "batch", "cache_seq", "kv_heads", "head_dim"),
                     lengths=("batch",))

DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    ("batch", DATA), ("heads", MODEL), ("kv_heads", MODEL), ("mlp", MODEL), ("vocab", MODEL))
# Where a tensor's `model` sharding goes when its preferred dimension does not divide.
MODEL_FALLBACK = ("head_dim", "embed")


def make_mesh(data: int | None = None, model: int | None = None, devices: Sequence | None = None) -> Mesh:
    """A (data, model) mesh over all devices (or those given) with automatic sharding
    propagation. Defaults: model=1, data=the rest."""
    devices = list(jax.devices() if devices is None else devices)
    model = model or 1
    data = data or len(devices) // model
    if data * model != len(devices):
        raise ValueError(f"mesh data={data} x model={model} needs {data * model} devices; "
                         f"there are {len(devices)}")
    grid = np.array(devices).reshape(data, model)
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def spec(shape: Sequence[int], logical: Sequence[str], mesh: Mesh,
         rules: Sequence[tuple[str, str]] = DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec for one array: each logical axis on its mesh axis where it divides."""
    if len(shape) != len(logical):
        raise ValueError(f"shape {tuple(shape)} has {len(shape)} dims but logical axes {logical}")
    table = dict(rules)
    out: list[str | None] = [None] * len(shape)
    used = set()
    for i, (size, name) in enumerate(zip(shape, logical)):
        axis = table.get(name)
        if axis in mesh.shape and axis not in used and size % mesh.shape[axis] == 0:
            out[i] = axis
            used.add(axis)
    wants_model = any(table.get(name) == MODEL for name in logical)
    if wants_model and MODEL not in used and mesh.shape.get(MODEL, 1) > 1:
        for fallback in MODEL_FALLBACK:
            if fallback in logical:
                i = list(logical).index(fallback)
                if out[i] is None and shape[i] % mesh.shape[MODEL] == 0:
                    out[i] = MODEL
                    break
    return PartitionSpec(*out)


def logical_axes(path: Sequence[str], ndim: int) -> tuple[str, ...]:
    """The logical axes of the parameter at `path` (e.g. ("layers", "attn", "q_kernel"))."""
    name = path[-1]
    if name not in LOGICAL_AXES:
        raise ValueError(f"parameter {'/'.join(path)} has no logical axes; add it to "
                         f"specjax.sharding.LOGICAL_AXES")
    axes = (("layers",) if path[0] == "layers" else ()) + LOGICAL_AXES[name]
    if len(axes) != ndim:
        raise ValueError(f"parameter {'/'.join(path)} has {ndim} dims but logical axes {axes}")
    return axes


def param_logical_axes(params: Mapping) -> Any:
    """The logical axes of every parameter, as a pytree shaped like params."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: logical_axes([str(k.key) for k in path], np.ndim(leaf)), params)


def param_shardings(params: Mapping, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
    logical = param_logical_axes(params)
    return jax.tree.map(lambda p, ax: NamedSharding(mesh, spec(np.shape(p), ax, mesh, rules)),
                        params, logical, is_leaf=lambda x: isinstance(x, tuple))


def cache_shardings(cache: KVCache, mesh: Mesh, rules=DEFAULT_RULES) -> KVCache:
    return jax.tree.map(lambda a, ax: NamedSharding(mesh, spec(a.shape, ax, mesh, rules)),
                        cache, CACHE_AXES, is_leaf=lambda x: isinstance(x, tuple))


def batch_sharding(shape: Sequence[int], mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
    """Rows over `data` (when they divide it); every other dimension replicated."""
    return NamedSharding(mesh, spec(shape, ("batch",) + (None,) * (len(shape) - 1), mesh, rules))


def place_rows(x, mesh: Mesh, rules=None) -> jax.Array:
    """A batch-major array with rows over `data`. From host data (identical in every
    process), each process builds only its own devices' shards, so it works multi-host."""
    placement = batch_sharding(np.shape(x), mesh, tuple(rules or DEFAULT_RULES))
    if isinstance(x, jax.Array):
        return jax.device_put(x, placement)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, placement, lambda index: x[index])


def shard_model(model, mesh: Mesh, rules=None):
    """The model with its parameters placed in their shards on the mesh."""
    from specjax.models import Model

    shardings = param_shardings(model.params, mesh, tuple(rules or DEFAULT_RULES))
    return model.replace(params=jax.device_put(model.params, shardings))
