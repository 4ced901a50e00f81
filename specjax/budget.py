"""Does a `generate` call fit: the memory a request needs, and refusing one that cannot.

Before anything is traced, `check_shapes` refuses a request whose shapes the memory
cannot hold whatever XLA makes of them: a lower bound from the shapes alone (weights, KV
caches, the verification pass's logits and mask) against the device's memory, or the
host's on CPU. Then `generate` asks `check_fits` before running: where the device reports
its memory (`Device.memory_stats()`: GPU, TPU) a request whose program needs more than is
free is refused with the numbers; where it reports none (CPU) nothing is checked. The
verdict is remembered per shape, so a call of shapes seen before costs a dictionary look-up.

`estimate` compiles the loop ahead of time for prepared arguments (nothing is run) and
reads XLA's own accounting of the program (`memory_analysis()`): the arguments (the
weights, the prompts), the outputs and the temporaries, which include the KV caches since
the loop allocates them. The caches' bytes come from the loop's own initial state
(`jax.eval_shape` of `loop.initial_state`), so the report says how much of the
temporaries they are.

This module knows the loop's entry point and its state's shapes, and the devices' memory
through memory.py; it does not know what the models compute, and it cannot see memory
that other programs allocate after it looked.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.cache import KVCache
from specjax.drafters.base import grow_cache_length, verify_room
from specjax.drafters.model import DraftModel
from specjax import loop, memory, sharding
from specjax.loop import cache_length, initial_state, state_shardings
from specjax.memory import GB, MB, InsufficientMemoryError, device_nbytes, device_stats, nbytes


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


def compile_loop(args, static, stream):
    """The loop compiled ahead of time for prepared arguments (request.prepare)."""
    return loop.generate_loop.lower(*args, **static, stream=None if stream is None else jnp.int32(0)).compile()


def cache_bytes(args, static, per_device: bool = False) -> int:
    """The target's cache and the drafter's state, from the loop's initial state's shapes
    (traced from the arguments, which may be shapes alone); per_device: the bytes one device
    of the call's mesh holds of them (the target's cache split by its rules, the drafter's
    state by its declared axes and its drafter's rules)."""
    target, drafter, prompts, lengths, key = args[:5]
    state = jax.eval_shape(lambda t, d, p, n, k: initial_state(t, d, p, n, k, static["max_new_tokens"]),
                           target, drafter, prompts, lengths, key)
    mesh = static["backend"].mesh
    if not per_device or mesh is None:
        return nbytes(state.target_cache) + nbytes(state.draft_state)
    placed = jax.tree.map(sharding.put, state, state_shardings(state, drafter, mesh,
                                                               static.get("rules") or sharding.DEFAULT_RULES))
    return device_nbytes(placed.target_cache) + device_nbytes(placed.draft_state)


def estimate(args, static, stream) -> MemoryEstimate:
    """XLA's accounting of the loop for prepared arguments, with the caches' share."""
    analysis = compile_loop(args, static, stream).memory_analysis()
    target, drafter = args[:2]
    temp, arguments, outputs = (int(analysis.temp_size_in_bytes), int(analysis.argument_size_in_bytes),
                                int(analysis.output_size_in_bytes))
    return MemoryEstimate(weights=nbytes(target.params) + nbytes(drafter), caches=cache_bytes(args, static),
                          temporaries=temp, arguments=arguments, outputs=outputs,
                          total=arguments + outputs + temp)


def shape_bound(target, drafter, batch: int, prompt_len: int, max_new_tokens: int,
                sampled: bool = False) -> dict[str, int]:
    """Bytes a generate call of these shapes needs at the least, by part, from the shapes
    alone (nothing traced): the weights, the KV caches, and one verification pass's float32
    logits [B, T, V], T = 1 + the tree's nodes (or the drafter's writes; no [B, T, S] mask:
    a cached pass sees its prefix by each row's length, attention.cached_attention); sampled (any
    row not greedy): also the target's distributions p [B, T, V] and the drafts' q [B, N, V],
    float32. XLA's program needs these and more."""
    room = verify_room(drafter)
    S, T = cache_length(prompt_len, max_new_tokens, room), 1 + room
    V = target.config.vocab_size
    caches = KVCache.nbytes(target.config, batch, S, target.dtype)
    if isinstance(drafter, DraftModel):
        caches += KVCache.nbytes(drafter.model.config, batch, grow_cache_length(drafter.tree, S), drafter.model.dtype)
    need = {"weights": nbytes(target.params) + nbytes(drafter), "caches": caches,
            "logits": batch * T * V * 4}
    if sampled:
        drafted = 0 if drafter is None or drafter.tree.siblings != "sampled" else drafter.tree.nodes
        need["distributions"] = batch * (T + drafted) * V * 4
    return need


def check_shapes(target, drafter, batch: int, prompt_len: int, max_new_tokens: int, mesh=None,
                 sampled: bool = False):
    """Raises InsufficientMemoryError, before anything is traced, when `shape_bound` alone
    exceeds `memory_capacity`: such a request cannot run, whatever the program."""
    capacity = memory.memory_capacity(mesh)
    need = shape_bound(target, drafter, batch, prompt_len, max_new_tokens, sampled)
    if capacity is None or sum(need.values()) <= capacity:
        return
    nodes = "" if drafter is None else f" and {drafter.tree.nodes} draft tokens per step"
    parts = ", ".join(f"{k} {v / GB:.1f} GiB" for k, v in need.items())
    where = "the devices hold" if "bytes_limit" in device_stats(jax.local_devices()[0]) else "the host has"
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
    free = memory.device_free_bytes(static["backend"].mesh)
    if free is None:
        return
    key = _key(args, static, stream)
    if key not in _verdicts:
        _verdicts[key] = estimate(args, static, stream)
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
