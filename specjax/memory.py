"""How much device memory a `generate` call needs, and refusing one that cannot fit.

`estimate_memory` compiles `generate` ahead of time for the request's shapes (nothing is
run) and reads XLA's own accounting of the program (`memory_analysis()`): the arguments
(the weights, the prompts), the outputs and the temporaries, which include the KV caches
since the loop allocates them. The caches are also computed from their shapes, so that the
report says how much of the temporaries they are.

Before anything is traced, `check_shapes` refuses a request whose shapes the memory
cannot hold whatever XLA makes of them: a lower bound from the shapes alone (weights, KV
caches, the verification pass's logits and mask) against the device's memory, or the
host's on CPU. Then `generate` asks `check_fits` before running: where the device reports its memory
(`Device.memory_stats()`: GPU, TPU) a request whose program needs more than is free is
refused with the numbers; where it reports none (CPU) nothing is checked. The verdict is
remembered per shape, so a call of shapes seen before costs a dictionary look-up.

This module knows the loop's entry point and shapes; it does not know what the models
compute, and it cannot see memory that other programs allocate after it looked.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import verify_room

MB = 2 ** 20
GB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes, per device for a sharded program (XLA's accounting is per device)."""

    weights: int  # the target's and the drafter's parameters
    caches: int  # KV caches (target and drafter), from their shapes; part of `temporaries`
    temporaries: int  # the compiled program's scratch memory, caches included
    arguments: int  # everything passed in: weights, prompts, keys
    outputs: int
    total: int  # arguments + outputs + temporaries (what the program needs at its peak)

    def __str__(self):
        return (f"{self.total / MB:.1f} MB in all: weights {self.weights / MB:.1f} MB, caches "
                f"{self.caches / MB:.1f} MB, temporaries {self.temporaries / MB:.1f} MB (caches "
                f"included), arguments {self.arguments / MB:.1f} MB, outputs {self.outputs / MB:.1f} MB")


def _prepared(target, prompts, lengths, kwargs):
    from specjax.generate import _prepare, generate

    bound = inspect.signature(generate).bind(target, prompts, lengths, **kwargs)
    bound.apply_defaults()
    return _prepare(**bound.arguments)


def _compile(args, static, stream):
    from specjax.generate import _generate

    return _generate.lower(*args, **static, stream=None if stream is None else jnp.int32(0)).compile()


def compiled_memory(target, prompts, lengths, **kwargs):
    """XLA's memory analysis of `generate(target, prompts, lengths, **kwargs)` compiled
    ahead of time (not run): an object with temp_size_in_bytes, argument_size_in_bytes,
    output_size_in_bytes, ..."""
    return _compile(*_prepared(target, prompts, lengths, kwargs)).memory_analysis()


def _nbytes(tree) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree) if hasattr(x, "shape")))


def _cache_bytes(args, static) -> int:
    """The target's cache and the drafter's state, from their shapes (jax.eval_shape)."""
    from specjax.cache import KVCache
    from specjax.generate import cache_length
    from specjax.models import prefill

    target, drafter, prompts, lengths = args[:4]
    B, P = prompts.shape
    S = cache_length(P, static["max_new_tokens"], verify_room(drafter))
    total = _nbytes(jax.eval_shape(lambda: KVCache.init(target.config, B, S, target.dtype)))
    if drafter is not None:
        def start():
            if getattr(drafter, "wants_features", False):
                hidden, _ = prefill(target, prompts, KVCache.init(target.config, B, S, target.dtype))
                return drafter.start(target, prompts, lengths, S, hidden=hidden)
            return drafter.start(target, prompts, lengths, S)
        total += _nbytes(jax.eval_shape(start))
    return total


def _estimate(args, static, stream) -> MemoryEstimate:
    analysis = _compile(args, static, stream).memory_analysis()
    target, drafter = args[:2]
    temp, arguments, outputs = (int(analysis.temp_size_in_bytes), int(analysis.argument_size_in_bytes),
                                int(analysis.output_size_in_bytes))
    return MemoryEstimate(weights=_nbytes(target.params) + _nbytes(drafter), caches=_cache_bytes(args, static),
                          temporaries=temp, arguments=arguments, outputs=outputs,
                          total=arguments + outputs + temp)


