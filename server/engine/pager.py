"""The unified page pool: one budget for KV blocks, adapter weights and cached prefixes.

The pager counts pages and records who owns each; it never looks inside one (the layout is
``loraplex/kernels/layout.py``'s business). Two kinds of holder:

* a request's KV pages, allocated and freed by the scheduler (refcounted, so a page can be
  shared by several requests: the n sequences of one prompt hold its pages once, and the one
  that writes a shared page first gets a copy, ``copy_on_write``);
* *entries*: named groups of pages that outlive the requests using them (an adapter's
  weights by digest, a cached prefix page by hash). An entry is pinned while in use; an
  unpinned entry stays resident, in LRU order, until its pages are needed by anyone else.

Allocation evicts unpinned entries, least recently used first, when free pages run short;
the owner of an evicted entry hears of it through the callback registered for its kind.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass


class PageKind(enum.Enum):
    FREE = "free"
    KV = "kv"
    ADAPTER = "adapter"
    PREFIX = "prefix"


@dataclass(frozen=True)
class PagerStats:
    num_pages: int
    num_free: int
    num_kv: int
    num_adapter: int
    num_prefix: int
    num_evictable: int
    num_evictions: int


@dataclass
class _Entry:
    kind: PageKind
    pages: list[int]
    pins: int


class OutOfPages(RuntimeError):
    """Raised when an allocation cannot be met even after evicting every unpinned entry."""


class Pager:
    """Owner of ``num_pages`` page ids ``0 .. num_pages - 1``."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages: must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._kind = [PageKind.FREE] * num_pages
        self._refs = [0] * num_pages
        self._entries: dict[Hashable, _Entry] = {}
        self._page_entry: dict[int, Hashable] = {}  # page -> key, for one-page entries
        self._lru: OrderedDict[Hashable, None] = OrderedDict()  # unpinned entries, oldest first
        self._num_evictable = 0
        self._num_evictions = 0
        self._on_evict: dict[PageKind, Callable[[Hashable], None]] = {}
        self._counts = {kind: 0 for kind in PageKind}
        self._counts[PageKind.FREE] = num_pages

    # -- allocation -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def num_allocatable(self) -> int:
        """Pages an allocation could get now: free ones plus those of unpinned entries."""
        return len(self._free) + self._num_evictable

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_allocatable()

    def allocate(self, num_pages: int, kind: PageKind = PageKind.KV) -> list[int]:
        """Take ``num_pages`` pages (evicting LRU unpinned entries if needed), refcount 1."""
        if num_pages > self.num_allocatable():
            raise OutOfPages(f"need {num_pages} pages, {self.num_allocatable()} allocatable")
        while len(self._free) < num_pages:
            self._evict_lru()
        pages = [self._free.popleft() for _ in range(num_pages)]
        for p in pages:
            self._kind[p] = kind
            self._refs[p] = 1
        self._counts[PageKind.FREE] -= num_pages
        self._counts[kind] += num_pages
        return pages

    def share(self, page_ids: list[int]) -> None:
        """Add a holder to pages another holder already owns (a cached prefix page is pinned
        once more instead, so that ``free`` stays its exact inverse)."""
        for p in page_ids:
            key = self._page_entry.get(p)
            if key is not None:
                self.pin(key)
                continue
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} is free")
            self._refs[p] += 1

    def is_shared(self, page: int) -> bool:
        """Whether a KV page has holders besides the asking one (writing it needs a copy)."""
        return self._page_entry.get(page) is None and self._refs[page] > 1

    def copy_on_write(self, page: int) -> int | None:
        """Make ``page`` writable for one of its holders: when others hold it too, that
        holder gets a fresh page (refcount 1) in its place and drops its reference to the old
        one; the caller copies the contents. Returns the new page, or None when the holder
        was alone (it writes in place).

        Raises:
            OutOfPages: no page to copy into.
        """
        if not self.is_shared(page):
            return None
        [fresh] = self.allocate(1, self._kind[page])
        self._refs[page] -= 1
        return fresh

    def free(self, page_ids: list[int]) -> None:
        """Drop one reference to each page; pages nobody references return to the pool.
        A page that became a one-page entry (a cached prefix page) is unpinned instead, and
        stays resident until evicted."""
        for p in page_ids:
            key = self._page_entry.get(p)
            if key is not None:
                self.unpin(key)
                continue
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} freed twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._counts[self._kind[p]] -= 1
                self._counts[PageKind.FREE] += 1
                self._kind[p] = PageKind.FREE
                self._free.append(p)

    # -- entries (adapters, cached prefixes) ------------------------------------------------
    def on_evict(self, kind: PageKind, callback: Callable[[Hashable], None]) -> None:
        """Call ``callback(key)`` whenever an entry of ``kind`` is evicted."""
        self._on_evict[kind] = callback

    def add_entry(self, key: Hashable, kind: PageKind, num_pages: int,
                  pinned: bool = True) -> list[int]:
        """Allocate pages for a new entry; it starts pinned (in use) unless told otherwise."""
        if key in self._entries:
            raise ValueError(f"entry {key!r} exists")
        pages = self.allocate(num_pages, kind)
        self._entries[key] = _Entry(kind, pages, 0)
        if pinned:
            self._entries[key].pins = 1
        else:
            self._lru[key] = None
            self._num_evictable += num_pages
        return list(pages)

    def promote(self, page: int, key: Hashable, kind: PageKind = PageKind.PREFIX) -> None:
        """Turn one KV page held by a single request into a one-page entry pinned by that
        request (a cached prefix page): later ``free`` of the page unpins it, and once no
        request holds it, it stays cached until evicted."""
        if key in self._entries:
            raise ValueError(f"entry {key!r} exists")
        if self._refs[page] != 1 or self._kind[page] is not PageKind.KV:
            raise ValueError(f"page {page} is not a KV page with one holder")
        self._counts[PageKind.KV] -= 1
        self._counts[kind] += 1
        self._kind[page] = kind
        self._entries[key] = _Entry(kind, [page], 1)
        self._page_entry[page] = key

    def pin(self, key: Hashable) -> None:
        entry = self._entries[key]
        if entry.pins == 0:
            del self._lru[key]
            self._num_evictable -= len(entry.pages)
        entry.pins += 1

    def unpin(self, key: Hashable) -> None:
        entry = self._entries[key]
        if entry.pins <= 0:
            raise ValueError(f"entry {key!r} is not pinned")
        entry.pins -= 1
        if entry.pins == 0:
            self._lru[key] = None  # most recently used end
            self._num_evictable += len(entry.pages)

    def pins(self, key: Hashable) -> int:
        return self._entries[key].pins

    def _evict_lru(self) -> None:
        key, _ = self._lru.popitem(last=False)
        entry = self._entries.pop(key)
        self._num_evictable -= len(entry.pages)
        self._num_evictions += 1
        self._release_entry_pages(entry)
        callback = self._on_evict.get(entry.kind)
        if callback is not None:
            callback(key)

    def _release_entry_pages(self, entry: _Entry) -> None:
        for p in entry.pages:
            self._page_entry.pop(p, None)
        self.free(entry.pages)

    def stats(self) -> PagerStats:
        c = self._counts
        return PagerStats(self.num_pages, c[PageKind.FREE], c[PageKind.KV], c[PageKind.ADAPTER],
                          c[PageKind.PREFIX], self._num_evictable, self._num_evictions)
