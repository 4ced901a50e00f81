"""The engine's static sizes: prompt-length buckets (a prefill's shapes) and the few sizes
of its runs' widths and prefill groups, from its slots. Numbers only: nothing of programs,
requests or devices.
"""

from __future__ import annotations

import math

MIN_BUCKET = 16  # the shortest prompt bucket; buckets double from it up to max_len
SIZES = 4  # the most run widths, and prefill group sizes, an engine compiles, whatever its slots


def spread(slots: int, count: int = SIZES) -> tuple[int, ...]:
    """At most `count` sizes from 1 to `slots`: powers of two evenly spaced in log between
    them, and slots itself (1, 2, 4, 8 at 8; 1, 4, 8, 32 at 32; 1, 4, 16, 64 at 64; 1, 8, 64,
    512 at 512): a program set that does not grow with slots, its narrowest runs kept for
    the few rows a step then costs less for (on a CPU)."""
    top = math.log2(slots)
    return tuple(sorted({min(2 ** round(i * top / (count - 1)), slots) for i in range(count - 1)} | {slots}))


def buckets(max_len: int, unit: int = MIN_BUCKET) -> tuple[int, ...]:
    """Prompt-length buckets: unit (16, or a page of more), doubling, the last max_len rounded
    up to the unit: each a whole number of units."""
    last = -(-max_len // unit) * unit
    out, b = [], unit
    while b < last:
        out.append(b)
        b *= 2
    return tuple(out) + (last,)
