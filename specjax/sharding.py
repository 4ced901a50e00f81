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

import warnings
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from specjax.cache import KVCache
from specjax.quant import Int8

DATA, MODEL = "data", "model"

# Logical axes of each parameter by its name (or "module/name" where the name alone is
# ambiguous); per-layer weights get a leading "layers". An int8 weight's scale has the
# weight's axes (its contracted ones of size 1) and shards as the weight does.
LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "embedding": ("vocab", "embed"),
    "pos_embedding": ("positions", "embed"),
    "lm_head": ("embed", "vocab"),
    "scale": ("embed",),  # norms over E (pre-norms, Gemma's post-norms, the final norm)
    "q_norm/scale": ("head_dim",),  # q/k norms over D (Qwen3, Gemma 3)
    "k_norm/scale": ("head_dim",),
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
    name = "/".join(path[-2:]) if "/".join(path[-2:]) in LOGICAL_AXES else path[-1]
    if name not in LOGICAL_AXES:
        raise ValueError(f"parameter {'/'.join(path)} has no logical axes; add it to "
                         f"specjax.sharding.LOGICAL_AXES")
    axes = (("layers",) if path[0] == "layers" else ()) + LOGICAL_AXES[name]
    if len(axes) != ndim:
        raise ValueError(f"parameter {'/'.join(path)} has {ndim} dims but logical axes {axes}")
    return axes


def _is_int8(x) -> bool:
    return isinstance(x, Int8)


def param_logical_axes(params: Mapping) -> Any:
    """The logical axes of every parameter, as a pytree shaped like params (an int8
    weight's value and scale both get the weight's axes)."""
    def one(path, leaf):
        axes = logical_axes([str(k.key) for k in path], len(np.shape(leaf)))
        return Int8(axes, axes) if _is_int8(leaf) else axes
    return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_int8)


def scale_spec(weight: PartitionSpec, scale_shape: Sequence[int]) -> PartitionSpec:
    """An int8 scale's spec: its weight's, except along the contracted axes (size 1)."""
    axes = tuple(weight) + (None,) * (len(scale_shape) - len(weight))
    return PartitionSpec(*(a if n > 1 else None for a, n in zip(axes, scale_shape)))


_warned: set = set()  # (weight, shape, mesh shape) already warned about


def _warn_fallback(name: str, shape, logical, got: PartitionSpec, mesh: Mesh, rules):
    """Warns once per weight, shape and mesh when a dimension does not divide the mesh axis
    its rule names, saying where that axis went instead (a fallback dimension, or nowhere)."""
    table = dict(rules)
    for size, axis_name, placed in zip(shape, logical, tuple(got) + (None,) * len(shape)):
        axis = table.get(axis_name)
        if axis in mesh.shape and mesh.shape[axis] > 1 and size % mesh.shape[axis] and placed != axis:
            key = (name, tuple(shape), tuple(mesh.shape.items()))
            if key in _warned:
                return
            _warned.add(key)
            where = [logical[i] for i, a in enumerate(got) if a == axis]
            instead = f"split over its {where[0]} dimension instead" if where else "not split over it at all"
            warnings.warn(f"{name} {tuple(shape)}: its {axis_name} dimension ({size}) does not divide the "
                          f"mesh's {axis} axis ({mesh.shape[axis]}); {instead}", stacklevel=3)
            return


def param_sharding(path: Sequence[str], param, mesh: Mesh, rules=DEFAULT_RULES):
    """The NamedSharding of one parameter (for an int8 weight: Int8 of two shardings, the
    scale split exactly as its weight is along the output channels). Warns once per weight
    whose preferred dimension does not divide its mesh axis, naming the fallback."""
    logical = logical_axes(path, len(np.shape(param)))
    weight = spec(np.shape(param), logical, mesh, rules)
    _warn_fallback("/".join(path), np.shape(param), logical, weight, mesh, rules)
    if _is_int8(param):
        return Int8(NamedSharding(mesh, weight), NamedSharding(mesh, scale_spec(weight, param.scale.shape)))
    return NamedSharding(mesh, weight)


def param_shardings(params: Mapping, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda path, p: param_sharding([str(k.key) for k in path], p, mesh, rules), params,
        is_leaf=_is_int8)


def cache_shardings(cache: KVCache, mesh: Mesh, rules=DEFAULT_RULES) -> KVCache:
    return jax.tree.map(lambda a, ax: NamedSharding(mesh, spec(a.shape, ax, mesh, rules)),
                        cache, CACHE_AXES, is_leaf=lambda x: isinstance(x, tuple))


def batch_sharding(shape: Sequence[int], mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
    """Rows over `data` (when they divide it); every other dimension replicated."""
    return NamedSharding(mesh, spec(shape, ("batch",) + (None,) * (len(shape) - 1), mesh, rules))


def place_rows(x, mesh: Mesh, rules=None) -> jax.Array:
    """A batch-major array with rows over `data`. From host data (identical in every
    process), each process builds only its own devices' shards, so it works multi-host."""
    rules = tuple(rules or DEFAULT_RULES)
    axis = dict(rules).get("batch")
    rows, n = np.shape(x)[0], mesh.shape.get(axis, 1)
    if rows % n:
        raise ValueError(f"a batch of {rows} rows does not divide the mesh's {axis} axis ({n} devices): "
                         f"pad the batch to a multiple of {n} (e.g. repeat a prompt and drop its output)")
    placement = batch_sharding(np.shape(x), mesh, rules)
    if isinstance(x, jax.Array):
        return jax.device_put(x, placement)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, placement, lambda index: x[index])


def shard_model(model, mesh: Mesh, rules=None):
    """The model with its parameters placed in their shards on the mesh."""
    from specjax.models import Model

    shardings = param_shardings(model.params, mesh, tuple(rules or DEFAULT_RULES))
    return model.replace(params=jax.device_put(model.params, shardings))
