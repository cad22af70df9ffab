"""The batch's LoRA work: segments of tokens that share an adapter, and the hook that adds
``scale_s * (x A_s^T) B_s^T`` to every targeted projection, all ranks in one call per module.

The model runner orders the batch so that requests of one adapter are adjacent; each run of
such requests is one segment. Base-model segments have rank 0 and add nothing. Per module the
segment arrays follow the op signature of design.md §3 (``kernels/reference.py``): a segment
whose adapter does not target that module gets rank 0 there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from loraplex.server.engine.adapter_cache import ResidentAdapter
from loraplex.server.engine.models.config import LORA_MODULES, ModelConfig
from loraplex.server.engine.models.llama import FUSED_GROUPS, module_slices


@dataclass(frozen=True)
class ModuleSegments:
    ranks: torch.Tensor  # [S] int32, 0 where the segment's adapter skips this module
    a_offsets: torch.Tensor  # [S] int64
    b_offsets: torch.Tensor  # [S] int64
    max_rank: int


@dataclass(frozen=True)
class LoraOps:
    """``shrink`` and ``expand`` with the signatures of ``kernels/reference.py``."""

    shrink: Callable[..., torch.Tensor]
    expand: Callable[..., None]


def lora_ops(kernels: str) -> LoraOps:
    if kernels == "triton":
        from loraplex.kernels import sgmv

        return LoraOps(sgmv.sgmv_shrink, sgmv.sgmv_expand)
    from loraplex.kernels import reference

    return LoraOps(reference.lora_shrink, reference.lora_expand)


class LoraBatch:
    """One step's segments; called by the model as its ``LoraHook``."""

    def __init__(self, config: ModelConfig, pools: torch.Tensor, ops: LoraOps,
                 adapters: Sequence[ResidentAdapter | None], seg_lens: Sequence[int]) -> None:
        device = pools.device
        self.pools = pools
        self.ops = ops
        self.slices = module_slices(config)
        num_segs = len(adapters)
        max_pages = max((len(a.pages) for a in adapters if a is not None), default=1)
        table = torch.zeros(num_segs, max_pages, dtype=torch.int32)
        for s, a in enumerate(adapters):
            if a is not None:
                table[s, :len(a.pages)] = torch.tensor(a.pages, dtype=torch.int32)
        self.page_table = table.to(device)
        indptr = [0]
        for n in seg_lens:
            indptr.append(indptr[-1] + n)
        self.seg_indptr = torch.tensor(indptr, dtype=torch.int32, device=device)
        self.scales = torch.tensor([a.scale if a is not None else 0.0 for a in adapters],
                                   dtype=torch.float32, device=device)
        self.modules: dict[str, ModuleSegments] = {}
        for module in LORA_MODULES:
            ranks = [a.layout.rank if a is not None and module in a.layout.a_offsets else 0
                     for a in adapters]
            if not any(ranks):
                continue
            a_off = [a.layout.a_offsets.get(module, 0) if a is not None else 0 for a in adapters]
            b_off = [a.layout.b_offsets.get(module, 0) if a is not None else 0 for a in adapters]
            self.modules[module] = ModuleSegments(
                torch.tensor(ranks, dtype=torch.int32, device=device),
                torch.tensor(a_off, dtype=torch.int64, device=device),
                torch.tensor(b_off, dtype=torch.int64, device=device),
                max(ranks))

    def __call__(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        pool = self.pools[layer]
        for module in FUSED_GROUPS[group]:
            seg = self.modules.get(module)
            if seg is None:
                continue
            _, start, end = self.slices[module]
            h = self.ops.shrink(x, pool, self.page_table, self.seg_indptr, seg.ranks,
                                seg.a_offsets, seg.max_rank)
            self.ops.expand(h, pool, self.page_table, self.seg_indptr, seg.ranks, seg.b_offsets,
                            self.scales, y[:, start:end])
