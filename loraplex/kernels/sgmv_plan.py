"""Launch plans for ``sgmv.py``: block sizes, path (bgmv or sgmv) and grid size of each shrink
or expand launch, chosen on the host from sizes alone (no device sync, no tensors), and the
finite set of them a worker can launch (``shrink_plans`` / ``expand_plans``: every
batch-dependent choice comes from the buckets of ``buckets.py``).

Kept apart from the kernels so that the choice can be read, tested and tuned on its own; the
launchers in ``sgmv.py`` turn a plan into a ``Launch``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import triton

from loraplex.kernels.buckets import (
    MAX_SPLIT_K,
    SEGMENT_BLOCK,
    TILE_SHAPES,
    column_block,
    rank_block,
    rank_blocks,
    tile_shape,
)
from loraplex.kernels.launch import dot_precision
from loraplex.kernels.layout import ALIGN

__all__ = ["SgmvPlan", "check_plan", "expand_constexprs", "expand_plans", "num_tiles",
           "plan_expand", "plan_shrink", "row_align", "shrink_constexprs", "shrink_plans"]


@dataclass(frozen=True)
class SgmvPlan:
    """Block sizes and grid of one shrink or expand launch, chosen on the host from sizes.

    Attributes:
        path: ``"bgmv"`` (one program per token: decode) or ``"sgmv"`` (tiles of ``block_m``
            tokens of one segment: prefill).
        block_m: tokens per tile (``1`` on the bgmv path).
        block_r: rank tile: a power of two, >= 16 (``tl.dot`` minimum on the GPU), <= 64.
        block_d: shrink: ``d_in`` columns per step; expand: ``d_out`` columns per program.
            A power of two in ``[16, page_elems]``, so one step spans at most two pages.
        split_k: shrink only: programs sharing one tile's ``d_in`` loop (atomic float32 adds).
        num_warps: warps per program.
    """

    path: str
    block_m: int
    block_r: int
    block_d: int
    split_k: int = 1
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.path not in ("bgmv", "sgmv"):
            raise ValueError(f"path: must be 'bgmv' or 'sgmv', got {self.path!r}")
        for name in ("block_r", "block_d"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}: must be a power of two >= 16, got {value}")
        if self.path == "sgmv" and (self.block_m < 16 or self.block_m & (self.block_m - 1)):
            raise ValueError(f"block_m: must be a power of two >= 16, got {self.block_m}")
        if self.path == "bgmv" and self.block_m != 1:
            raise ValueError(f"block_m: must be 1 on the bgmv path, got {self.block_m}")
        if self.split_k < 1 or self.num_warps < 1:
            raise ValueError("split_k and num_warps must be >= 1")


def _num_warps(path: str, block_r: int, block_d: int) -> int:
    if path == "sgmv":
        return 4
    # bgmv: about 8 elements (16 bytes of 16-bit weights) per thread and load
    return max(1, min(4, block_r * block_d // 1024))


def _expand_warps(block_m: int, path: str, block_r: int, block_d: int) -> int:
    if block_m * block_d >= 8192:
        return 8
    # bgmv's [block_r, block_d] weight tile and its h slice: with 2 warps a 64 x 32 tile
    # spills on sm_90 (tests/kernels/sm90_compile.py --variants), so a warp per 16 ranks
    return max(_num_warps(path, block_r, block_d), block_r // 16 if path == "bgmv" else 1)


def _shrink_want(path: str, block_r: int, few_programs: bool) -> int:
    # bgmv keeps a [block_r, block_d] float32 accumulator per program: ~4096 elements; with few
    # programs, shorter steps, so that more programs can share one row (split-K)
    want = max(32, 4096 // block_r) if path == "bgmv" else 64
    return min(want, 64) if few_programs else want


def _expand_want(path: str, block_r: int) -> int:
    # the widest column tile; the plan halves it (down to 32) until the device is full
    return min(256, max(32, 4096 // block_r)) if path == "bgmv" else 128


def num_tiles(path: str, block_m: int, num_tokens: int, num_segments: int) -> int:
    """Programs along a launch's token axis (the grid's first dimension)."""
    # sgmv: sum of cdiv(len_s, block_m) <= T / block_m + S, and <= T
    if path == "bgmv":
        return num_tokens
    return min(num_tokens, triton.cdiv(num_tokens, block_m) + num_segments)


def plan_shrink(num_tokens: int, num_segments: int, d_in: int, max_rank: int, page_elems: int,
                sms: int) -> SgmvPlan:
    """The shrink launch for these sizes on a device with ``sms`` multiprocessors."""
    path, block_m = tile_shape(num_tokens, num_segments)
    block_r = rank_block(max_rank)
    programs = num_tiles(path, block_m, num_tokens, num_segments) * triton.cdiv(max_rank,
                                                                                block_r)
    few_programs = programs < 4 * sms
    block_d = column_block(_shrink_want(path, block_r, few_programs), d_in, page_elems)
    k_steps = triton.cdiv(d_in, block_d)
    # a memory-bound launch wants several programs per SM to keep enough loads in flight
    split_k = 1
    if few_programs and k_steps >= 4:
        split_k = min(triton.cdiv(4 * sms, programs), k_steps // 2, MAX_SPLIT_K)
    return SgmvPlan(path, block_m, block_r, block_d, split_k, _num_warps(path, block_r, block_d))


def plan_expand(num_tokens: int, num_segments: int, d_out: int, max_rank: int, page_elems: int,
                sms: int) -> SgmvPlan:
    """The expand launch for these sizes on a device with ``sms`` multiprocessors."""
    path, block_m = tile_shape(num_tokens, num_segments)
    block_r = rank_block(max_rank)
    tiles = num_tiles(path, block_m, num_tokens, num_segments)
    want = _expand_want(path, block_r)
    # narrower column tiles until there are enough programs to fill the device
    while want > 32 and tiles * triton.cdiv(d_out, want) < 2 * sms:
        want //= 2
    block_d = column_block(want, d_out, page_elems)
    return SgmvPlan(path, block_m, block_r, block_d,
                    num_warps=_expand_warps(block_m, path, block_r, block_d))


def shrink_plans(d_in: int, page_elems: int, max_rank: int) -> list[SgmvPlan]:
    """One shrink plan per compiled variant a worker serving ranks ``1 .. max_rank`` can launch
    on rows of ``d_in`` (any batch, any device): the closure of ``plan_shrink`` over the
    buckets. ``split_k`` 2 stands for every split above 1 (the count is a runtime argument)."""
    plans = set()
    for path, block_m in TILE_SHAPES:
        for block_r in rank_blocks(max_rank):
            for few_programs in (False, True):
                block_d = column_block(_shrink_want(path, block_r, few_programs), d_in,
                                       page_elems)
                split = few_programs and triton.cdiv(d_in, block_d) >= 4
                plans.add(SgmvPlan(path, block_m, block_r, block_d, 2 if split else 1,
                                   _num_warps(path, block_r, block_d)))
    return sorted(plans, key=repr)


def expand_plans(d_out: int, page_elems: int, max_rank: int) -> list[SgmvPlan]:
    """One expand plan per compiled variant (as ``shrink_plans``, for ``plan_expand``)."""
    plans = set()
    for path, block_m in TILE_SHAPES:
        for block_r in rank_blocks(max_rank):
            want = _expand_want(path, block_r)
            while True:
                block_d = column_block(want, d_out, page_elems)
                plans.add(SgmvPlan(path, block_m, block_r, block_d,
                                   num_warps=_expand_warps(block_m, path, block_r, block_d)))
                if want <= 32:
                    break
                want //= 2
    return sorted(plans, key=repr)


def row_align(d: int, page_elems: int, page_stride: int, pool_start: int) -> int:
    """The alignment hint of weight rows of length ``d`` (``ROW_ALIGN``, in elements).

    Rows start at ``offset + r * d`` with offsets multiples of ``layout.ALIGN``; the hint must
    also divide the page size, the page stride and the pool's start, in elements. All are fixed
    for a worker (every layer's pool starts a multiple of ``page_elems`` after the first)."""
    return math.gcd(ALIGN, d, page_elems, page_stride, pool_start)


def shrink_constexprs(plan: SgmvPlan, dtype: torch.dtype, align: int) -> tuple[str, dict[str, Any]]:
    """(kernel name, compile-time arguments) of the shrink launch for ``plan``."""
    meta: dict[str, Any] = dict(BLOCK_R=plan.block_r, BLOCK_K=plan.block_d,
                                BLOCK_S=SEGMENT_BLOCK, SPLIT=plan.split_k > 1,
                                ROW_ALIGN=align, num_warps=plan.num_warps)
    if plan.path == "bgmv":
        return "_shrink_bgmv_kernel", meta
    meta.update(BLOCK_M=plan.block_m, DOT_PRECISION=dot_precision(dtype))
    return "_shrink_sgmv_kernel", meta


def expand_constexprs(plan: SgmvPlan, dtype: torch.dtype, align: int) -> tuple[str, dict[str, Any]]:
    """(kernel name, compile-time arguments) of the expand launch for ``plan``."""
    meta: dict[str, Any] = dict(BLOCK_R=plan.block_r, BLOCK_N=plan.block_d,
                                BLOCK_S=SEGMENT_BLOCK, ROW_ALIGN=align, num_warps=plan.num_warps)
    if plan.path == "bgmv":
        return "_expand_bgmv_kernel", meta
    meta.update(BLOCK_M=plan.block_m, DOT_PRECISION=dot_precision(dtype))
    return "_expand_sgmv_kernel", meta


def check_plan(plan: SgmvPlan, page_elems: int) -> None:
    """Raises ``ValueError`` if ``plan`` does not fit pages of ``page_elems`` elements."""
    if plan.block_d > page_elems:
        raise ValueError(f"plan.block_d: {plan.block_d} exceeds page_elems {page_elems}; a step "
                         "may span at most two pages")