def estimate_memory(target, draft=None, batch: int = 1, prompt_len: int = 64, max_new_tokens: int = 64,
                    num_draft_tokens: int | None = None, **kwargs) -> MemoryEstimate:
    """The memory `generate` needs for `batch` prompts padded to `prompt_len` tokens, with
    this draft (None, a model or a drafter), max_new_tokens and num_draft_tokens; other
    keyword arguments as generate's (mesh, return_trace, ...). Compiles the program ahead of
    time (seconds) and runs nothing."""
    for name, value in (("batch", batch), ("prompt_len", prompt_len)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    prompts = np.zeros((batch, prompt_len), np.int32)
    lengths = np.full((batch,), prompt_len, np.int32)
    args, static, stream = _prepared(target, prompts, lengths, dict(
        draft=draft, max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens, **kwargs))
    return _estimate(args, static, stream)


def device_free_bytes(mesh=None) -> int | None:
    """The least free memory over the devices a call runs on (bytes_limit - bytes_in_use of
    `Device.memory_stats()`), or None where devices report none (CPU)."""
    devices = jax.local_devices()[:1] if mesh is None else [d for d in mesh.devices.flat
                                                           if d.process_index == jax.process_index()]
    free = []
    for d in devices:
        stats = _stats(d)
        if "bytes_limit" not in stats:
            return None
        free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return min(free) if free else None


def _stats(device) -> dict:
    """device.memory_stats(), or {} where the backend reports none (CPU)."""
    try:
        return device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without the call
        return {}


class InsufficientMemoryError(MemoryError):
    """generate was asked for more memory than the device has free."""


def memory_capacity(mesh=None) -> int | None:
    """Bytes all the devices a call runs on can hold together: bytes_limit of
    `Device.memory_stats()` times their number; on CPU (no stats) the host's physical
    memory, which its devices share. None where neither is known."""
    stats = _stats(jax.local_devices()[0])
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]) * (1 if mesh is None else mesh.devices.size)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _kv_bytes(model, batch: int, slots: int) -> int:
    c = model.config
    return 2 * c.num_layers * batch * slots * c.num_kv_heads * c.head_dim * jnp.dtype(model.dtype).itemsize


def shape_bound(target, drafter, batch: int, prompt_len: int, max_new_tokens: int) -> dict[str, int]:
    """Bytes a generate call of these shapes needs at the least, by part, from the shapes
    alone (nothing traced): the weights, the KV caches, and one verification pass's logits
    [B, T, V] and attention mask [B, T, S], T = 1 + the tree's nodes (or the drafter's
    writes). XLA's program needs these and more."""
    from specjax.drafters.model import DraftModel
    from specjax.generate import cache_length

    room = verify_room(drafter)
    S, T = cache_length(prompt_len, max_new_tokens, room), 1 + room
    caches = _kv_bytes(target, batch, S)
    if isinstance(drafter, DraftModel):
        caches += _kv_bytes(drafter.model, batch, S + drafter.tree.region + drafter.tree.depth + 1)
    return {"weights": _nbytes(target.params) + _nbytes(drafter), "caches": caches,
            "logits": batch * T * target.config.vocab_size * jnp.dtype(target.dtype).itemsize,
            "mask": batch * T * S}


def check_shapes(target, drafter, batch: int, prompt_len: int, max_new_tokens: int, mesh=None):
    """Raises InsufficientMemoryError, before anything is traced, when `shape_bound` alone
    exceeds `memory_capacity`: such a request cannot run, whatever the program."""
    capacity = memory_capacity(mesh)
    need = shape_bound(target, drafter, batch, prompt_len, max_new_tokens)
    if capacity is None or sum(need.values()) <= capacity:
        return
    nodes = "" if drafter is None else f" and {drafter.tree.nodes} draft tokens per step"
    parts = ", ".join(f"{k} {v / GB:.1f} GiB" for k, v in need.items())
    where = "the devices hold" if "bytes_limit" in _stats(jax.local_devices()[0]) else "the host has"
    raise InsufficientMemoryError(
        f"generate for batch {batch} x prompt {prompt_len} tokens with max_new_tokens={max_new_tokens}{nodes} "
        f"needs at least {sum(need.values()) / GB:.1f} GiB ({parts}), but {where} {capacity / GB:.1f} GiB. "
        f"Use a smaller batch, prompt, max_new_tokens or tree.")


_verdicts: dict = {}  # shapes of a request -> its MemoryEstimate


def _key(args, static, stream):
    leaves, treedef = jax.tree.flatten(args)
    shapes = tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x)))) for x in leaves)
    return treedef, shapes, tuple(sorted(static.items(), key=lambda kv: kv[0])), stream is None


def check_fits(args, static, stream):
    """Raises InsufficientMemoryError when the program for these prepared arguments needs
    more than the device reports free; does nothing where it reports nothing (CPU). The
    first call per shape compiles the program (the jit cache then serves generate)."""
    free = device_free_bytes(static.get("mesh"))
    if free is None:
        return
    key = _key(args, static, stream)
    if key not in _verdicts:
        _verdicts[key] = _estimate(args, static, stream)
    need = _verdicts[key]
    # The arguments already on the device (weights) are counted in bytes_in_use; what must
    # still fit is the program's outputs and temporaries.
    if need.outputs + need.temporaries > free:
        prompts = args[2]
        raise InsufficientMemoryError(
            f"generate for batch {prompts.shape[0]} x prompt {prompts.shape[1]} tokens with "
            f"max_new_tokens={static['max_new_tokens']} needs {(need.outputs + need.temporaries) / MB:.1f} MB "
            f"beyond its arguments ({need}), but the device has {free / MB:.1f} MB free. Use a smaller "
            f"batch, prompt or max_new_tokens, or shard over more devices (mesh=...).")
