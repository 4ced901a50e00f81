"""KVCache: fixed-shape key/value buffers with per-row lengths.

Slot s of row b holds the key/value of the token at position s of that row. A row's
entries at slots < lengths[b] are valid; entries at or beyond it are stale and are never
cleared: a pass sees the committed prefix below its first position and its own in-flight
tokens (attention.cached_attention), and writes its own positions before attending, so a stale
slot is always overwritten before any query can see it. Rolling back rejected draft tokens
is therefore only a matter of lowering `lengths`.

A cache's buffers may hold more rows than the pass over it: the pass's B rows are the
buffers' first B (`lengths` has B), read and written in place, the others untouched. The
engine steps its state's first rows so, without copying their caches out and back.

A token tree breaks "slot = position": its nodes share positions (siblings have the same
depth), and each sees the prefix and its ancestors only. A `Placement` says so; a tree's
keys and values never go to the cache's buffers while it is in flight. A target's
verification of a tree attends to its own nodes' keys as it computed them and writes none
(`Pending`); after acceptance, `commit` writes the accepted path's entries to the
consecutive slots of their positions, and the rest of the tree never reaches the cache. A
drafter grows its tree over several passes, a depth each: the nodes' keys and values are
held beside the buffers (`KVCache.tree`, a small [B, R, G, D] per layer), each pass putting
its own there and attending to them, and are dropped when the tree is grown.

Each buffer is head-major, [B, G, S, D]: a kv head's slots lie together, as attention reads
them (a block of slots is one [block, D] tile per head: a decode kernel's layout, and the
one XLA gives a token-major [B, S, G, D] buffer inside a program, relaying the whole cache
in and out at every program's edge otherwise: docs/bench/gpu_compiled.txt). A pass's own
keys come token-major, [B, T, G, D], and are written in place.

Latent attention's cache (DeepSeek-V3: models/mla.py) holds one key a token a layer, the
latent and the rotary key ([B, 1, S, r + rope]), and value buffers of zero width
[B, 1, S, 0]: its values are its keys (`latent`), which attention reads from the key
buffer (attention.values). Every write, page, tree and commit below treats the empty
value buffers as it treats any other: they cost nothing and move nothing.

A paged cache (PagedAttention) holds each layer's keys in a pool of pages shared by its
rows, [P, G, page, D] (a kv head's slots of one page together), and a page table per row,
`pages` int32 [B, M]: row b's slot s lies at slot s % page of page pages[b, s // page].
Slots, lengths, trees and commits mean what they mean for row buffers; `write` and
`page_blocks` translate slots to pages, and a row reads only the pages its table names.
Which pages a row holds is the host's business (serve/pages.py).

The cache knows nothing about models beyond their shapes, nor about decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.config import ModelConfig


@struct.dataclass
class KVCache:
    """One key and one value buffer per layer, each its own array: a layer's attention reads
    its buffer whole and in place (a slice of a stacked [L, ...] buffer would be copied
    before an attention kernel could read it)."""

    k: tuple[jax.Array, ...]  # L x [B, G, S, D]
    v: tuple[jax.Array, ...]  # L x [B, G, S, D]
    lengths: jax.Array  # int32 [B]: slots < lengths[b] hold valid entries
    # A tree in flight while a drafter grows it (`hold_tree`): its R nodes' keys and values,
    # L x [B, R, G, D], beside the buffers; None otherwise.
    tree: "Pending | None" = None
    # A paged cache's page table, int32 [B, M] (the buffers are then pools L x [P, G, page,
    # D]); None: the buffers are rows, L x [B', G, S, D].
    pages: jax.Array | None = None

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
        G, D_k, D_v = config.cache_dims()
        layers = range(config.num_layers)
        return cls(k=tuple(jnp.zeros((batch, G, max_len, D_k), dtype) for _ in layers),
                   v=tuple(jnp.zeros((batch, G, max_len, D_v), dtype) for _ in layers),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def latent(self) -> bool:
        """Whether its values are its keys (zero-width value buffers: latent attention's)."""
        return self.v[0].shape[-1] == 0

    @classmethod
    def init_paged(cls, config: ModelConfig, batch: int, num_pages: int, page_size: int, table_width: int,
                   dtype=jnp.float32) -> "KVCache":
        """A paged cache: pools of num_pages pages of page_size slots, and a page table of
        table_width pages per row, every entry the null page 0 (serve/pages.py)."""
        return cls.init(config, batch, 1, dtype).in_pages(num_pages, page_size, table_width)

    def in_pages(self, num_pages: int, page_size: int, table_width: int) -> "KVCache":
        """A paged cache of this one's layers, heads, dtype and lengths (its entries not
        kept): pools of num_pages pages of page_size slots, every row's table of table_width
        pages the null page 0. Inside a program, this cache's buffers are then never made."""
        def pool(buffer):  # [B', G, S, D] -> [P, G, page, D]
            return jnp.zeros((num_pages, buffer.shape[1], page_size, buffer.shape[3]), buffer.dtype)
        return self.replace(k=tuple(map(pool, self.k)), v=tuple(map(pool, self.v)), tree=None,
                            pages=jnp.zeros((self.lengths.shape[0], table_width), jnp.int32))

    @staticmethod
    def nbytes(config: ModelConfig, batch: int, slots: int, dtype) -> int:
        """Bytes of the keys and values of `slots` positions of `batch` rows, every layer: what
        `init` allocates for max_len=slots, or what a pass reads of a cache that long."""
        G, D_k, D_v = config.cache_dims()
        return config.num_layers * batch * slots * G * (D_k + D_v) * jnp.dtype(dtype).itemsize

    @property
    def max_len(self) -> int:
        """Slots a row can hold: a row buffer's length, or a page table's pages' slots."""
        return self.k[0].shape[2] * (1 if self.pages is None else self.pages.shape[1])

    def hold_tree(self, batch: int, nodes: int) -> "KVCache":
        """The cache with room beside its buffers for a tree of `nodes` nodes over its first
        `batch` rows, which passes under a Placement with an `offset` fill and attend to
        (zeros: a node is seen only once a pass put it there). `drop_tree` lets it go."""
        def room(buffer):  # [B', G, S, D] -> [batch, nodes, G, D]
            return jnp.zeros((batch, nodes, buffer.shape[1], buffer.shape[3]), buffer.dtype)
        return self.replace(tree=Pending(tuple(map(room, self.k)), tuple(map(room, self.v))))

    def drop_tree(self) -> "KVCache":
        return self.replace(tree=None)

    def held_tree(self) -> "Pending":
        """The held tree, which a pass under a Placement with an offset joins its keys to."""
        if self.tree is None:
            raise ValueError("a placement with an offset puts its keys in the cache's held tree: "
                             "KVCache.hold_tree first")
        return self.tree

    def with_tree(self, k, v) -> "KVCache":
        """The cache with its held tree's first len(k) layers replaced (an early exit runs only
        its first layers)."""
        tree = self.held_tree()
        return self.replace(tree=Pending(tuple(k) + tree.k[len(k):], tuple(v) + tree.v[len(v):]))


def page_blocks(pool: jax.Array, pages: jax.Array, first, count: int) -> jax.Array:
    """Slots first * page .. (first + count) * page - 1 of every row, read from their pages:
    pool [P, G, page, D], pages int32 [B, M], first int32 [] (a page index; entries past the
    table repeat its last page, whose slots the caller masks) -> [B, G, count * page, D]. A
    gather of B * count pages: nothing else of the pool is read."""
    B, M = pages.shape
    _, G, size, D = pool.shape
    ids = jnp.take(pages, jnp.clip(first + jnp.arange(count), 0, M - 1), axis=1)  # [B, count]
    return jnp.swapaxes(pool[ids], 1, 2).reshape(B, G, count * size, D)  # [B, count, G, page, D] -> rows


def paste_row(cache: KVCache, slot, row: KVCache, pages) -> KVCache:
    """A paged cache with one prefilled row (a row-buffer cache [1, G, b, D] a layer) written
    into the pages `pages` int32 [M] (its first b / page of them; the rest of the row is
    stale by the loop's invariant) and its length into row `slot`."""
    size, width = cache.k[0].shape[2], pages.shape[0]
    n = min(row.max_len // size, width)  # (the caller's rows are a whole number of pages)
    ids = pages[:n]

    def paste(pool, buffer):  # [P, G, page, D] <- [1, G, n page, D]
        G, D = buffer.shape[1], buffer.shape[3]
        return pool.at[ids].set(buffer[0, :, :n * size].reshape(G, n, size, D).swapaxes(0, 1).astype(pool.dtype))

    return cache.replace(k=tuple(map(paste, cache.k, row.k)), v=tuple(map(paste, cache.v, row.v)),
                         lengths=cache.lengths.at[slot].set(row.lengths[0]))


def read(buffer: jax.Array, slots: jax.Array, pages: jax.Array | None = None) -> jax.Array:
    """The entries at slots int32 [B, T] of each row (slots past the buffer clipped to its
    last): buffer [B', G, S, D] (rows [:B] read), or with a page table pages [B, M] a pool
    [P, G, page, D], read through the table -> [B, T, G, D]."""
    rows = jnp.arange(slots.shape[0])[:, None]  # [B, 1]
    if pages is None:
        return buffer[rows, :, jnp.minimum(slots, buffer.shape[2] - 1)]
    size, width = buffer.shape[2], pages.shape[1]
    slots = jnp.minimum(slots, size * width - 1)
    return buffer[pages[rows, slots // size], :, slots % size]


def join(held: jax.Array, new: jax.Array, offset) -> jax.Array:
    """A held tree's layer [B, R, G, D] with a pass's new entries [B, T, G, D] at nodes
    offset .. offset + T-1 (one dynamic_update_slice)."""
    return jax.lax.dynamic_update_slice_in_dim(held, new.astype(held.dtype), offset, axis=1)


def write(buffer: jax.Array, new: jax.Array, slots: jax.Array, consecutive: bool = False,
          pages: jax.Array | None = None) -> jax.Array:
    """Writes new[b, t] into buffer[b, slots[b, t]]: each row at its own offset (with a page
    table pages [B, M], into the pool buffer [P, G, page, D] at the slot's page: one scatter,
    writes at slots past the table dropped; consecutive, one dynamic_update_slice of a token's
    entry [1, G, 1, D] a token, B T of them unrolled, writes past the table going to the null
    page 0: around the scatter XLA relaid the whole pool out, every layer's, in a TPU engine
    call, and not around these (tests/test_aot.py)).

    buffer [B', G, S, D] (one layer's; B' >= B: rows past B untouched), new [B, T, G, D],
    slots int32 [B, T]. One scatter
    into the carried buffer (in place inside a loop); writes at slots >= S are dropped.
    consecutive: every row's T slots follow one another (all of specjax's passes write so:
    a chunk, a chain, a tree's verification block, a draft frontier) and end within S; then
    each row is one dynamic_update_slice of T entries from slots[b, 0], B of them, unrolled
    in the trace (compile time grows with B). A TPU program wants that form: around a point
    scatter XLA copies the whole buffer; a fori_loop over rows fails in XLA's TPU compiler
    (docs/bench/engine_aot.txt and cache_write.txt measure both)."""
    new = new.astype(buffer.dtype)
    if pages is not None:
        size, width = buffer.shape[2], pages.shape[1]
        index = slots // size  # [B, T]: the slot's entry in its row's table
        page = jnp.take_along_axis(pages, jnp.clip(index, 0, width - 1), axis=1)
        if consecutive:  # an entry [1, G, 1, D] a token, B T of them, unrolled (past the table: the null page 0)
            page, slot = jnp.where(index < width, page, 0), slots % size
            heads_first = jnp.swapaxes(new, 1, 2)  # [B, G, T, D]
            for b in range(new.shape[0]):
                for t in range(new.shape[1]):
                    buffer = jax.lax.dynamic_update_slice(buffer, heads_first[b:b + 1, :, t:t + 1],
                                                          (page[b, t], 0, slot[b, t], 0))
            return buffer
        page = jnp.where(index < width, page, buffer.shape[0])  # past the table: out of the pool, dropped
        return buffer.at[page, :, slots % size].set(new, mode="drop")  # ([B, T, G, D], as below)
    if not consecutive:
        rows = jnp.arange(new.shape[0])[:, None]  # [B, 1]
        return buffer.at[rows, :, slots].set(new, mode="drop")  # (the indexed axes come first: [B, T, G, D])
    for b in range(new.shape[0]):
        buffer = jax.lax.dynamic_update_slice(buffer, jnp.swapaxes(new[b:b + 1], 1, 2), (b, 0, slots[b, 0], 0))
    return buffer


@struct.dataclass
class Placement:
    """What a pass's T tokens see when that is not "slot = position, causal" (token trees):
    the committed prefix (slots < start, which hold their own positions) and, of a region
    of R in-flight keys, those that `sees` marks; no [B, T, S] mask is ever built from it
    (see attention.cached_attention). The region is either the pass's own T tokens (offset
    None: a target's verification of a tree, R = T), whose slots, where the pass writes
    them at all, are start .. start + T-1; or the cache's held tree (`KVCache.tree`), into
    which the pass puts its own at offset .. offset + T-1 (a drafter growing a tree, a depth
    per pass), writing nothing to the buffers."""

    start: jax.Array  # int32 [B]: the first slot past the committed prefix
    region_positions: jax.Array  # int32 [B, R]: the position of each in-flight key
    sees: jax.Array  # bool [B, T, R]: the in-flight keys each token attends to
    offset: jax.Array | None = None  # int32 []: where the pass's tokens go in the held tree (None: own)

    @property
    def own(self) -> bool:
        return self.offset is None

    @property
    def slots(self) -> jax.Array:
        """int32 [B, T]: the slots of an own region's tokens."""
        return self.start[:, None] + jnp.arange(self.sees.shape[1])[None]

    def dense(self, max_len: int) -> tuple[jax.Array, jax.Array]:
        """(kv_positions int32 [B, S], visible bool [B, T, S]) over a cache of max_len slots
        holding an own region at its slots: the placement as one mask, for the passes that
        read their keys back from the whole cache (a kernel's)."""
        R = self.sees.shape[-1]
        s = jnp.arange(max_len)[None, :]  # [1, S]
        r = s - self.start[:, None]  # [B, S]: the slot's index in the region
        in_region = (r >= 0) & (r < R)
        r = jnp.clip(r, 0, R - 1)
        kv_positions = jnp.where(in_region, jnp.take_along_axis(self.region_positions, r, axis=1), s)
        seen = jnp.take_along_axis(self.sees, jnp.broadcast_to(r[:, None, :], self.sees.shape[:2] + r.shape[1:]),
                                   axis=2)
        visible = (s < self.start[:, None])[:, None, :] | (in_region[:, None, :] & seen)
        return kv_positions, visible


def tree_placement(start: jax.Array, region_offsets, sees: jax.Array, offset=None) -> Placement:
    """Tokens that see the whole prefix (slots < start) and, of R in-flight keys, those that
    `sees` marks.

    start int32 [B]; region_offsets int [R] or [B, R]: the position of in-flight key r minus
    start; sees bool [B, T, R]; offset: None (the region is the pass's own T tokens, R = T)
    or where in the cache's held tree the pass puts its own (see Placement)."""
    B, T, R = sees.shape
    offsets = jnp.broadcast_to(jnp.asarray(region_offsets, jnp.int32), (B, R))
    if offset is None and R != T:
        raise ValueError(f"a pass's own region holds its {T} tokens, got {R} in-flight keys")
    return Placement(start=start, region_positions=start[:, None] + offsets, sees=sees,
                     offset=None if offset is None else jnp.asarray(offset, jnp.int32))


@struct.dataclass
class Pending:
    """Keys and values held apart from a cache's buffers, token-major: a pass's own, for its
    caller to write the ones it keeps (`commit`: a verification pass's, of which only the
    accepted path stays; transformer.decode's `defer`), or a tree in flight (`KVCache.tree`)."""

    k: tuple[jax.Array, ...]  # L x [B, T, G, D]
    v: tuple[jax.Array, ...]  # L x [B, T, G, D]
    # The pass wrote them at its slots too: its attention read them back from the cache (a
    # kernel over the whole cache, or a deterministic pass).
    written: bool = struct.field(pytree_node=False, default=False)


def commit(cache: KVCache, pending: Pending, kept: jax.Array, start: jax.Array, consecutive: bool = False
           ) -> KVCache:
    """Writes the pending entries of the pass's tokens kept int32 [B, M] (row b's kept[b, j]
    to slot start[b] + j; start int32 [B]; they must end within the buffer) into the layers
    the pass ran (every one, but after an early exit), in the buffers' first B rows.
    consecutive: as `write`'s. A tree's root and accepted path are so written to the slots of
    their positions, and the rest of the tree never reaches the cache."""
    rows = jnp.arange(kept.shape[0])[:, None]  # [B, 1]
    slots = start[:, None] + jnp.arange(kept.shape[1])[None, :]  # [B, M]

    def entries(buffer, new):  # [B, M, G, D]
        # Where the pass wrote them (its token t at slot start + t), they are read back from
        # there: XLA fuses the values' producer into the write, which would read the pass's
        # q/k/v projection again (on a GPU, its split-K partial sums: docs/bench/gpu_tree.txt).
        return read(buffer, start[:, None] + kept, cache.pages) if pending.written else new[rows, kept]

    def one(buffers, news):  # L x [B', G, S, D], B' >= B; the first layers' new [B, T, G, D]
        return tuple(write(buffer, entries(buffer, new), slots, consecutive, cache.pages)
                     for buffer, new in zip(buffers, news)) + buffers[len(news):]

    return cache.replace(k=one(cache.k, pending.k), v=one(cache.v, pending.v))


def attention_mask(q_positions: jax.Array, kv_positions: jax.Array,
                   window: int | None = None) -> jax.Array:
    """bool [B, T, S]: a query at position t sees a key at position s iff s <= t, and
    t - s < window when there is one. q_positions [B, T]; kv_positions [B, S] (or [1, S]:
    for a cache, slot s holds position s)."""
    q = q_positions[:, :, None]  # [B, T, 1]
    kv = kv_positions[:, None, :]  # [B, 1, S]
    mask = kv <= q
    if window is not None:
        mask &= q - kv < window
    return mask
