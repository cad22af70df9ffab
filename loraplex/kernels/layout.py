"""Where things sit inside the unified page pool: the seam between the pager, the LoRA path
and the kernels (design.md §3, "The page layout").

Each layer owns a pool tensor ``[num_pages, page_elems]``; a page id names the same slot in
every layer.

* A KV page holds ``page_size`` tokens of K then V for its layer, viewed as
  ``[2, page_size, num_kv_heads, head_dim]``, so ``page_elems = 2 * page_size * num_kv_heads *
  head_dim``.
* An adapter holding pages ``p_0, p_1, ...`` owns, in every layer, the flat region those pages
  make when laid end to end. Per target module (in canonical order) it stores ``A`` as ``r``
  rows of ``d_in`` and then ``B^T`` as ``r`` rows of ``d_out``; each block starts on a multiple
  of ``ALIGN`` elements. Element ``e`` of the region lives at
  ``pool[layer][pages[e // page_elems], e % page_elems]``; a row may cross a page boundary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

# Blocks start on 16-element boundaries (64 bytes in fp32, 32 in fp16): aligned vector loads.
ALIGN = 16


def kv_page_elems(page_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Elements of one page: ``page_size`` tokens of K and V for one layer."""
    return 2 * page_size * num_kv_heads * head_dim


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class AdapterLayout:
    """Offsets of each module's ``A`` and ``B^T`` rows inside an adapter's per-layer region.

    Attributes:
        rank: the adapter's rank ``r``.
        modules: target modules, canonical order.
        a_offsets / b_offsets: module -> element offset of its ``A`` (``[r, d_in]``) and
            ``B^T`` (``[r, d_out]``) block in the region.
        num_elems: elements the region needs per layer.
    """

    rank: int
    modules: tuple[str, ...]
    a_offsets: Mapping[str, int]
    b_offsets: Mapping[str, int]
    num_elems: int

    def num_pages(self, page_elems: int) -> int:
        """Pages the adapter takes (in every layer's pool)."""
        return -(-self.num_elems // page_elems)


def adapter_layout(
    rank: int, modules: Sequence[str], module_shapes: Mapping[str, tuple[int, int]]
) -> AdapterLayout:
    """Lay out an adapter of ``rank`` over ``modules``; ``module_shapes[m] = (d_in, d_out)``."""
    if rank < 1:
        raise ValueError(f"rank: must be >= 1, got {rank}")
    a_offsets: dict[str, int] = {}
    b_offsets: dict[str, int] = {}
    offset = 0
    for module in modules:
        if module not in module_shapes:
            raise ValueError(f"modules: unknown module {module!r}")
        d_in, d_out = module_shapes[module]
        a_offsets[module] = offset
        offset = _align(offset + rank * d_in)
        b_offsets[module] = offset
        offset = _align(offset + rank * d_out)
    return AdapterLayout(rank, tuple(modules), a_offsets, b_offsets, offset)


def region_index(pages: Sequence[int] | torch.Tensor, page_elems: int, offset: int,
                 numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page ids, in-page offsets) of region elements ``[offset, offset + numel)``."""
    pages_t = torch.as_tensor(pages, dtype=torch.long)
    elems = torch.arange(offset, offset + numel, dtype=torch.long)
    return pages_t[elems // page_elems], elems % page_elems


def read_region(pool: torch.Tensor, pages: Sequence[int] | torch.Tensor, offset: int,
                numel: int) -> torch.Tensor:
    """Copy of region elements ``[offset, offset + numel)`` of one layer's ``pool``."""
    page_ids, within = region_index(pages, pool.shape[1], offset, numel)
    return pool[page_ids.to(pool.device), within.to(pool.device)]


def write_region(pool: torch.Tensor, pages: Sequence[int] | torch.Tensor, offset: int,
                 values: torch.Tensor) -> None:
    """Write ``values`` (flattened) into the region at ``offset`` of one layer's ``pool``."""
    flat = values.reshape(-1)
    page_ids, within = region_index(pages, pool.shape[1], offset, flat.numel())
    pool[page_ids.to(pool.device), within.to(pool.device)] = flat.to(pool.dtype)
