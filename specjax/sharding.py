"""Meshes, logical axes and shardings: tensor parallel over `model`, batch over `data`.

Every weight and cache dimension has a logical name (LOGICAL_AXES below); one rules table
maps logical names to mesh axes (Megatron-style: heads, kv heads, MLP width and vocabulary
over `model`; batch over `data`), and users may pass their own. A dimension that does not
divide its mesh axis is not sharded on it; a weight that then has no `model` dimension
left falls back to its head_dim or embed dimension, so that weights are always split and
never gathered whole. GSPMD keeps the arithmetic exact whatever the layout.

Fewer kv heads than the `model` axis (G=2 over 8 devices) is the exception: splitting the
k/v projections on head_dim would make every attention score a partial sum over devices,
all-reduced at every layer of every step. Instead, as MaxText and vLLM do, `shard_model` and
`load_model(mesh=...)` repeat each kv head (its k/v projection weights) until the heads
divide the axis (`kv_repeat`), so each device holds whole kv heads for its query heads and
attention needs no communication. The model computes exactly what it did (query head h
still reads a copy of kv head h // (H/G)); its config's num_kv_heads and its caches grow
with the copies, which is what the per-device cache costs: each device holds whole kv
heads instead of a slice of every one.

The decoding loop's state is laid out the same way: each array's logical axes are declared
(`Axes`; a state's class names them in its AXES table, `declared_axes`; a drafter's by
`Drafter.state_axes`), never guessed from its shape: "batch" is its rows, over `data`.

This module knows shapes and names; it does not know what the models compute.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from specjax.cache import KVCache
from specjax.quant import Int8, path_names

DATA, MODEL, EXPERT = "data", "model", "expert"

# Logical axes of each parameter by its name (or "module/name" where the name alone is
# ambiguous). An int8 weight's scale has the weight's axes (its contracted ones of size 1)
# and shards as the weight does. "qkv" (a group's query heads, then its key and value head)
# and "gate_up" (gate, then up) are never split: a device holds whole groups.
LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "embedding": ("vocab", "embed"),
    "pos_embedding": ("positions", "embed"),
    "lm_head": ("embed", "vocab"),
    "scale": ("embed",),  # norms over E (pre-norms, Gemma's post-norms, the final norm)
    "q_norm/scale": ("head_dim",),  # q/k norms over D (Qwen3, Gemma 3)
    "k_norm/scale": ("head_dim",),
    "bias": ("embed",),
    "qkv_kernel": ("kv_heads", "qkv", "head_dim", "embed"),
    "qkv_bias": ("kv_heads", "qkv", "head_dim"),
    "o_kernel": ("heads", "head_dim", "embed"),
    "o_bias": ("embed",),
    "sinks": ("heads",),
    "gate_up_kernel": ("gate_up", "embed", "mlp"),
    "fc_kernel": ("embed", "mlp"),
    "down_kernel": ("mlp", "embed"),
    "proj_kernel": ("mlp", "embed"),
    "gate_up_bias": ("gate_up", "mlp"),
    "fc_bias": ("mlp",),
    "down_bias": ("embed",),
    "proj_bias": ("embed",),
    # a mixture of experts (models/moe.py): whole experts over `expert` (a mesh without one:
    # over `model`: whole experts, not slices of each one's width, which a TPU's grouped matmul
    # wants in multiples of 128), their width over `model` where the experts leave it free;
    # never E (their matmuls run by hand, models/moe.split_experts_out: no fallback to E)
    "router": ("embed", "routes"),  # small: every device holds it whole, and routes its tokens itself
    "experts_gate": ("experts", "expert_embed", "expert_mlp"),
    "experts_up": ("experts", "expert_embed", "expert_mlp"),
    "experts_down": ("experts", "expert_mlp", "expert_embed"),
    "shared_gate": ("embed",),
    "router_bias": ("routes",),
    "experts_gate_bias": ("experts", "expert_mlp"),
    "experts_up_bias": ("experts", "expert_mlp"),
    "experts_down_bias": ("experts", "expert_embed"),
    # Latent attention (models/mla.py): what projects into the latents (q's and the keys')
    # is replicated, each whole on every device (r + rope and q_lora_rank are no heads to
    # split; E x (q_lora_rank + r + rope) is a small share of a layer); what leaves them
    # is split by heads, as q/k/v heads are.
    "q_kernel": ("embed", "heads", "head_dim"),
    "q_a_kernel": ("embed", "q_lora"),
    "q_a_norm/scale": ("q_lora",),
    "q_b_kernel": ("q_lora", "heads", "head_dim"),
    "kv_a_kernel": ("embed", "kv_latent"),
    "kv_a_norm/scale": ("kv_latent",),
    "k_b_kernel": ("heads", "head_dim", "kv_latent"),
    "v_b_kernel": ("heads", "head_dim", "kv_latent"),
}
CACHE_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")  # each layer's k and v buffer
# A latent cache's (cache.py: KVCache.latent): its one key head, [c_kv ; k_rope], is whole on
# every device of `model`, whose query heads all read it; split on its width, every score
# would be a sum over devices.
LATENT_CACHE_AXES = ("batch", None, "cache_seq", None)

DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    ("batch", DATA), ("heads", MODEL), ("kv_heads", MODEL), ("mlp", MODEL), ("vocab", MODEL),
    ("experts", EXPERT), ("expert_mlp", MODEL))
# Where a tensor's `model` sharding goes when its preferred dimension does not divide.
MODEL_FALLBACK = ("head_dim", "embed")


def make_mesh(data: int | None = None, model: int | None = None, devices: Sequence | None = None,
              expert: int | None = None) -> Mesh:
    """A (data, model) mesh over all devices (or those given) with automatic sharding
    propagation; with expert > 1 a (data, expert, model) mesh, a mixture of experts' experts
    split over `expert` (expert parallelism: models/moe.py). Defaults: model=1, expert=1,
    data=the rest."""
    devices = list(jax.devices() if devices is None else devices)
    model, expert = model or 1, expert or 1
    data = data or len(devices) // (model * expert)
    if data * model * expert != len(devices):
        asked = f"data={data} x model={model}" + (f" x expert={expert}" if expert > 1 else "")
        raise ValueError(f"mesh {asked} needs {data * model * expert} devices; there are {len(devices)}")
    if expert == 1:
        grid = np.array(devices).reshape(data, model)
        return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))
    grid = np.array(devices).reshape(data, expert, model)
    return Mesh(grid, (DATA, EXPERT, MODEL), axis_types=(AxisType.Auto,) * 3)


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
        if axis == EXPERT and mesh.shape.get(EXPERT, 1) == 1:  # no expert axis: experts over `model`
            axis = MODEL
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
    """The logical axes of the parameter at `path` (e.g. ("layers", "0", "attn", "qkv_kernel"))."""
    name = "/".join(path[-2:]) if "/".join(path[-2:]) in LOGICAL_AXES else path[-1]
    if name not in LOGICAL_AXES:
        raise ValueError(f"parameter {'/'.join(path)} has no logical axes; add it to "
                         f"specjax.sharding.LOGICAL_AXES")
    axes = LOGICAL_AXES[name]
    if len(axes) != ndim:
        raise ValueError(f"parameter {'/'.join(path)} has {ndim} dims but logical axes {axes}")
    return axes


def _is_int8(x) -> bool:
    return isinstance(x, Int8)


def scale_spec(weight: PartitionSpec, scale_shape: Sequence[int]) -> PartitionSpec:
    """An int8 scale's spec: its weight's, except along the contracted axes (size 1)."""
    axes = tuple(weight) + (None,) * (len(scale_shape) - len(weight))
    return PartitionSpec(*(a if n > 1 else None for a, n in zip(axes, scale_shape)))


_warned: set = set()  # (weight, shape, mesh shape) already warned about


def _warn_fallback(name: str, shape, logical, got: PartitionSpec, mesh: Mesh, rules):
    """Warns once per weight, shape and mesh when a dimension does not divide the mesh axis
    its rule names, saying where that axis went instead (a fallback dimension, or nowhere).
    Every layer's weight of one name is one weight here ("layers/*/attn/qkv_kernel")."""
    name = re.sub(r"(^|/)\d+(?=/|$)", r"\1*", name)
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
        lambda path, p: param_sharding(path_names(path), p, mesh, rules), params,
        is_leaf=_is_int8)


