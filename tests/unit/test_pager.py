"""The unified pager, with no model: accounting by kind, refcounts, pins, LRU eviction."""

from __future__ import annotations

import pytest

from loraplex.server.engine.pager import OutOfPages, PageKind, Pager


def test_allocate_and_free_return_every_page():
    pager = Pager(8)
    a = pager.allocate(3)
    b = pager.allocate(5)
    assert sorted(a + b) == list(range(8))
    assert pager.stats().num_kv == 8 and pager.num_free == 0
    with pytest.raises(OutOfPages):
        pager.allocate(1)
    pager.free(a)
    pager.free(b)
    assert pager.stats().num_free == 8 and pager.stats().num_kv == 0


def test_shared_pages_free_on_last_reference():
    pager = Pager(4)
    pages = pager.allocate(2)
    pager.share(pages)
    pager.free(pages)
    assert pager.num_free == 2
    pager.free(pages)
    assert pager.num_free == 4
    with pytest.raises(ValueError, match="freed twice"):
        pager.free(pages[:1])


def test_unpinned_entries_are_evicted_lru_first_and_reported():
    pager = Pager(10)
    evicted = []
    pager.on_evict(PageKind.ADAPTER, evicted.append)
    pager.add_entry("a", PageKind.ADAPTER, 3)
    pager.add_entry("b", PageKind.ADAPTER, 3)
    pager.unpin("a")
    pager.unpin("b")
    pager.pin("a")
    pager.unpin("a")  # "a" is now the most recently used
    assert pager.stats().num_adapter == 6 and pager.num_allocatable() == 10
    kv = pager.allocate(6)  # 4 free, so the LRU entry "b" must go
    assert evicted == ["b"] and pager.pins("a") == 0
    with pytest.raises(KeyError):
        pager.pins("b")
    assert pager.stats().num_evictions == 1
    pager.free(kv)


def test_pinned_entries_are_never_evicted():
    pager = Pager(6)
    pager.add_entry("pinned", PageKind.ADAPTER, 4)
    assert not pager.can_allocate(3)
    with pytest.raises(OutOfPages):
        pager.allocate(3)
    assert pager.pins("pinned") == 1
    pager.allocate(2)
    s = pager.stats()
    assert (s.num_adapter, s.num_kv, s.num_free, s.num_evictions) == (4, 2, 0, 0)


def test_entry_pages_need_not_be_contiguous():
    pager = Pager(8)
    kv = [pager.allocate(1) for _ in range(8)]
    for pages in kv[::2]:
        pager.free(pages)  # free 0, 2, 4, 6
    pages = pager.add_entry("x", PageKind.ADAPTER, 4)
    assert sorted(pages) == [0, 2, 4, 6]
    pager.unpin("x")
    assert sorted(pager.allocate(4)) == [0, 2, 4, 6]  # evicting "x" returns its pages
    assert pager.stats().num_evictions == 1


def test_stats_by_kind():
    pager = Pager(10)
    pager.allocate(2)
    pager.add_entry("adapter", PageKind.ADAPTER, 3)
    pager.add_entry("prefix", PageKind.PREFIX, 1, pinned=False)
    s = pager.stats()
    assert (s.num_kv, s.num_adapter, s.num_prefix, s.num_free, s.num_evictable) == (2, 3, 1, 4, 1)


def test_copy_on_write_gives_all_but_the_last_holder_a_page():
    pager = Pager(8)
    [page] = pager.allocate(1)
    pager.share([page, page, page])  # four holders
    assert pager.is_shared(page) and pager.stats().num_kv == 1  # counted once
    fresh = [pager.copy_on_write(page) for _ in range(4)]
    assert fresh[3] is None and None not in fresh[:3]  # the last one writes in place
    assert len(set(fresh[:3]) | {page}) == 4 and pager.stats().num_kv == 4
    assert not pager.is_shared(page)
    pager.free([page, *fresh[:3]])
    assert pager.stats().num_free == 8


def test_sharing_a_cached_prefix_page_pins_it():
    pager = Pager(4)
    [page] = pager.allocate(1)
    pager.promote(page, "k")
    pager.share([page])  # a second holder: one more pin, not a refcount
    assert pager.pins("k") == 2 and not pager.is_shared(page)
    pager.free([page])
    pager.free([page])
    assert pager.pins("k") == 0 and pager.stats().num_evictable == 1
    assert pager.stats().num_prefix == 1  # cached until evicted
