"""The engine's CPU kernels (``--kernels torch``): the same ops as
``loraplex/kernels/reference.py``, arranged for speed on a CPU, and tested against it as the Triton
kernels are (``tests/kernels/test_cpu.py``).

What makes them fast, and so less plain than the oracle: decode attention gathers K head-major
once per group of sequences and reads V in place through ``embedding_bag``, with its gather
plan cached on the step's ``AttentionMetadata`` for every layer; prefill runs torch's fused
SDPA with the query groups folded into the query length; LoRA runs each adapter's blocks,
resolved once per adapter (``ModuleBlocks``), segment by segment. ``write_kv`` copies each
token's K and V row into its slot in C (``cpu_elementwise.write_kv``; the reference's indexed
store where that does not apply).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple, overload

import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_elementwise, cpu_native, reference
from loraplex.kernels.cpu_lora_native import (
    LayerCall,
    LayerTables,
    NativeTable,
    long_bf16_call,
    lora_long_bf16_segments,
    lora_short_segments,
    short_call,
)
from loraplex.kernels.metadata import AttentionMetadata
from loraplex.kernels.reference import kv_view

__all__ = ["GroupBlocks", "GroupLayers", "LoraPlan", "ModuleBlocks", "SegmentBlocks",
           "lora_segments", "paged_attention", "write_kv"]


def write_kv(kv_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, page_size: int) -> None:
    """``reference.write_kv`` (same semantics and arguments), natively where it applies."""
    if not cpu_elementwise.write_kv(kv_pool, k, v, slot_mapping, page_size):
        reference.write_kv(kv_pool, k, v, slot_mapping, page_size)


def paged_attention(q: torch.Tensor, kv_pool: torch.Tensor, meta: AttentionMetadata,
                    page_size: int, num_kv_heads: int, scale: float) -> torch.Tensor:
    """``reference.paged_attention`` (same semantics, arguments and result): decodes in one
    native call (``cpu_native.decode``) or, without it, batched in groups through torch ops;
    prefill chunks in one native call (``cpu_native.prefill``; in bf16 on an AMX CPU only
    sequences of up to ``_BF16_NATIVE_PREFILL_KEYS`` keys) or one sequence at a time through
    SDPA."""
    pool = kv_view(kv_pool, page_size, num_kv_heads)
    out = torch.empty_like(q)
    starts = list(itertools.accumulate(meta.q_lens, initial=0))
    decode_rows = [s for s, n in enumerate(meta.q_lens) if n == 1]
    if decode_rows and not cpu_native.decode(q, kv_pool, meta, decode_rows, starts, out,
                                             page_size, num_kv_heads, scale):
        _decode(q, pool, meta, decode_rows, starts, out, scale)
    prefill_rows = [s for s, n in enumerate(meta.q_lens) if n > 1]
    limit = _bf16_native_prefill_keys() if q.dtype == torch.bfloat16 else None
    native_rows = prefill_rows if limit is None else [
        s for s in prefill_rows if meta.seq_lens_host[s] <= limit]
    if native_rows and cpu_native.prefill(q, kv_pool, meta, native_rows, starts, out,
                                          page_size, num_kv_heads, scale):
        done = set(native_rows)
        prefill_rows = [s for s in prefill_rows if s not in done]
    for s in prefill_rows:
        rows = slice(starts[s], starts[s] + meta.q_lens[s])
        out[rows] = _prefill_one(q[rows], pool, meta.page_table[s], meta.seq_lens_host[s],
                                 scale)
    return out


# In bf16 on a CPU with AMX the native prefill kernel (pair dot products) is faster than SDPA
# up to about this many keys a sequence; past it SDPA's bf16 kernel, on AMX tiles, is (one
# Sapphire Rapids-class thread, SmolLM2's heads, 16 whole prompts, `decode_attention_bench.py
# --prefill`: native 1.77x at 60-70 keys, 1.31x at 100-128, 1.07x at 150-200, 0.91x at
# 250-300, 0.82x at 450-512; the kernel of an earlier visit crossed over at 128). Without AMX
# the native kernel is the faster one at every length measured (one Zen 4 thread,
# AVX512-BF16: 1.88-2.15x at 120-500 keys, 1.35-1.44x at 900-2000, whole prompts and
# 256-token chunks): no limit there.
_BF16_NATIVE_PREFILL_KEYS = 224


@functools.cache
def _amx() -> bool:
    """Whether torch reports AMX tiles (assumed, on a torch too old to tell)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)  # torch >= 2.3
    return amx is None or bool(amx())