def cache_shardings(cache: KVCache, mesh: Mesh, rules=DEFAULT_RULES) -> KVCache:
    axes = LATENT_CACHE_AXES if cache.latent else CACHE_AXES

    def one(a):
        return NamedSharding(mesh, spec(a.shape, axes, mesh, rules))

    return KVCache(k=tuple(map(one, cache.k)), v=tuple(map(one, cache.v)),
                   lengths=NamedSharding(mesh, spec(cache.lengths.shape, ("batch",), mesh, rules)))


def batch_sharding(shape: Sequence[int], mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
    """Rows over `data` (when they divide it); every other dimension replicated."""
    return NamedSharding(mesh, spec(shape, ("batch",) + (None,) * (len(shape) - 1), mesh, rules))


class Axes(tuple):
    """One array's logical axes: a name per dimension ("batch": its rows, split over data and
    written row by row; None: a dimension no rule splits), e.g. Axes("batch", None) for int32
    [B, K]. A tuple that pytrees hold as a leaf (a tuple subclass is no pytree node), so a
    tree of them mirrors a state's structure (`declared_axes`)."""

    def __new__(cls, *names):
        return super().__new__(cls, names)

    def __getnewargs__(self):
        return tuple(self)

    def __repr__(self):
        return f"Axes{tuple.__repr__(self)}"

    @property
    def row_axis(self) -> int | None:
        """The dimension that holds the rows ("batch"), or None: an array all rows share."""
        return self.index("batch") if "batch" in self else None


class _RowsFirst:
    def __repr__(self):
        return "sharding.ROWS"


# In an AXES table (`declared_axes`): every array of the field, whatever its structure and
# rank, has its rows first and no other dimension named.
ROWS = _RowsFirst()


def rows_first(x) -> Axes:
    """The axes of an array whose first dimension is its rows and whose others are unnamed."""
    return Axes("batch", *(None,) * (len(np.shape(x)) - 1))


def cache_axes(cache: KVCache) -> KVCache:
    """A KVCache's logical axes (a KVCache of `Axes`): each layer's k and v by CACHE_AXES (a
    latent cache's by LATENT_CACHE_AXES: whole but for its rows and slots), its lengths rows;
    a tree in flight [B, R, G, D] rows and heads. A paged cache's pools [P, G, page, D] belong
    to no row (their pages are shared), its page table [B, M] is rows."""
    heads, dims = ("kv_heads", "head_dim") if not cache.latent else (None, None)  # a latent cache's: whole
    kv = Axes("batch", heads, "cache_seq", dims) if cache.pages is None else Axes(None, heads, None, dims)
    tree = None if cache.tree is None else jax.tree.map(lambda _: Axes("batch", None, heads, dims), cache.tree)
    return cache.replace(k=tuple(kv for _ in cache.k), v=tuple(kv for _ in cache.v), lengths=Axes("batch"), tree=tree,
                         pages=None if cache.pages is None else Axes("batch", None))


def declared_axes(state, owner: str):
    """The logical axes a state declares: a pytree of `Axes` with the state's structure. None
    for None; a KVCache by CACHE_AXES (`cache_axes`); a dataclass by its class's AXES table,
    {field: declaration} naming every pytree field, a declaration being a tuple (the array's
    axes, one name or None per dimension), ROWS (each of the field's arrays rows first), a
    class (the field holds one, or None, and declares its own axes so: KVCache, or a class
    with an AXES table), or None (the field is None here: e.g. SlotState's draft_state,
    which its drafter declares). `owner` names the state in errors (e.g. "DraftModel's state")."""
    if state is None:
        return None
    if isinstance(state, KVCache):
        return cache_axes(state)
    name = type(state).__name__
    table = getattr(type(state), "AXES", None)
    if table is None or not dataclasses.is_dataclass(state):
        raise TypeError(f"{owner} ({name}) declares no logical axes: give {name} an AXES table of its fields' "
                        f"axes (sharding.declared_axes), or override the drafter's state_axes")
    fields = [f.name for f in dataclasses.fields(state) if f.metadata.get("pytree_node", True)]
    undeclared, unknown = [f for f in fields if f not in table], [k for k in table if k not in fields]
    if undeclared or unknown:
        raise ValueError(f"{owner} ({name}): its AXES table " + "; ".join(
            part for part in (undeclared and f"declares no axes for its field(s) {', '.join(undeclared)}",
                              unknown and f"names no field(s) {', '.join(unknown)}") if part))
    axes = {}
    for field in fields:
        value, declared, where = getattr(state, field), table[field], f"{owner} ({name}.{field})"
        if declared is ROWS:
            axes[field] = jax.tree.map(rows_first, value)
        elif isinstance(declared, type):
            if value is not None and not isinstance(value, declared):
                raise TypeError(f"{where}: declared a {declared.__name__}, holds a {type(value).__name__}")
            axes[field] = declared_axes(value, where)
        elif declared is None:
            if value is not None:
                raise ValueError(f"{where}: declared None (no axes), holds a {type(value).__name__}")
            axes[field] = None
        elif isinstance(declared, tuple) and all(a is None or isinstance(a, str) for a in declared):
            axes[field] = None if value is None else Axes(*declared)
        else:
            raise TypeError(f"{where}: {declared!r} is no axes declaration (a tuple of names or None, ROWS, "
                            f"a class, or None)")
    return dataclasses.replace(state, **axes)


def _is_axes(x) -> bool:
    return isinstance(x, Axes)


def check_axes(tree, axes, owner: str):
    """Raises, naming `owner` and the field, unless `axes` (a pytree of `Axes`) has the
    structure of `tree` (arrays, or shapes alone) and one name per dimension of each array."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)
    named = jax.tree_util.tree_flatten_with_path(axes, is_leaf=_is_axes)
    kind = f" ({type(tree).__name__})" if tree is not None else ""
    if leaves[1] != named[1] or not all(_is_axes(a) for _, a in named[0]):
        have = {jax.tree_util.keystr(p) for p, _ in leaves[0]}
        said = {jax.tree_util.keystr(p): a for p, a in named[0]}
        wrong = sorted(have ^ set(said)) or sorted(p for p, a in said.items() if not _is_axes(a))
        detail = (f"at {', '.join(wrong)}" if wrong else f"{named[1]} for a state of structure {leaves[1]}")
        raise ValueError(f"{owner}{kind}: its declared axes do not match its structure ({detail}; each array's "
                         f"axes must be a sharding.Axes)")
    for (path, x), (_, a) in zip(leaves[0], named[0]):
        if len(a) != len(np.shape(x)):
            raise ValueError(f"{owner}{kind}{jax.tree_util.keystr(path)}: declared axes {a} for an array of "
                             f"{len(np.shape(x))} dims {tuple(np.shape(x))}")


def carry_sharding(tree, axes, mesh: Mesh, rules, owner: str = "the state"):
    """Where each array of `tree` (a loop carry's part: arrays, or shapes alone) lies on a
    mesh, by its declared logical axes (`axes`: a pytree of `Axes`, e.g. `declared_axes`)
    under `rules`: a pytree of NamedShardings. Checked first (`check_axes`)."""
    check_axes(tree, axes, owner)
    return jax.tree.map(lambda x, a: NamedSharding(mesh, spec(np.shape(x), a, mesh, rules)), tree, axes)


def place_carry(tree, axes, mesh: Mesh, rules, owner: str = "the state"):
    """A loop carry's part (arrays, or shapes alone) placed where `carry_sharding` lays it."""
    return jax.tree.map(put, tree, carry_sharding(tree, axes, mesh, rules, owner))


def barrier(name: str):
    """Waits for every process of a jax.distributed job (nothing to wait for alone)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def gather(tree):
    """The arrays of a pytree (e.g. a `GenerateOutput`) as NumPy arrays, whole, in every
    process: a global array of a multi-host mesh is not fully addressable in any one
    process, so its shards are gathered across processes (a collective: every process
    must call it); a fully addressable one is just copied to the host."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)
    return jax.tree.map(one, tree)


def place_rows(x, mesh: Mesh, rules=None) -> jax.Array:
    """A batch-major array with rows over `data`. From host data (identical in every
    process), each process builds only its own devices' shards, so it works multi-host."""
    rules = tuple(rules or DEFAULT_RULES)
    axis = dict(rules).get("batch")
    rows, n = np.shape(x)[0], mesh.shape.get(axis, 1)
    if rows % n:
        raise ValueError(f"a batch of {rows} rows does not divide the mesh's {axis} axis ({n} devices): "
                         f"pad the batch to a multiple of {n} (e.g. repeat a prompt and drop its output)")
    return put(x, batch_sharding(np.shape(x), mesh, rules))


# The weights that hold kv heads, their first two axes [G, R+2] (`regroup_kv_heads`).
KV_HEAD_PARAMS = ("qkv_kernel", "qkv_bias")


def regroup_kv_heads(x, repeat: int):
    """x [G, R+2, ...] (a group's R query heads, its key head, its value head; qkv_kernel
    [G, R+2, D, E], qkv_bias [G, R+2, D]) -> [G repeat, R/repeat + 2, ...]: each group split
    into `repeat` groups, consecutive query heads each, every one with a copy of the group's
    key and value heads. Query head h keeps its place (h = g R + j) and still reads a copy
    of kv head h // R. numpy or jax."""
    xp = np if isinstance(x, np.ndarray) else jax.numpy
    G, R2, *rest = x.shape
    R = R2 - 2
    q = x[:, :R].reshape(G * repeat, R // repeat, *rest)
    kv = xp.repeat(x[:, R:], repeat, axis=0)
    return xp.concatenate([q, kv], axis=1)


def kv_repeat(config, mesh: Mesh, rules: Sequence[tuple[str, str]] = DEFAULT_RULES) -> int:
    """How many copies of each kv head make the kv heads divide the mesh axis that the rules
    put them on: the smallest r with (G r) % n == 0 (n the axis size), when the query heads
    go on the same axis and divide it; otherwise 1 (nothing to gain: the kv heads divide
    already, the axis has one device, or the query heads fall back to head_dim anyway)."""
    table = dict(rules)
    axis = table.get("kv_heads")
    n = mesh.shape.get(axis, 1) if axis is not None else 1
    G, H = config.num_kv_heads, config.num_heads
    if config.mla is not None:  # latent attention's one key head is whole on every device
        return 1
    if n <= 1 or G % n == 0 or table.get("heads") != axis or H % n:
        return 1
    return math.lcm(G, n) // G  # divides H/G, since both G and n divide H


def repeat_kv_heads(model, repeat: int):
    """The model with each kv head's k/v weights repeated `repeat` times (`regroup_kv_heads`),
    so that query head h reads the copy h // (H / (G r)) of kv head h // (H / G): the same
    numbers. int8 weights regroup their scales too. Its config says G r kv heads."""
    if repeat == 1:
        return model
    if not isinstance(repeat, int) or repeat < 1 or model.config.num_heads % (model.config.num_kv_heads * repeat):
        raise ValueError(f"cannot repeat {model.config.num_kv_heads} kv heads {repeat!r} times under "
                         f"{model.config.num_heads} query heads")

    def one(path, leaf):
        if path_names(path)[-1] not in KV_HEAD_PARAMS:
            return leaf
        return jax.tree.map(lambda x: jax.eval_shape(lambda a: regroup_kv_heads(a, repeat), x) if isinstance(
            x, jax.ShapeDtypeStruct) else regroup_kv_heads(x, repeat), leaf)

    params = jax.tree_util.tree_map_with_path(one, model.params, is_leaf=_is_int8)
    config = dataclasses.replace(model.config, num_kv_heads=model.config.num_kv_heads * repeat)
    return model.replace(config=config, params=params)


def replicated_rules(rules: Sequence[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The rules of a replicated model under a mesh: rows keep their axis, nothing else is split."""
    return tuple((name, axis) for name, axis in rules if name == "batch")


def shard_model(model, mesh: Mesh, rules=None, duplicate_kv_heads: bool = True):
    """The model with its parameters placed in their shards on the mesh, remembering the
    rules (`Model.rules`: its caches in `generate` follow them). With fewer kv heads than
    the axis they go on, each kv head is first repeated (see `kv_repeat`) unless
    duplicate_kv_heads=False (then k/v split on head_dim, and attention scores are summed
    over devices). Pass rules=(("batch", "data"),) to replicate a small draft.

    On a mesh over several processes, each process must hold the same model: it places
    the shards of its own devices from its copy (no transfer between hosts)."""
    rules = tuple(rules or DEFAULT_RULES)
    if duplicate_kv_heads:
        model = repeat_kv_heads(model, kv_repeat(model.config, mesh, rules))
    shardings = param_shardings(model.params, mesh, rules)
    return model.replace(params=jax.tree.map(put, model.params, shardings), rules=rules)


def replicate(tree, mesh: Mesh):
    """A pytree's arrays with a whole copy on every device of the mesh (each process places
    its own devices' copies from its own)."""
    whole = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: put(x, whole), tree)


def put(x, placement: jax.sharding.Sharding) -> jax.Array:
    """x (host data or an array) placed by `placement`. Host data, and any x when the
    placement spans several processes, is cut by each process for its own devices from its
    own copy (identical in every process: arrays do not move between hosts); an array
    within one process moves with device_put. A jax.ShapeDtypeStruct (a shape, no values)
    becomes one that carries the placement."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placement)
    if isinstance(x, jax.Array) and len(placement.device_set) == len(placement.addressable_devices):
        return jax.device_put(x, placement)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, placement, lambda index: host[index])
