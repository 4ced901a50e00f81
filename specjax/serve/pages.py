"""`PagePool`: the host's account of a paged KV cache's pages (PagedAttention's allocator).

A paged cache (cache.py, `KVCache.pages`) keeps each layer's keys and values in a pool of
`num_pages` pages of `page_size` slots, shared by every row; a row's page table lists the
pages its slots lie in, in order (slot s of the row is slot s % page_size of page
table[s // page_size]). Page 0 is the pool's null page: never handed out, it is where a
table's unused entries point, so that a write past a row's pages lands there harmlessly
(no query sees it: a row's reads stop at its own length).

This module hands pages out and takes them back, one owner (a request) at a time: an
owner grows by the pages its next tokens need, never beyond what it asked for at most,
and gives them all back when it ends. It knows nothing of devices, models or requests'
contents; the engine turns its tables into the int32 [rows, pages] array its programs read.
"""

from __future__ import annotations

import numpy as np

NULL_PAGE = 0


def pages_for(tokens: int, page_size: int) -> int:
    """How many pages hold `tokens` slots."""
    return -(-int(tokens) // page_size)


class OutOfPages(Exception):
    """Raised by `PagePool.grow` where the free pages do not cover what is asked: the caller
    preempts or waits (nothing was taken)."""


class PagePool:
    """num_pages pages of page_size slots (page 0 the null page), handed to owners."""

    def __init__(self, num_pages: int, page_size: int):
        if page_size < 1 or num_pages < 2:
            raise ValueError(f"a page pool needs page_size >= 1 and num_pages >= 2 (page 0 is the null page), "
                             f"got {page_size} and {num_pages}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self._free = list(range(self.num_pages - 1, 0, -1))  # popped from the end: low pages first
        self._owned: dict = {}  # owner -> its pages, in slot order

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Slots the pool can hand out (all pages but the null page)."""
        return (self.num_pages - 1) * self.page_size

    def pages(self, owner) -> list[int]:
        """The owner's pages in slot order (none: [])."""
        return list(self._owned.get(owner, ()))

    def fits(self, tokens: int) -> bool:
        """Whether an owner of `tokens` slots could ever be held (the whole pool free)."""
        return pages_for(tokens, self.page_size) <= self.num_pages - 1

    def grow(self, owner, tokens: int) -> list[int]:
        """The owner's pages made enough for `tokens` slots (taking free pages; never
        shrinking), -> its pages. Raises OutOfPages, taking nothing, where too few are free."""
        held = self._owned.setdefault(owner, [])
        more = pages_for(tokens, self.page_size) - len(held)
        if more > len(self._free):
            if not held:
                del self._owned[owner]
            raise OutOfPages(f"{more} more pages wanted, {len(self._free)} free of {self.num_pages - 1}")
        for _ in range(max(more, 0)):
            held.append(self._free.pop())
        return list(held)

    def release(self, owner) -> int:
        """Gives all of the owner's pages back; -> how many."""
        held = self._owned.pop(owner, [])
        self._free.extend(reversed(held))
        return len(held)

    def stats(self) -> dict:
        """Its size, what is free, and the share held (vLLM's kv_cache_usage_perc)."""
        held = self.num_pages - 1
        return {"kv_pages": held, "page_size": self.page_size, "kv_capacity_tokens": self.capacity_tokens,
                "free_pages": self.free_pages, "kv_cache_usage": round(1 - self.free_pages / held, 4)}

    def table(self, owners: list, width: int) -> np.ndarray:
        """int32 [len(owners), width]: each owner's pages in slot order, then the null page
        (an owner of None: a row of null pages). Raises where an owner holds more than width."""
        out = np.full((len(owners), width), NULL_PAGE, np.int32)
        for row, owner in enumerate(owners):
            held = self._owned.get(owner, ()) if owner is not None else ()
            if len(held) > width:
                raise ValueError(f"row {row} holds {len(held)} pages, more than the table's {width}")
            out[row, :len(held)] = held
        return out
