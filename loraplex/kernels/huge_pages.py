"""CPU tensors on transparent huge pages: the CPU engine's packed weights and page pools.

A decode step streams every weight once and reads K/V and adapter pages scattered over the
pool. On 4 KiB pages each of those streams crosses a page (and a TLB entry) every 4 KiB, and
the hardware prefetchers stop at page boundaries; on 2 MiB pages neither happens. Measured on
one Zen 4 core (docs/benchmarks.md, "Zen 4, fourth visit"): the bf16 GEMMs on 32 decode rows
with weights out of cache 1.02-1.08x faster (1.05-1.11x with gemm_bf16.c's prefetch of the
next task's panels in both), decode attention 1.06-1.14x.

Memory comes from private anonymous mappings advised ``MADV_HUGEPAGE``, each used from its
first 2 MiB boundary: with THP's ``madvise`` mode (a common default) only such mappings get huge
pages, with ``always`` any, with ``never`` none (these are then ordinary pages, no worse than
``torch.empty``'s). A mapping is zero-filled by the kernel as it is touched. Tensors under
``ARENA_BYTES / 4`` are carved (64-byte aligned) out of shared arenas of ``ARENA_BYTES``, so that
a model's hundreds of packed weights share huge pages instead of each rounding up to its own; a
mapping lives as long as any tensor on it. ``LORAPLEX_HUGE_PAGES=0``, a platform without
``MADV_HUGEPAGE`` or a failed mapping gives plain ``torch.empty`` / ``torch.zeros`` tensors.
"""

from __future__ import annotations

import functools
import logging
import math
import mmap
import sys
import threading
from collections.abc import Sequence

import torch

from loraplex.server import env

logger = logging.getLogger(__name__)

__all__ = ["ARENA_BYTES", "HUGE_PAGE", "empty", "enabled", "zeros"]

HUGE_PAGE = 2 << 20
ARENA_BYTES = 64 << 20
_ALIGN = 64

_lock = threading.Lock()
_arena: torch.Tensor | None = None  # uint8 view of the current arena from its 2 MiB boundary
_arena_used = 0
_failed = False  # a mapping failed: plain tensors from then on (one warning, not one a weight)


@functools.cache
def _supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


def enabled() -> bool:
    """Whether ``empty`` and ``zeros`` map memory advised for huge pages (Linux, the switch on)."""
    return _supported() and not _failed and env.huge_pages()


def _mapping(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` bytes (uint8) of a fresh mapping from its first 2 MiB boundary, advised for
    huge pages; ``None`` where the mapping fails (and every later call then: ``enabled()``
    turns false)."""
    global _failed
    try:
        mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as exc:  # out of address space, or a kernel without THP
        logger.warning("huge-page mapping of %d bytes failed (%s): ordinary pages from now on",
                       nbytes, exc)
        _failed = True
        return None
    # the tensor holds the buffer (and so the mapping) for as long as it or a view lives
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def _bytes(nbytes: int) -> torch.Tensor | None:
    global _arena, _arena_used
    if nbytes > ARENA_BYTES // 4:  # large: a mapping of its own
        return _mapping(nbytes)
    size = -(-nbytes // _ALIGN) * _ALIGN
    with _lock:
        if _arena is None or _arena_used + size > ARENA_BYTES:
            _arena, _arena_used = _mapping(ARENA_BYTES), 0
            if _arena is None:
                return None
        out = _arena[_arena_used:_arena_used + nbytes]
        _arena_used += size
    return out


def empty(shape: int | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor on memory advised for huge pages (see the module
    docstring; ``torch.empty`` where that is off or fails)."""
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not enabled():
        return torch.empty(dims, dtype=dtype)
    nbytes = math.prod(dims) * torch.empty(0, dtype=dtype).element_size()
    raw = _bytes(max(nbytes, 1))
    if raw is None:
        return torch.empty(dims, dtype=dtype)
    return raw[:nbytes].view(dtype).view(dims)


def zeros(shape: int | Sequence[int], dtype: torch.dtype,
          device: torch.device | str = "cpu") -> torch.Tensor:
    """``empty`` filled with zeros (every page touched now, as ``torch.zeros`` does); on a
    device other than the CPU plain ``torch.zeros`` there."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return empty(shape, dtype).zero_()
