"""The batch's LoRA work: segments of tokens that share an adapter, and the hook that adds
``scale_s * (x A_s^T) B_s^T`` to every targeted projection.

The model runner orders the batch so that requests of one adapter are adjacent; each run of
such requests is one segment. Base-model segments have rank 0 and add nothing.

Two ways to run it, same arithmetic:

* The kernels (``--kernels triton``): per module, one shrink and one expand call for all
  segments and ranks, with the segment arrays of design.md §3's op signature (a segment whose
  adapter does not target the module gets rank 0 there); the kernels read the adapters'
  pages through the page table.
* The CPU path: ``loraplex/kernels/cpu.lora_segments``, segment by segment, with each resident
  adapter's blocks resolved once (views of its pages, cached on the ``ResidentAdapter`` until
  it is evicted). On CPU a decode step's LoRA cost is the fixed cost of many small torch
  operations, so the fewer per segment the better: one shrink over the modules' concatenated
  A's and, for decode rows, one expand (``cpu.GroupBlocks``); the op-signature references
  (``lora_shrink`` / ``lora_expand``) decode the page table in every call. With a bf16 pool
  short segments run in float32 (copies of the blocks: oneDNN's bf16 GEMM is slow at rank
  8-16 and few rows) and long ones as bf16 GEMMs (``lora_segments``). Where the native
  kernels load, all short segments of a projection are instead one C call on the blocks in
  place (``loraplex/kernels/cpu_lora_native.py``), on this hook's one thread. The routing is
  done once a step per fused group (``cpu.LoraPlan``, at the group's first call, with every
  layer's blocks resolved then): a layer's call is then the C call alone. An adapter with a
  host region (the CPU pool's case) gets its native tables computed at once from the layout's
  offsets into the region, its views made only where a path asks for a layer's blocks
  (``_group_layers``).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from loraplex.kernels import cpu, cpu_lora_native, reference
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
    """``shrink`` and ``expand`` with the signatures of ``loraplex/kernels/reference.py``.

    ``segment_major``: run ``cpu.lora_segments`` on resolved blocks instead (CPU).
    """

    shrink: Callable[..., torch.Tensor]
    expand: Callable[..., None]
    segment_major: bool = False


def lora_ops(kernels: str) -> LoraOps:
    if kernels == "triton":
        from loraplex.kernels import sgmv

        return LoraOps(sgmv.sgmv_shrink, sgmv.sgmv_expand)
    return LoraOps(reference.lora_shrink, reference.lora_expand, segment_major=True)


class LoraBatch:
    """One step's segments; called by the model as its ``LoraHook``."""

    def __init__(self, config: ModelConfig, pools: torch.Tensor, ops: LoraOps,
                 adapters: Sequence[ResidentAdapter | None], seg_lens: Sequence[int]) -> None:
        self.pools = pools
        self.ops = ops
        self.slices = module_slices(config)
        self.shapes = config.module_shapes()
        bounds = [0, *itertools.accumulate(seg_lens)]
        # (first row, end row, adapter) of every non-empty adapter segment
        self.segments = [(bounds[s], bounds[s + 1], a) for s, a in enumerate(adapters)
                         if a is not None and seg_lens[s] > 0]
        self.modules: dict[str, ModuleSegments] = {}
        # the CPU path's plan per fused group, made at its first layer (None: untargeted)
        self._plans: dict[str, cpu.LoraPlan | None] = {}
        if not ops.segment_major:
            self._build_tables(adapters, bounds)

    def _build_tables(self, adapters: Sequence[ResidentAdapter | None],
                      bounds: list[int]) -> None:
        device = self.pools.device
        max_pages = max((len(a.pages) for a in adapters if a is not None), default=1)
        table = torch.zeros(len(adapters), max_pages, dtype=torch.int32)
        for s, a in enumerate(adapters):
            if a is not None:
                table[s, :len(a.pages)] = torch.tensor(a.pages, dtype=torch.int32)
        self.page_table = table.to(device)
        self.seg_indptr = torch.tensor(bounds, dtype=torch.int32, device=device)
        self.scales = torch.tensor([a.scale if a is not None else 0.0 for a in adapters],
                                   dtype=torch.float32, device=device)
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
        if self.ops.segment_major:
            self._segment_major(layer, group, x, y)
            return
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

    def _segment_major(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        try:
            plan = self._plans[group]
        except KeyError:
            plan = self._plans[group] = self._plan(group, x)
        # On the engine's threads: pinned to one (as it was while a second OpenMP team made
        # every parallel region wait, cpu_threads.py) the step was 2.4% slower at two threads.
        if plan is not None:
            plan(layer, x, y)

    def _plan(self, group: str, x: torch.Tensor) -> cpu.LoraPlan | None:
        """The group's plan for this step, every layer's blocks resolved (None: no segment's
        adapter targets the group; a layout names modules, not layers)."""
        segments = []
        for lo, hi, adapter in self.segments:
            layers = adapter.groups.get(group)
            if layers is None:
                layers = adapter.groups[group] = self._group_layers(adapter, group)
            if layers.targeted:
                segments.append((lo, hi, adapter.scale, layers))
        return cpu.LoraPlan(x.dtype, x.device, segments) if segments else None

    def _group_layers(self, adapter: ResidentAdapter, group: str) -> cpu.GroupLayers:
        """The adapter's blocks of the group in every layer. With a host region (the CPU pool's
        case) the native kernels' tables are computed at once from the layout's offsets
        (``cpu_lora_native.region_tables``) and each layer's views are made only if a path
        asks for them (the float32 native path never does): making them for every layer and
        group took about 7 ms an adapter at SmolLM2's 30 layers (q/k/v and o: 122-128 ms for
        17 adapters, 1.4 ms now), at its first step after each copy-in. Without one, every
        layer is resolved now, as the tables need the views."""
        region = adapter.host_region
        modules = [m for m in FUSED_GROUPS[group] if m in adapter.layout.a_offsets]
        num_layers = len(self.pools)
        if region is None or region.shape[0] != num_layers:
            return cpu.GroupLayers([self._blocks(adapter, layer, group)
                                    for layer in range(num_layers)])
        layout = adapter.layout
        tables = cpu_lora_native.region_tables(region, [
            cpu_lora_native.RegionModule(layout.a_offsets[m], layout.b_offsets[m], layout.rank,
                                         self.slices[m][1], self.slices[m][2],
                                         self.shapes[m][0])
            for m in modules]) if modules else None
        # the resolver holds the adapter weakly: the adapter holds these layers (its `groups`),
        # and a cycle would keep an evicted adapter's host region until a full collection
        ref = weakref.ref(adapter)
        pools, slices, shapes = self.pools, self.slices, self.shapes

        def resolve(layer: int) -> cpu.GroupBlocks:
            owner = ref()
            if owner is None:  # unreachable while anything holds these layers through it
                raise RuntimeError("the adapter of these LoRA blocks is gone")
            return _cached_blocks(pools, slices, shapes, owner, layer, group)

        layers = cpu.GroupLayers(cpu.LazyLayers(resolve, num_layers), targeted=bool(modules))
        layers.native = tables
        return layers

    def _blocks(self, adapter: ResidentAdapter, layer: int, group: str) -> cpu.GroupBlocks:
        return _cached_blocks(self.pools, self.slices, self.shapes, adapter, layer, group)


def _cached_blocks(pools: torch.Tensor, slices: dict[str, tuple[str, int, int]],
                   shapes: dict[str, tuple[int, int]], adapter: ResidentAdapter, layer: int,
                   group: str) -> cpu.GroupBlocks:
    # the adapter's blocks of (layer, group), resolved once and cached on the adapter
    key = (layer, group)
    blocks = adapter.blocks.get(key)
    if blocks is None:
        blocks = adapter.blocks[key] = _resolve(pools, slices, shapes, adapter, layer, group)
    return blocks


def _resolve(pools: torch.Tensor, slices: dict[str, tuple[str, int, int]],
             shapes: dict[str, tuple[int, int]], adapter: ResidentAdapter, layer: int,
             group: str) -> cpu.GroupBlocks:
    # A view of the pool where a block lies in one page, else a copy (region_rows): the
    # pages of a resident adapter neither move nor change. The group's concatenated forms
    # (and, in half precision, their float32 copies) are made on first use (GroupBlocks).
    pool = pools[layer]
    layout = adapter.layout
    region = adapter.host_region
    pages: torch.Tensor | None = None  # the page table's row, without a host region
    blocks = []
    for module in FUSED_GROUPS[group]:
        if module not in layout.a_offsets:
            continue
        _, start, end = slices[module]
        d_in, d_out = shapes[module]
        if region is not None:  # the same values as the pages, one contiguous run each
            a_off, b_off, r = layout.a_offsets[module], layout.b_offsets[module], layout.rank
            a = region[layer, a_off:a_off + r * d_in].view(r, d_in)
            bt = region[layer, b_off:b_off + r * d_out].view(r, d_out)
        else:
            if pages is None:
                pages = torch.tensor(adapter.pages, dtype=torch.long)
            a = reference.region_rows(pool, pages, layout.a_offsets[module], layout.rank, d_in)
            bt = reference.region_rows(pool, pages, layout.b_offsets[module], layout.rank,
                                       d_out)
        blocks.append(cpu.ModuleBlocks(start, end, a.t(), bt))
    return cpu.GroupBlocks(blocks)
