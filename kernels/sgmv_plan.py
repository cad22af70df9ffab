"""Launch plans for ``sgmv.py``: block sizes, path (bgmv or sgmv) and grid size of each shrink
or expand launch, chosen on the host from sizes alone (no device sync, no tensors).

Kept apart from the kernels so that the choice can be read, tested and tuned on its own; the
launchers in ``sgmv.py`` turn a plan into a ``Launch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from loraplex.kernels.launch import floor_pow2

__all__ = ["SgmvPlan", "check_plan", "num_tiles", "plan_expand", "plan_shrink"]


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


def _block_r(max_rank: int) -> int:
    return min(max(16, triton.next_power_of_2(max_rank)), 64)


def _block_d(want: int, d: int, page_elems: int) -> int:
    return max(16, min(want, triton.next_power_of_2(d), floor_pow2(page_elems)))


def _num_warps(path: str, block_r: int, block_d: int) -> int:
    if path == "sgmv":
        return 4
    # bgmv: about 8 elements (16 bytes of 16-bit weights) per thread and load
    return max(1, min(4, block_r * block_d // 1024))


def _tile_shape(num_tokens: int, num_segments: int) -> tuple[str, int]:
    """(path, block_m) for this many tokens per segment on average."""
    per_segment = num_tokens / num_segments
    if per_segment < 4:  # mostly single-token segments: a 16-row dot tile would be mostly empty
        return "bgmv", 1
    return "sgmv", 16 if per_segment < 32 else 32 if per_segment < 64 else 64


def num_tiles(path: str, block_m: int, num_tokens: int, num_segments: int) -> int:
    """Programs along a launch's token axis (the grid's first dimension)."""
    # sgmv: sum of cdiv(len_s, block_m) <= T / block_m + S, and <= T
    if path == "bgmv":
        return num_tokens
    return min(num_tokens, triton.cdiv(num_tokens, block_m) + num_segments)


def plan_shrink(num_tokens: int, num_segments: int, d_in: int, max_rank: int, page_elems: int,
                sms: int) -> SgmvPlan:
    """The shrink launch for these sizes on a device with ``sms`` multiprocessors."""
    path, block_m = _tile_shape(num_tokens, num_segments)
    block_r = _block_r(max_rank)
    programs = num_tiles(path, block_m, num_tokens, num_segments) * triton.cdiv(max_rank,
                                                                                block_r)
    # bgmv keeps a [block_r, block_d] float32 accumulator per program: ~4096 elements
    want = max(32, 4096 // block_r) if path == "bgmv" else 64
    if programs < 4 * sms:  # few programs: shorter steps, so that more can share one row
        want = min(want, 64)
    block_d = _block_d(want, d_in, page_elems)
    k_steps = triton.cdiv(d_in, block_d)
    # a memory-bound launch wants several programs per SM to keep enough loads in flight
    split_k = 1
    if programs < 4 * sms and k_steps >= 4:
        split_k = min(triton.cdiv(4 * sms, programs), k_steps // 2, 64)
    return SgmvPlan(path, block_m, block_r, block_d, split_k, _num_warps(path, block_r, block_d))


def plan_expand(num_tokens: int, num_segments: int, d_out: int, max_rank: int, page_elems: int,
                sms: int) -> SgmvPlan:
    """The expand launch for these sizes on a device with ``sms`` multiprocessors."""
    path, block_m = _tile_shape(num_tokens, num_segments)
    block_r = _block_r(max_rank)
    tiles = num_tiles(path, block_m, num_tokens, num_segments)
    want = 256 if path == "bgmv" else 128
    if path == "bgmv":
        want = min(want, max(32, 4096 // block_r))
    # narrower column tiles until there are enough programs to fill the device
    while want > 32 and tiles * triton.cdiv(d_out, want) < 2 * sms:
        want //= 2
    block_d = _block_d(want, d_out, page_elems)
    num_warps = 8 if block_m * block_d >= 8192 else _num_warps(path, block_r, block_d)
    return SgmvPlan(path, block_m, block_r, block_d, num_warps=num_warps)


def check_plan(plan: SgmvPlan, page_elems: int) -> None:
    """Raises ``ValueError`` if ``plan`` does not fit pages of ``page_elems`` elements."""
    if plan.block_d > page_elems:
        raise ValueError(f"plan.block_d: {plan.block_d} exceeds page_elems {page_elems}; a step "
                         "may span at most two pages")
