"""`PagePool`: the host's account of a paged KV cache's pages (PagedAttention's allocator).

A paged cache (cache.py, `KVCache.pages`) keeps each layer's keys and values in a pool of
`num_pages` pages of `page_size` slots, shared by every row; a row's page table lists the
pages its slots lie in, in order (slot s of the row is slot s % page_size of page
table[s // page_size]). Page 0 is the pool's null page: never handed out, it is where a
table's unused entries point, so that a write past a row's pages lands there harmlessly
(no query sees it: a row's reads stop at its own length).

This module hands pages out and takes them back, one owner (a request) at a time: an
owner grows by the pages its next tokens need, never beyond what it asked for at most,
and gives them all back when it ends. With prefix caching, a full page an owner wrote
may be kept under a key (`page_keys`: a hash of the tokens that decide its contents):
another owner whose tokens give the same key shares it (`share`: pages are counted by
the owners holding them), and a kept page no owner holds stays cached until the free
pages run out, the least recently used evicted first (vLLM's automatic prefix caching).
It knows nothing of devices or models; the engine turns its tables into the int32 [rows,
pages] array its programs read, and says which pages are written (`register`).
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

NULL_PAGE = 0


def cached_pages(length: int, page_size: int) -> int:
    """How many of the first full pages of a context of `length` tokens may be cached or
    shared: those whose positions, and the one after them, lie below length - 2. A row's
    later passes write from position length - 2 on (an EAGLE layer re-feeds its last pair;
    the target's cache from length - 1), so such a page is never written again; and a
    drafter's entry at a page's last position may read the next token (EAGLE's pairs)."""
    return max(0, (int(length) - 2) // page_size)


def page_keys(tokens, page_size: int, salt: bytes = b"", count: int | None = None) -> list[bytes]:
    """The keys of the first `count` full pages of a context of tokens (None: its
    `cached_pages`; at most those followed by a token): page j's is a hash of page j-1's key
    (salt for the first: what else decides the contents, e.g. the model), the page's tokens
    and the token after it; equal keys, equal contents."""
    tokens = np.asarray(tokens, np.int32)
    keys, previous = [], hashlib.blake2b(salt, digest_size=16).digest()
    most = (tokens.size - 1) // page_size
    for j in range(cached_pages(tokens.size, page_size) if count is None else min(count, most)):
        previous = hashlib.blake2b(previous + tokens[j * page_size:(j + 1) * page_size + 1].tobytes(),
                                   digest_size=16).digest()
        keys.append(previous)
    return keys


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
        self._free = list(range(self.num_pages - 1, 0, -1))  # neither held nor cached; popped from the end
        self._owned: dict = {}  # owner -> its pages, in slot order
        self._holders: collections.Counter = collections.Counter()  # page -> owners holding it
        self._page_of: dict[bytes, int] = {}  # key -> the cached page holding its contents
        self._key_of: dict[int, bytes] = {}  # the reverse
        self._idle: collections.OrderedDict = collections.OrderedDict()  # cached, unheld: least recently used first
        self.queries = self.hits = 0  # tokens looked up in the cache, and found (`share`)

    @property
    def free_pages(self) -> int:
        """Pages an owner may take: free ones, and cached ones no owner holds (evicted then)."""
        return len(self._free) + len(self._idle)

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
        if more > self.free_pages:
            if not held:
                del self._owned[owner]
            raise OutOfPages(f"{more} more pages wanted, {self.free_pages} free of {self.num_pages - 1}")
        for _ in range(max(more, 0)):
            page = self._free.pop() if self._free else self._evict()
            self._holders[page] += 1
            held.append(page)
        return list(held)

    def _evict(self) -> int:
        """The least recently used cached page no owner holds, forgotten."""
        page, _ = self._idle.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        return page

    def share(self, owner, keys: list[bytes]) -> int:
        """An owner that holds nothing takes the cached pages of its longest run of keys
        (`page_keys`) from the first; -> how many pages. Counts the tokens looked up and found."""
        if self._owned.get(owner):
            raise ValueError("an owner shares cached pages before it holds any")
        held = self._owned.setdefault(owner, [])
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            self._idle.pop(page, None)
            self._holders[page] += 1
            held.append(page)
        return len(held)

    def count(self, queried: int, hit: int):
        """Tokens an admitted request looked up in the cache, and found (vLLM's metrics)."""
        self.queries += int(queried)
        self.hits += int(hit)

    def register(self, owner, keys: list[bytes]):
        """The owner's first len(keys) pages are written with the contents those keys name:
        each is cached under its key (where no other page is already)."""
        for page, key in zip(self._owned.get(owner, ()), keys):
            if page not in self._key_of and key not in self._page_of:
                self._page_of[key], self._key_of[page] = page, key

    def reset(self):
        """Every page free again, held or cached: the device's state was made anew (its pages'
        contents are lost and its rows hold none)."""
        self._free = list(range(self.num_pages - 1, 0, -1))
        self._owned.clear()
        self._holders.clear()
        self._idle.clear()
        self._page_of.clear()
        self._key_of.clear()

    def cached(self) -> dict[bytes, int]:
        """key -> the cached page holding its contents."""
        return dict(self._page_of)

    def owners(self) -> list:
        """Every owner holding pages."""
        return [owner for owner, held in self._owned.items() if held]

    def check(self):
        """Raises AssertionError where its account is broken: each page is free, cached and
        idle, or held (by as many owners as list it), never two of these; the null page never
        handed out; keys and cached pages one to one."""
        held = collections.Counter(page for pages in self._owned.values() for page in pages)
        assert held == +self._holders, "a page's holders differ from the owners listing it"
        assert all(len(set(pages)) == len(pages) for pages in self._owned.values()), "an owner lists a page twice"
        free, idle = set(self._free), set(self._idle)
        assert len(free) == len(self._free), "a page is free twice"
        assert not free & idle and not free & set(held) and not idle & set(held), "a page is in two states"
        assert free | idle | set(held) == set(range(1, self.num_pages)), "a page is lost (or the null page given out)"
        assert idle <= set(self._key_of), "an idle page is not cached"
        assert {self._page_of[k]: k for k in self._page_of} == self._key_of, "keys and cached pages differ"

    def release(self, owner) -> int:
        """Gives all of the owner's pages back; -> how many. A cached page no other owner
        holds stays cached (its last page the first evicted)."""
        held = self._owned.pop(owner, [])
        for page in reversed(held):
            self._holders[page] -= 1
            if self._holders[page]:
                continue
            del self._holders[page]
            if page in self._key_of:
                self._idle[page] = None
            else:
                self._free.append(page)
        return len(held)

    def holders(self, page: int) -> int:
        """How many owners hold a page."""
        return self._holders[page]

    def stats(self) -> dict:
        """Its size, what is free, the share held (vLLM's kv_cache_usage_perc), and the prefix
        cache's pages and counts of tokens."""
        held = self.num_pages - 1
        return {"kv_pages": held, "page_size": self.page_size, "kv_capacity_tokens": self.capacity_tokens,
                "free_pages": self.free_pages, "kv_cache_usage": round(1 - self.free_pages / held, 4),
                "cached_pages": len(self._key_of), "prefix_cache_queries": self.queries,
                "prefix_cache_hits": self.hits}

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
