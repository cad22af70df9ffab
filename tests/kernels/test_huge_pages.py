"""``loraplex/kernels/huge_pages``: CPU tensors on mappings advised for transparent huge pages.

The tensors are what ``torch.empty`` / ``torch.zeros`` give (shape, dtype, contiguous, writable,
zeros where asked) on memory whose mapping carries the kernel's ``hg`` flag (``MADV_HUGEPAGE``,
read back from ``/proc/self/smaps``); small ones share arenas without overlapping, stay valid
after the arena has moved on, and large ones start on a 2 MiB boundary. The engine's page
pools and the bf16 GEMM's packed weights live there; ``LORAPLEX_HUGE_PAGES=0`` gives plain
tensors."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from loraplex.kernels import cpu_gemm, huge_pages

needs_thp = pytest.mark.skipif(not huge_pages.enabled(),
                               reason="no MADV_HUGEPAGE here (not Linux, or switched off)")


def _advised(t: torch.Tensor) -> bool:
    """Whether the mapping holding ``t``'s first byte has the ``hg`` (MADV_HUGEPAGE) flag."""
    addr, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@needs_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16])
def test_empty_and_zeros_are_advised_tensors_of_the_asked_shape(dtype: torch.dtype) -> None:
    for shape in [(7,), (3, 5, 11), (30, 40, 3072)]:  # arena-sized and one of its own
        t = huge_pages.empty(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.is_cpu
        assert t.data_ptr() % 64 == 0 and _advised(t)
        t.fill_(3)
        assert (t == 3).all()
        z = huge_pages.zeros(shape, dtype)
        assert (z == 0).all() and _advised(z)
    big = huge_pages.empty(huge_pages.ARENA_BYTES, torch.uint8)  # over a quarter arena
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 0 and _advised(big)
    assert huge_pages.empty(0, dtype).shape == (0,)


@needs_thp
def test_small_tensors_do_not_overlap_and_outlive_their_arena() -> None:
    # enough to fill several arenas; each tensor written with its own value, the arena
    # references dropped as it moves on, then every value read back
    n = 3 * huge_pages.ARENA_BYTES // (1 << 20)
    tensors = [huge_pages.empty((1 << 20) // 4 + 3, torch.float32) for _ in range(n)]
    for i, t in enumerate(tensors):
        t.fill_(float(i))
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in tensors)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    gc.collect()
    assert all((t == float(i)).all() for i, t in enumerate(tensors))


@needs_thp
def test_concurrent_allocations_get_disjoint_memory() -> None:
    got: list[torch.Tensor] = []
    lock = threading.Lock()

    def take() -> None:
        mine = [huge_pages.empty(10_000, torch.bfloat16) for _ in range(200)]
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    spans = sorted((t.data_ptr(), t.data_ptr() + 20_000) for t in got)
    assert len(spans) == 800
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_switch_off_gives_plain_tensors(monkeypatch) -> None:
    # Off, no mapping is made at all. (Whether the memory torch then gets carries the flag is
    # the allocator's history: in one full-suite run a plain 16 MiB torch.zeros landed on
    # memory with it, so the test checks that nothing here maps or advises.)
    def refuse(nbytes: int) -> None:
        raise AssertionError("a huge-page mapping with the switch off")

    monkeypatch.setattr(huge_pages, "_mapping", refuse)
    monkeypatch.setenv("LORAPLEX_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    for size in ((8, 1 << 20), (3, 5)):  # a mapping of its own (32 MiB), an arena's share
        t = huge_pages.zeros(size, torch.float32)
        assert t.shape == size and t.is_contiguous() and (t == 0).all()
        assert huge_pages.empty(size, torch.bfloat16).shape == size
    monkeypatch.delenv("LORAPLEX_HUGE_PAGES")
    if huge_pages.enabled():  # on again, the same call maps (the guard above is live)
        with pytest.raises(AssertionError, match="switch off"):
            huge_pages.zeros((8, 1 << 20), torch.float32)


@needs_thp
def test_engine_pools_and_packed_weights_are_on_advised_memory(tmp_path) -> None:
    from loraplex.server.config import EngineConfig
    from loraplex.server.engine.engine import Engine
    from tests.helpers import make_model

    engine = Engine(EngineConfig(model=str(make_model(tmp_path / "m")), num_pages=32))
    try:
        assert _advised(engine.runner.pools)
    finally:
        engine.close()
    if cpu_gemm.bf16_available():
        packed = cpu_gemm.pack(torch.randn(96, 64).to(torch.bfloat16))
        assert _advised(packed.data)


@needs_thp
def test_a_failed_mapping_falls_back_once_for_good(monkeypatch) -> None:
    import mmap

    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    monkeypatch.setattr(huge_pages, "_arena", None)
    monkeypatch.setattr(huge_pages, "_failed", False)
    first = huge_pages.zeros((3, 4), torch.float32)
    assert first.shape == (3, 4) and (first == 0).all() and not _advised(first)
    assert not huge_pages.enabled() and len(calls) == 1
    second = huge_pages.empty(huge_pages.ARENA_BYTES, torch.uint8)  # no second try
    assert second.numel() == huge_pages.ARENA_BYTES and len(calls) == 1


def test_zeros_off_the_cpu_is_torch_zeros_there() -> None:
    meta = huge_pages.zeros((2, 3), torch.float32, "meta")  # any non-CPU device takes torch's path
    assert meta.device.type == "meta" and meta.shape == (2, 3)
