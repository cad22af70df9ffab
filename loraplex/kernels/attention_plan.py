"""Launch plans for ``paged_attention.py``: tile sizes and key splits, chosen on the host from
sizes alone, and the compile-time arguments each attention kernel gets for them.

Every compile-time argument here follows the model and the config (heads, head size, page size,
dtype) except whether decode splits its keys; the number of splits is a runtime argument, so
each kernel has at most two compiled variants per worker (``buckets.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loraplex.kernels.buckets import MAX_ATTENTION_SPLITS, next_pow2
from loraplex.kernels.launch import dot_precision

__all__ = ["AttentionPlan", "attention_constexprs", "attention_plans", "plan_attention",
           "write_kv_constexprs"]


@dataclass(frozen=True)
class AttentionPlan:
    """Block sizes of one ``paged_attention`` call, chosen on the host from sizes.

    Attributes:
        block_n: keys per step (both kernels), a power of two >= 16.
        block_m: queries per prefill tile, a power of two >= 16.
        num_splits: decode key splits (1: no merge kernel), at most ``MAX_ATTENTION_SPLITS``.
        num_warps: warps per program.
    """

    block_n: int = 64
    block_m: int = 64
    num_splits: int = 1
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_m"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}: must be a power of two >= 16, got {value}")
        if not 1 <= self.num_splits <= MAX_ATTENTION_SPLITS or self.num_warps < 1:
            raise ValueError(f"num_splits must be in [1, {MAX_ATTENTION_SPLITS}] and num_warps "
                             f">= 1, got {self.num_splits} and {self.num_warps}")


def _tiles(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    # (block, num_warps): 16-bit K/V with head_dim <= 128 take 64 x 64 tiles; float32 or larger
    # heads take 32 x 32 (float32 with 8 warps), which sm_90 holds in registers without spilling
    # (tests/kernels/sm90_compile.py checks it by compiling for sm_90)
    block = 64 if dtype != torch.float32 and head_dim <= 128 else 32
    return block, 8 if dtype == torch.float32 else 4


def plan_attention(num_seqs: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                   dtype: torch.dtype, sms: int) -> AttentionPlan:
    """Tiles for these sizes on a device with ``sms`` multiprocessors."""
    block, num_warps = _tiles(head_dim, dtype)
    programs = num_seqs * num_kv_heads
    splits = 1
    if programs < 2 * sms:  # too few programs to fill the device: split the keys too
        splits = max(1, min(-(-2 * sms // programs), max_seq_len // 256, MAX_ATTENTION_SPLITS))
    return AttentionPlan(block_n=block, block_m=block, num_splits=splits, num_warps=num_warps)


def attention_plans(head_dim: int, dtype: torch.dtype, max_model_len: int) -> list[AttentionPlan]:
    """One plan per compiled variant ``plan_attention`` can pick for any batch within
    ``max_model_len``: without key splits, and with them (2 stands for every count above 1)
    where a context is long enough to split."""
    block, num_warps = _tiles(head_dim, dtype)
    splits = (1, 2) if max_model_len // 256 >= 2 else (1,)
    return [AttentionPlan(block, block, n, num_warps) for n in splits]


def attention_constexprs(plan: AttentionPlan, num_heads: int, num_kv_heads: int, head_dim: int,
                         page_size: int, dtype: torch.dtype
                         ) -> dict[str, tuple[str, dict[str, Any]]]:
    """(kernel name, compile-time arguments) of the ``decode``, ``merge`` and ``prefill``
    launches for ``plan`` (a step makes those its query lengths need)."""
    group = num_heads // num_kv_heads
    block_d = max(16, next_pow2(head_dim))
    common: dict[str, Any] = dict(
        GROUP=group, HEAD_DIM=head_dim, NUM_KV_HEADS=num_kv_heads, PAGE_SIZE=page_size,
        BLOCK_D=block_d, BLOCK_N=plan.block_n, DOT_PRECISION=dot_precision(dtype),
        num_warps=plan.num_warps)
    return {
        "decode": ("_decode_kernel", dict(common, BLOCK_G=max(16, next_pow2(group)),
                                          SPLIT=plan.num_splits > 1)),
        "merge": ("_merge_splits_kernel", dict(HEAD_DIM=head_dim,
                                               BLOCK_SPLITS=max(16, MAX_ATTENTION_SPLITS),
                                               BLOCK_D=block_d)),
        "prefill": ("_prefill_kernel", dict(common, BLOCK_M=plan.block_m)),
    }


def write_kv_constexprs(num_kv_heads: int, head_dim: int, page_size: int) -> dict[str, Any]:
    """Compile-time arguments of ``write_kv``'s kernel (all follow the model and config)."""
    block_h, block_d = next_pow2(num_kv_heads), next_pow2(head_dim)
    return dict(HEAD_DIM=head_dim, NUM_KV_HEADS=num_kv_heads, PAGE_SIZE=page_size,
                BLOCK_H=block_h, BLOCK_D=block_d,
                num_warps=max(1, min(4, block_h * block_d // 256)))
