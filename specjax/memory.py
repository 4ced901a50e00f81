"""The devices' memory: what they hold and have free, as they report it (or, on CPU, the
host's physical memory), and the bytes of a pytree's arrays. Knows nothing of generate;
budget.py decides from these whether a request fits.
"""

from __future__ import annotations

import os
import re

import jax
import numpy as np

MB = 2 ** 20
GB = 2 ** 30


def nbytes(tree) -> int:
    """Bytes of the arrays (or shape-dtype structs) in a pytree."""
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree) if hasattr(x, "shape")))


def device_nbytes(tree) -> int:
    """Bytes of a pytree's arrays (or shape-dtype structs) that one device holds: each
    leaf's shard where it carries a sharding, the whole leaf where it carries none."""
    total = 0
    for x in jax.tree.leaves(tree):
        placed = getattr(x, "sharding", None)
        shape = x.shape if placed is None else placed.shard_shape(x.shape)
        total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
    return total


def device_free_bytes(mesh=None) -> int | None:
    """The least free memory over the devices a call runs on (bytes_limit - bytes_in_use of
    `Device.memory_stats()`), or None where devices report none (CPU)."""
    devices = jax.local_devices()[:1] if mesh is None else [d for d in mesh.devices.flat
                                                           if d.process_index == jax.process_index()]
    free = []
    for d in devices:
        stats = device_stats(d)
        if "bytes_limit" not in stats:
            return None
        free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return min(free) if free else None


def device_stats(device) -> dict:
    """device.memory_stats(), or {} where the backend reports none (CPU)."""
    try:
        return device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without the call
        return {}


_UNITS = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12,
          "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30, "ti": 2 ** 40}


def parse_bytes(size) -> int:
    """Bytes from an int, or a string such as "4GiB", "512 MiB", "1.5GB", "4G" (KiB, MiB, GiB,
    TiB are powers of 2; kB, MB, GB, TB of 10; a bare K, M, G, T is a power of 2, as in `free -h`)."""
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        value = int(size)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?)(b?)\s*", str(size), re.IGNORECASE)
        if match is None:
            raise ValueError(f"{size!r} is not a size in bytes (e.g. 4GiB, 512MiB, 2GB, 1073741824)")
        number, unit, binary, b = match.groups()
        binary = binary or (unit and not b)
        value = int(float(number) * _UNITS[unit.lower() + ("i" if binary and unit else "")])
    if value < 1:
        raise ValueError(f"a size in bytes must be positive, got {size!r}")
    return value


def readable(n: int) -> str:
    """Bytes in words: "24.0 KiB", "1.50 GiB"."""
    for unit, size in (("GiB", GB), ("MiB", MB), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


class InsufficientMemoryError(MemoryError):
    """generate was asked for more memory than the device has free."""


def memory_capacity(mesh=None) -> int | None:
    """Bytes all the devices a call runs on can hold together: bytes_limit of
    `Device.memory_stats()` times their number; on CPU (no stats) the host's physical
    memory, which its devices share. None where neither is known."""
    stats = device_stats(jax.local_devices()[0])
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]) * (1 if mesh is None else mesh.devices.size)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


