"""A run over the engine's first rows: the state's first `width` rows taken out for it
(`first_rows`) and written back after (`written_back`), so that a step costs by the rows
it runs, not by the slots. It knows the state's leaves by their declared axes
(`loop.state_axes`) and that caches read in place or in pages need no slicing; nothing of
what a step computes.
"""

from __future__ import annotations

import jax

from specjax import loop
from specjax.cache import KVCache


def _whole(x, in_place: bool) -> bool:
    """Whether a run takes this leaf of the state whole, its rows' lengths and tables sliced
    (`first_rows`): a cache read in place, or a paged one (its pools are no row's)."""
    return isinstance(x, KVCache) and (in_place or x.pages is not None)


def first_rows(full, width: int, in_place: bool, axes):
    """The state's first `width` rows, for a run over them: every leaf sliced on its row axis
    (`axes`: `loop.state_axes`; an array all rows share whole), copied into the run and
    written back once per call (a few KB a row), but, in_place, the caches' key/value
    buffers, which a pass reads and writes where they lie whatever their rows (cache.py), so
    a narrow run copies no cache. Not on a GPU: there a cached pass may take cuDNN over the
    whole cache, which wants the pass's rows alone, and a slice of the buffers would be
    copied every pass rather than once a call. A paged cache's pools are shared: never sliced."""
    if width == full.tokens.shape[0]:
        return full

    def first(x, a):
        if _whole(x, in_place):
            return x.replace(lengths=x.lengths[:width], pages=None if x.pages is None else x.pages[:width])
        return jax.tree.map(lambda leaf, leaf_axes: loop.take_rows(leaf, leaf_axes, 0, width), x, a)

    return jax.tree.map(first, full, axes, is_leaf=loop.is_cache)


def written_back(full, rows, width: int, in_place: bool, axes):
    """`full` with `first_rows`' rows, as a run left them, in its first `width` rows (an
    array all rows share: the run's)."""
    if width == full.tokens.shape[0]:
        return rows

    def back(big, new, a):
        if _whole(big, in_place):
            return new.replace(lengths=big.lengths.at[:width].set(new.lengths), pages=big.pages)
        return jax.tree.map(lambda b, n, leaf_axes: loop.write_rows(b, n, leaf_axes, 0), big, new, a)

    return jax.tree.map(back, full, rows, axes, is_leaf=loop.is_cache)
