"""Streaming a compiled loop's tokens to the host: a registry of the stream functions of
calls in progress, keyed by a handle that the loop carries as an int32 and hands back to
`to_host` through an ordered io_callback. Knows nothing of what the loop computes."""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable

import numpy as np

_streams: dict[int, Callable] = {}  # handle -> the stream function of a call in progress
_handles = itertools.count()


def to_host(handle, tokens, counts):
    """The io_callback: stream(tokens int32 [B, W], counts int32 [B]) of the call `handle`."""
    _streams[int(handle)](np.asarray(tokens), np.asarray(counts))


@contextlib.contextmanager
def registered(stream: Callable):
    """A handle (int) under which `stream` receives the loop's calls until the block ends."""
    handle = next(_handles) % 2**31
    _streams[handle] = stream
    try:
        yield handle
    finally:
        del _streams[handle]