def _bf16_native_prefill_keys() -> int | None:
    """The longest bf16 sequence the native prefill kernel takes (None: any), by AMX."""
    return _BF16_NATIVE_PREFILL_KEYS if _amx() else None


def _gather_kv(pool: torch.Tensor, pages: torch.Tensor, length: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    # pages: [..., n_pages] -> K, V: [..., n_pages * P, Hkv, D] truncated to length.
    # Gathering the K and V halves of the pages separately copies each token once, and the
    # copied pages are contiguous, so merging pages with in-page positions is a view.
    page_size = pool.shape[2]
    flat = pages.reshape(-1)
    shape = (*pages.shape[:-1], pages.shape[-1] * page_size, *pool.shape[3:])
    k = pool[:, 0].index_select(0, flat).view(shape)[..., :length, :, :]
    v = pool[:, 1].index_select(0, flat).view(shape)[..., :length, :, :]
    return k, v


def _prefill_one(q: torch.Tensor, pool: torch.Tensor, pages: torch.Tensor, seq_len: int,
                 scale: float) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    page_size, num_kv_heads = pool.shape[2], pool.shape[3]
    k, v = _gather_kv(pool, pages[: -(-seq_len // page_size)], seq_len)  # [L, Hkv, D]
    group = num_heads // num_kv_heads
    kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, L, D]
    if n == seq_len:  # the whole sequence: plain causal, no mask to build or read
        # enable_gqa shares each KV head among its query heads inside the fused kernel
        # (SmolLM2's 9/3 heads: 20-30% less time than the folded queries with a mask)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kh, vh, is_causal=True,
                                           scale=scale, enable_gqa=group > 1)
        return o[0].transpose(0, 1).reshape(n, num_heads, head_dim)
    qh = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    # 4-d inputs take torch's fused (flash) CPU kernel; the query groups of a KV head are
    # folded into the query length, so K/V are never repeated per query head.
    qh = qh.reshape(1, num_kv_heads, group * n, head_dim)
    q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [n, L]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask.repeat(group, 1),
                                       scale=scale)  # [1, Hkv, G*n, D]
    return o.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(
        n, num_heads, head_dim)


# Decode sequences are attended in groups of this many, sorted by length, so that padding each
# group to its longest sequence wastes little memory traffic.
_DECODE_GROUP = 16


class _DecodeGroup(NamedTuple):
    tokens: torch.Tensor  # [S] rows of q and out
    k_rows: torch.Tensor  # [S * Hkv * L] K rows of the pool seen as [rows, D]
    v_rows: torch.Tensor  # [S * Hq * L] V rows, a run of L per (sequence, query head)
    bags: torch.Tensor  # [S * Hq] where each run starts in v_rows
    pad: torch.Tensor | None  # [S, 1, L] True past a sequence's end
    max_len: int


def _decode(q: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata, rows: list[int],
            starts: list[int], out: torch.Tensor, scale: float) -> None:
    # Decode reads every cached token once per layer for one query each: it is bound by memory
    # traffic, not FLOPs. So K is gathered head-major ([seq, head, pos, D], one copy of each
    # row) for a batched matmul, and probs @ V is one weighted sum of V rows per (sequence,
    # query head) that embedding_bag reads in place, rather than gathering K/V per page for
    # SDPA, which reads strided K/V slowly (in bf16 above all) or needs a transposing copy.
    page_size, num_kv_heads, head_dim = pool.shape[2], pool.shape[3], pool.shape[4]
    group = q.shape[1] // num_kv_heads
    key = ("cpu.decode", page_size, num_kv_heads, group)
    plan = meta.derived.get(key)
    if plan is None:  # the first layer of the step; the others reuse the indices
        plan = meta.derived[key] = _decode_plan(meta, rows, starts, page_size, num_kv_heads,
                                                group)
    flat = pool.view(-1, head_dim)
    # One K buffer per step for every group and layer: fresh multi-MB tensors cost page faults
    # that can take longer than the copy itself.
    buf_key = ("cpu.decode.k", flat.dtype)
    k_buf = meta.derived.get(buf_key)
    if k_buf is None:
        k_buf = meta.derived[buf_key] = flat.new_empty(max(g.k_rows.numel() for g in plan),
                                                       head_dim)
    for g in plan:
        num_seqs = g.tokens.numel()
        k = torch.index_select(flat, 0, g.k_rows, out=k_buf[:g.k_rows.numel()])
        k = k.view(num_seqs * num_kv_heads, g.max_len, head_dim)
        qg = q.index_select(0, g.tokens).view(num_seqs * num_kv_heads, group, head_dim)
        scores = torch.bmm(qg, k.transpose(1, 2)).float().mul_(scale)  # [S * Hkv, G, L]
        if g.pad is not None:
            scores.view(num_seqs, -1, g.max_len).masked_fill_(g.pad, float("-inf"))
        probs = scores.softmax(-1).to(q.dtype)
        o = F.embedding_bag(g.v_rows, flat, g.bags, mode="sum",
                            per_sample_weights=probs.reshape(-1),
                            padding_idx=_SKIPPED_ROW)  # [S * Hq, D]
        out.index_copy_(0, g.tokens, o.view(num_seqs, -1, head_dim))


_SKIPPED_ROW = 0  # the V row padded decode positions read (see _decode_plan)


def _decode_plan(meta: AttentionMetadata, rows: list[int], starts: list[int], page_size: int,
                 num_kv_heads: int, group: int) -> list[_DecodeGroup]:
    device = meta.page_table.device
    heads = torch.arange(num_kv_heads, device=device)
    order = sorted(rows, key=lambda s: meta.seq_lens_host[s])
    plan = []
    for i in range(0, len(order), _DECODE_GROUP):
        seqs = order[i:i + _DECODE_GROUP]
        lens = [meta.seq_lens_host[s] for s in seqs]
        max_len = lens[-1]
        pos = torch.arange(max_len, device=device)
        # Row of (page, K, pos, head 0) in the pool seen as [rows, D]; V rows follow P*Hkv
        # later. Past a sequence's end, positions read its table's padding (page 0), masked.
        pages = meta.page_table[torch.tensor(seqs, device=device)][:, pos // page_size]
        first = (pages.long() * 2 * page_size + pos % page_size) * num_kv_heads  # [S, L]
        k_rows = (first[:, None, :] + heads[None, :, None]).reshape(-1)
        v_rows = (k_rows + page_size * num_kv_heads).view(len(seqs), num_kv_heads, 1, max_len)
        pad = None
        if lens[0] < max_len:
            pad = (pos[None, :] >= torch.tensor(lens, device=device)[:, None])[:, None, :]
            # Weight 0 does not hide NaN or inf a stale slot may hold (0 * NaN is NaN): padded
            # positions read row 0 instead, which embedding_bag skips (padding_idx). Row 0 is a
            # K row (page 0, K half), never a V row, so no real V row is skipped.
            v_rows = v_rows.masked_fill(pad[:, :, None, :], _SKIPPED_ROW)
        v_rows = v_rows.expand(-1, -1, group, -1).reshape(-1)
        plan.append(_DecodeGroup(
            tokens=torch.tensor([starts[s] for s in seqs], device=device), k_rows=k_rows,
            v_rows=v_rows, bags=torch.arange(0, v_rows.numel(), max_len, device=device),
            pad=pad, max_len=max_len))
    return plan


class ModuleBlocks(NamedTuple):
    """One target module of one adapter in one layer, its blocks already resolved."""

    start: int  # first column of the module's slice of ``y``
    end: int
    a_t: torch.Tensor  # [d_in, r]: A transposed (a view of the region, or a copy across pages)
    bt: torch.Tensor  # [r, d_out]: B transposed


class GroupBlocks:
    """One adapter's modules of one fused projection (q/k/v, gate/up, ...) in one layer, and
    the two concatenated forms ``lora_segments`` runs on, each made once per dtype on first use:

    * ``a_cat(dtype)``: ``[d_in, R]``, the modules' ``A^T`` side by side (``R`` = the sum of
      their ranks), so one shrink serves every module;
    * ``b_wide(dtype)``: ``[R, span]``, each module's ``B^T`` at its own rows and its own columns
      of ``y[:, span_lo:span_hi]`` and zero elsewhere, so one expand writes every module.

    A one-module group's forms are its blocks themselves (views, no copy) in their own dtype;
    other forms are copies, kept while the adapter is resident (freed with it): ``a_cat`` is
    the size of the A blocks, ``b_wide`` that of the B blocks times the number of modules.
    """

    def __init__(self, modules: Sequence[ModuleBlocks]) -> None:
        self.modules = tuple(modules)
        # the columns of y the modules write (none: the adapter does not target this group)
        self.span_lo = min((m.start for m in self.modules), default=0)
        self.span_hi = max((m.end for m in self.modules), default=0)
        self.rank_offsets = list(itertools.accumulate((m.a_t.shape[1] for m in self.modules),
                                                      initial=0))
        self._a_cat: dict[torch.dtype, torch.Tensor] = {}
        self._b_wide: dict[torch.dtype, torch.Tensor] = {}
        self.native: NativeTable | None = None  # cpu_lora_native's module table, on first use

    def a_cat(self, dtype: torch.dtype) -> torch.Tensor:
        a = self._a_cat.get(dtype)
        if a is None:
            if len(self.modules) == 1:
                a = self.modules[0].a_t.to(dtype)
            else:
                a = torch.cat([m.a_t for m in self.modules], dim=1).to(dtype)
            self._a_cat[dtype] = a
        return a

    def b_wide(self, dtype: torch.dtype) -> torch.Tensor:
        b = self._b_wide.get(dtype)
        if b is None:
            if len(self.modules) == 1:
                b = self.modules[0].bt.to(dtype)
            else:
                first = self.modules[0].bt
                b = first.new_zeros(self.rank_offsets[-1], self.span_hi - self.span_lo,
                                    dtype=dtype)
                for m, r0, r1 in zip(self.modules, self.rank_offsets, self.rank_offsets[1:]):
                    b[r0:r1, m.start - self.span_lo:m.end - self.span_lo] = m.bt
            self._b_wide[dtype] = b
        return b


class LazyLayers(Sequence[GroupBlocks]):
    """Every layer's ``GroupBlocks`` of one group, each made by ``resolve(layer)`` at its first
    access and kept. For a ``GroupLayers`` whose native tables were built without them
    (``cpu_lora_native.region_tables``): the float32 native path then never makes them, the
    torch and bf16 paths make each when they first need it."""

    def __init__(self, resolve: Callable[[int], GroupBlocks], num_layers: int) -> None:
        self._resolve = resolve
        self._items: list[GroupBlocks | None] = [None] * num_layers

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> GroupBlocks: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[GroupBlocks, ...]: ...

    def __getitem__(self, index: int | slice) -> GroupBlocks | tuple[GroupBlocks, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        layer = range(len(self._items))[index]  # IndexError outside, as a tuple's
        item = self._items[layer]
        if item is None:
            item = self._items[layer] = self._resolve(layer)
        return item


class GroupLayers:
    """One adapter's ``GroupBlocks`` of one fused projection in every layer (``layers[l]``),
    and, on first use, the native kernel's tables of them (``cpu_lora_native.layer_tables``).

    ``layers`` may be a ``LazyLayers`` (blocks made at first access), with ``targeted`` then
    given (whether the adapter targets any of the group's modules) and usually ``native`` set
    by the caller."""

    def __init__(self, layers: Sequence[GroupBlocks], targeted: bool | None = None) -> None:
        self.layers: Sequence[GroupBlocks] = (layers if isinstance(layers, LazyLayers)
                                              else tuple(layers))
        # a layout names modules, not layers: targeted in one layer is targeted in all
        self.targeted = any(g.modules for g in self.layers) if targeted is None else targeted
        self.native: LayerTables | None = None


class SegmentBlocks(NamedTuple):
    """A segment's rows, its adapter's scale, and its adapter's blocks for the projection."""

    lo: int
    hi: int
    scale: float
    group: GroupBlocks


# Up to this many rows a segment's modules run as one shrink and one expand over the
# concatenated blocks (``b_wide``'s zeros cost FLOPs, nothing next to the fixed cost of a
# product: decode rows, measured 5 against 15 us for q/k/v at rank 16, SmolLM2's shapes);
# longer segments expand module by module, in fp32 (FLOPs dominate there).
_SHORT_SEGMENT = 16
# In float32 the native kernel takes segments of any length: with the output's rows prefetched
# ahead of its read-modify-write it was 1.3-2.1x torch's shrink + addmm on a prefill chunk of 17
# segments of 31-200 rows (`benchmarks/cpu_lora_bench.py --prefill`) and 1.06-1.78x on one
# segment of 1536 rows (one Zen 4 core, SmolLM2's projections); segments of 16 rows or more now
# take its tiled path (ranks in vector lanes, shrink and expand fused 8 rows at a time:
# ``csrc/lora.c``, "Long float32 segments"), a further 1.32x for q/k/v and 1.13x for o there.
# In bf16, where the library has AVX512-BF16's pair dot products, the long ones run in
# ``csrc/lora.c``'s ``loraplex_lora_long_bf16`` (the oneDNN path's rounding of h): 2.0-2.8x
# oneDNN's bf16 GEMMs on a prefill chunk at one thread, 2.3-4.5x at two (one Zen 5 core,
# SmolLM2's shapes); on a CPU with AMX on its tiles, 2.1-3.8x oneDNN's (whose bf16 GEMMs run
# on the same tiles) and 1.5-1.9x the pair dot products (one Sapphire Rapids-class core).
_NATIVE_F32_SEGMENT = 1 << 62


def _native_bf16() -> bool:
    return (torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def lora_segments(x: torch.Tensor, y: torch.Tensor, segments: Sequence[SegmentBlocks]) -> None:
    """``reference.lora_shrink`` then ``reference.lora_expand`` for every module of a fused
    projection, with each adapter's blocks resolved beforehand: the engine's CPU path.

    Semantics, for each segment ``s`` and each of its modules ``m``:
    ``y[lo:hi, start:end] += scale * (x[lo:hi] @ A^T) @ BT``, products accumulated in float32.
    One shrink per segment over the modules' concatenated ``A^T`` (``GroupBlocks.a_cat``);
    then, for a short segment (decode rows) one expand over ``b_wide``, for a long one one
    ``addmm`` per module. In float32 this is the references' arithmetic up to summation order
    (a few ulp; the scaled add fused into ``addmm``).

    Half precision (``x`` and ``y`` bf16 or fp16): a short segment, or any in fp16 (or where
    oneDNN has no bf16), runs *widened*: its rows of ``x`` widened once, float32 products,
    ``y`` rounded once per element (``h`` is not rounded as the reference rounds it: within
    half precision's last bit of the references). A long bf16 segment runs two bf16 GEMMs on
    oneDNN (AMX where the CPU has it): ``h`` rounded to bf16 as the reference does, the expand
    accumulated in float32 and added into ``y`` with one rounding (``addmm``'s sum post-op).
    Why two regimes: oneDNN's bf16 GEMM has a large fixed cost at LoRA's ranks (43 against
    9 us for one decode row), and float32 GEMMs are 7-10x slower than bf16 ones on a
    512-row prefill segment.

    On CPU the fixed cost of each small product (about 5 us), not the arithmetic, is most of
    what LoRA costs in a decode step: hence one shrink and one expand per segment there, and,
    where the native library loads, every short float32/bf16 segment, and in float32 every
    long one too, in one C call instead (``cpu_lora_native.lora_short_segments``: the short
    path's arithmetic, blocks read in place). Where the native build has AVX512-BF16, the long
    bf16 segments also run in one C call (``cpu_lora_native.lora_long_bf16_segments``: the
    oneDNN path's arithmetic, ``h`` rounded to bf16, on AMX tiles where the CPU has them, else
    on pair dot products).

    Args:
        x: ``[T, d_in]``, rows grouped by segment.
        y: ``[T, d_out_total]``, the fused projection's output, updated in place.
        segments: the segments of rank > 0; rows of no segment are not touched.
    """
    # the short segments (decode rows) in one C call, where the native library loads; in
    # float32 the long ones (prefill) too
    segments = lora_short_segments(x, y, segments,
                                   _NATIVE_F32_SEGMENT if x.dtype == torch.float32
                                   else _SHORT_SEGMENT)
    if segments and x.dtype == torch.bfloat16:
        segments = lora_long_bf16_segments(x, y, segments)
    _torch_segments(x, y, segments)


def _torch_segments(x: torch.Tensor, y: torch.Tensor, segments: Sequence[SegmentBlocks]) -> None:
    # lora_segments' torch path: the segments no native entry point took
    half = x.dtype != torch.float32
    native = half and x.dtype == torch.bfloat16 and _native_bf16()
    for seg in segments:
        g = seg.group
        rows = seg.hi - seg.lo
        short = rows <= _SHORT_SEGMENT
        ys = y[seg.lo:seg.hi, g.span_lo:g.span_hi]
        if native and not short:
            ys.addmm_(torch.mm(x[seg.lo:seg.hi], g.a_cat(x.dtype)), g.b_wide(x.dtype),
                      alpha=seg.scale)
            continue
        xs = x[seg.lo:seg.hi].float() if half else x[seg.lo:seg.hi]
        h = torch.mm(xs, g.a_cat(torch.float32))  # [rows, R] float32
        if short:
            if half:  # in place on half y with a float32 operand: summed in float32, rounded once
                ys.add_(torch.mm(h, g.b_wide(torch.float32)), alpha=seg.scale)
            else:
                ys.addmm_(h, g.b_wide(torch.float32), alpha=seg.scale)
            continue
        b = g.b_wide(torch.float32) if half else None
        for m, r0, r1 in zip(g.modules, g.rank_offsets, g.rank_offsets[1:]):
            c0, c1 = m.start - g.span_lo, m.end - g.span_lo
            if b is None:
                ys[:, c0:c1].addmm_(h[:, r0:r1], m.bt, alpha=seg.scale)
            else:
                ys[:, c0:c1].add_(torch.mm(h[:, r0:r1], b[r0:r1, c0:c1]), alpha=seg.scale)


class LoraPlan:
    """``lora_segments`` for one step's segments of one fused projection in every layer, with
    the routing done once: which segments each native entry point takes, and their arguments
    for every layer (``cpu_lora_native.LayerCall``). A layer's call is then one foreign call
    per entry point; ``lora_segments`` rebuilt each call's arguments segment by segment (in a
    decode step of 17 segments about a third of LoRA's time). Same results, bit for bit, as
    ``lora_segments(x, y, [SegmentBlocks(lo, hi, scale, g.layers[layer]) ...])``.

    Args:
        dtype: the dtype of ``x`` and ``y`` the routing is for; a call with other tensors (or
            rows of another stride) runs ``lora_segments`` itself.
        device: where ``x`` and ``y`` live (the native entry points: CPU only).
        segments: ``(lo, hi, scale, layers)`` of every targeted segment, rows disjoint.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device,
                 segments: Sequence[tuple[int, int, float, GroupLayers]]) -> None:
        self.dtype = dtype
        self.segments = list(segments)
        self._calls: list[LayerCall] = []
        rest = self.segments
        if device.type == "cpu":
            self._calls, rest = short_call(dtype, rest, _NATIVE_F32_SEGMENT
                                           if dtype == torch.float32 else _SHORT_SEGMENT)
            if rest and dtype == torch.bfloat16:
                calls, rest = long_bf16_call(rest)
                self._calls += calls
        self._rest = rest

    def __call__(self, layer: int, x: torch.Tensor, y: torch.Tensor) -> None:
        if (x.dtype != self.dtype or y.dtype != self.dtype or x.stride(1) != 1
                or y.stride(1) != 1):
            lora_segments(x, y, [SegmentBlocks(lo, hi, scale, g.layers[layer])
                                 for lo, hi, scale, g in self.segments])
            return
        for call in self._calls:
            call(layer, x, y)
        if self._rest:
            _torch_segments(x, y, [SegmentBlocks(lo, hi, scale, g.layers[layer])
                                   for lo, hi, scale, g in self._rest])
