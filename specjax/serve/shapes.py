"""The engine's static sizes: prompt-length buckets (a prefill's shapes) and the few sizes
of its runs' widths and prefill groups, from its slots. Numbers only: nothing of programs,
requests or devices.
"""

from __future__ import annotations

MIN_BUCKET = 16  # the shortest prompt bucket; buckets double from it up to max_len
SIZES = 5  # the most run widths, and prefill group sizes, an engine compiles, whatever its slots


def spread(slots: int, count: int = SIZES) -> tuple[int, ...]:
    """At most `count` sizes from 1 to `slots`: slots and its halvings (rounded up), and 1:
    1, 2, 4, 8 at 8 slots; 1, 8, 16, 32, 64 at 64. A program set that does not grow with
    slots; a server's rows, which fill from about half its slots to all under load, run
    near their number (a step costs by its rows on a CPU), and one row alone runs alone."""
    return tuple(sorted({-(-slots // 2 ** j) for j in range(count - 1)} | {1}))


def buckets(max_len: int, unit: int = MIN_BUCKET) -> tuple[int, ...]:
    """Prompt-length buckets: unit (16, or a page of more), doubling, the last max_len rounded
    up to the unit: each a whole number of units."""
    last = -(-max_len // unit) * unit
    out, b = [], unit
    while b < last:
        out.append(b)
        b *= 2
    return tuple(out) + (last,)
