"""Plain-torch versions of every kernel: the CPU path of the engine and the oracle the Triton
kernels are tested against. Signatures match the Triton launchers one to one."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from loraplex.kernels.metadata import AttentionMetadata


def kv_view(kv_pool: torch.Tensor, page_size: int, num_kv_heads: int) -> torch.Tensor:
    """``[num_pages, page_elems]`` -> ``[num_pages, 2, page_size, num_kv_heads, head_dim]``."""
    return kv_pool.view(kv_pool.shape[0], 2, page_size, num_kv_heads, -1)


def write_kv(kv_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, page_size: int) -> None:
    """Store each token's K and V in its slot.

    Semantics: ``pool[slot // P, 0, slot % P] = k[t]`` and ``pool[slot // P, 1, slot % P] = v[t]``
    with ``slot = slot_mapping[t]``.

    Args:
        kv_pool: ``[num_pages, page_elems]`` one layer's pool (model dtype), written in place.
        k, v: ``[T, num_kv_heads, head_dim]``.
        slot_mapping: ``[T]`` int64.
        page_size: tokens per page ``P``.
    """
    pool = kv_view(kv_pool, page_size, k.shape[1])
    pages = slot_mapping // page_size
    offsets = slot_mapping % page_size
    pool[pages, 0, offsets] = k
    pool[pages, 1, offsets] = v


def paged_attention(q: torch.Tensor, kv_pool: torch.Tensor, meta: AttentionMetadata,
                    page_size: int, num_kv_heads: int, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged KV (GQA).

    Semantics, for sequence ``s`` with ``n = q_len[s]``, ``L = seq_lens[s]`` and K/V the first
    ``L`` tokens of its pages: ``out[t] = softmax(scale * q[t] K^T + mask) V``, where query row
    ``i`` (position ``L - n + i``) sees keys ``0 .. L - n + i``; query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``.

    Args:
        q: ``[T, num_heads, head_dim]``.
        kv_pool: ``[num_pages, page_elems]`` one layer's pool, K/V already written.
        meta: the step's ``AttentionMetadata``.
    Returns:
        ``[T, num_heads, head_dim]`` in ``q``'s dtype.
    """
    pool = kv_view(kv_pool, page_size, num_kv_heads)
    out = torch.empty_like(q)
    starts = list(itertools.accumulate(meta.q_lens, initial=0))
    decode_rows = [s for s, n in enumerate(meta.q_lens) if n == 1]
    if decode_rows:
        _decode(q, pool, meta, decode_rows, starts, out, scale)
    for s, n in enumerate(meta.q_lens):
        if n > 1:
            rows = slice(starts[s], starts[s] + n)
            out[rows] = _prefill_one(q[rows], pool, meta.page_table[s],
                                     meta.seq_lens_host[s], scale)
    return out


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
    qh = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    # 4-d inputs take torch's fused (flash) CPU kernel; the query groups of a KV head are
    # folded into the query length, so K/V are never repeated per query head.
    qh = qh.reshape(1, num_kv_heads, group * n, head_dim)
    kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, L, D]
    if group == 1 and n == seq_len:  # the whole sequence: plain causal, no mask to read
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
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
    key = ("reference.decode", page_size, num_kv_heads, group)
    plan = meta.derived.get(key)
    if plan is None:  # the first layer of the step; the others reuse the indices
        plan = meta.derived[key] = _decode_plan(meta, rows, starts, page_size, num_kv_heads,
                                                group)
    flat = pool.view(-1, head_dim)
    # One K buffer per step for every group and layer: fresh multi-MB tensors cost page faults
    # that can take longer than the copy itself.
    buf_key = ("reference.decode.k", flat.dtype)
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


def region_rows(pool: torch.Tensor, pages: torch.Tensor, offset: int, num_rows: int,
                row_len: int) -> torch.Tensor:
    """``[num_rows, row_len]`` block of an adapter's region starting at element ``offset``.

    Gathers page by page: a view into ``pool`` when the block sits in one page, else one copy.
    """
    page_elems = pool.shape[1]
    end = offset + num_rows * row_len
    if end == offset:
        return pool.new_empty(num_rows, row_len)
    first, last = offset // page_elems, (end - 1) // page_elems
    page_ids = pages[first: last + 1].tolist()
    if len(page_ids) == 1:
        start = offset - first * page_elems
        return pool[page_ids[0], start: start + num_rows * row_len].view(num_rows, row_len)
    chunks = []
    for i, page in enumerate(page_ids):
        lo = offset - (first + i) * page_elems if i == 0 else 0
        hi = end - (first + i) * page_elems if i == len(page_ids) - 1 else page_elems
        chunks.append(pool[page, lo:hi])
    return torch.cat(chunks).view(num_rows, row_len)


def _segments(seg_indptr: torch.Tensor, ranks: torch.Tensor, offsets: torch.Tensor,
              num_tokens: int, max_rank: int) -> list[tuple[int, int, int, int, int]]:
    # (segment, first row, end row, rank, offset) of every non-empty segment of rank > 0
    bounds, rank_list, offset_list = seg_indptr.tolist(), ranks.tolist(), offsets.tolist()
    num_segments = len(rank_list)
    if len(bounds) != num_segments + 1 or len(offset_list) != num_segments:
        raise ValueError(f"seg_indptr, ranks and offsets disagree on the number of segments: "
                         f"{len(bounds)} - 1, {num_segments}, {len(offset_list)}")
    if bounds[0] != 0 or bounds[-1] != num_tokens or any(
            a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"seg_indptr: must rise from 0 to {num_tokens}, got {bounds}")
    if any(not 0 <= r <= max_rank for r in rank_list):
        raise ValueError(f"ranks: must lie in [0, {max_rank}], got {rank_list}")
    return [(s, bounds[s], bounds[s + 1], rank_list[s], offset_list[s])
            for s in range(num_segments) if rank_list[s] > 0 and bounds[s + 1] > bounds[s]]


def lora_shrink(x: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor,
                seg_indptr: torch.Tensor, ranks: torch.Tensor, a_offsets: torch.Tensor,
                max_rank: int) -> torch.Tensor:
    """LoRA shrink of every segment with its own adapter and rank.

    Semantics, for segment ``s`` with rows ``seg_indptr[s]:seg_indptr[s+1]`` and rank
    ``r = ranks[s]``: ``h[rows, :r] = x[rows] @ A_s.T`` and ``h[rows, r:] = 0``, where
    ``A_s`` (``[r, d_in]``, row-major) starts at element ``a_offsets[s]`` of the region made by
    the pages ``page_table[s]`` (design.md §3). Rank-0 (base model) rows are zero.

    Args:
        x: ``[T, d_in]``, rows grouped by segment.
        pool: ``[num_pages, page_elems]`` one layer's pool.
        page_table: ``[S, max_pages]`` int32.
        seg_indptr: ``[S+1]`` int32, from 0 to ``T``.
        ranks: ``[S]`` int32 in ``[0, max_rank]``.
        a_offsets: ``[S]`` int64.
        max_rank: width of the result.
    Returns:
        ``[T, max_rank]`` float32 (products of ``x``'s dtype, accumulated in float32).
    Raises:
        ValueError: if the segment tensors disagree or ``seg_indptr`` does not cover ``x``.
    """
    num_tokens = x.shape[0]
    h = torch.zeros(num_tokens, max_rank, dtype=torch.float32, device=x.device)
    for s, lo, hi, rank, offset in _segments(seg_indptr, ranks, a_offsets, num_tokens, max_rank):
        a = region_rows(pool, page_table[s], offset, rank, x.shape[1])  # [r, d_in]
        h[lo:hi, :rank] = x[lo:hi].float() @ a.float().T
    return h


def lora_expand(h: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor,
                seg_indptr: torch.Tensor, ranks: torch.Tensor, b_offsets: torch.Tensor,
                scales: torch.Tensor, y: torch.Tensor) -> None:
    """LoRA expand of every segment with its own adapter, rank and scale, added into ``y``.

    Semantics, for segment ``s`` with rows ``seg_indptr[s]:seg_indptr[s+1]`` and rank
    ``r = ranks[s] > 0``: ``y[rows] += scales[s] * h[rows, :r].to(pool.dtype) @ BT_s``, where
    ``BT_s`` (``[r, d_out]``, row-major: ``B_s`` transposed) starts at element ``b_offsets[s]``
    of the region made by the pages ``page_table[s]``. ``h`` is rounded to the weights' dtype
    first, as peft's ``lora_B(lora_A(x))`` does; the product is accumulated in float32.
    Rank-0 rows of ``y`` are not touched.

    Args:
        h: ``[T, max_rank]`` (``lora_shrink``'s result).
        pool: ``[num_pages, page_elems]`` one layer's pool.
        page_table: ``[S, max_pages]`` int32.
        seg_indptr: ``[S+1]`` int32, from 0 to ``T``.
        ranks: ``[S]`` int32 in ``[0, max_rank]``.
        b_offsets: ``[S]`` int64.
        scales: ``[S]`` float32.
        y: ``[T, d_out]``, updated in place.
    Raises:
        ValueError: if the segment tensors disagree or ``seg_indptr`` does not cover ``h``.
    """
    num_tokens, max_rank = h.shape
    scale_list = scales.tolist()
    for s, lo, hi, rank, offset in _segments(seg_indptr, ranks, b_offsets, num_tokens, max_rank):
        bt = region_rows(pool, page_table[s], offset, rank, y.shape[1])  # [r, d_out]
        delta = h[lo:hi, :rank].to(pool.dtype).float() @ bt.float()  # [rows, d_out]
        y[lo:hi] = (y[lo:hi].float() + scale_list[s] * delta).to(y.dtype)


class ModuleBlocks(NamedTuple):
    """One target module of one adapter in one layer, its blocks already resolved."""

    start: int  # first column of the module's slice of ``y``
    end: int
    a_t: torch.Tensor  # [d_in, r]: A transposed (a view of the region, or a copy across pages)
    bt: torch.Tensor  # [r, d_out]: B transposed


class SegmentBlocks(NamedTuple):
    """A segment's rows, its adapter's scale, and the blocks of the modules it targets."""

    lo: int
    hi: int
    scale: float
    modules: Sequence[ModuleBlocks]


def lora_segments(x: torch.Tensor, y: torch.Tensor, segments: Sequence[SegmentBlocks]) -> None:
    """``lora_shrink`` then ``lora_expand`` for every module of a fused projection, with each
    adapter's blocks resolved beforehand: the engine's CPU path.

    Semantics, for each segment ``s`` and each of its modules ``m``:
    ``y[lo:hi, start:end] += scale * (x[lo:hi] @ A^T).to(dtype) @ BT`` with the products
    accumulated in float32: the arithmetic of the two ops above, bit for bit in half
    precision; in float32 the expand is one ``addmm`` (a few ulp apart: another summation
    order, the scaled add fused), 25% less time per decode step than mm, mul and add.

    Mixed precision (half-precision ``x`` and ``y``, float32 blocks: the engine's bf16 CPU path,
    which keeps float32 copies of its adapters' blocks): each segment's rows of ``x`` are
    widened once, every product runs in float32, and ``y`` gets each module's delta rounded
    once per element;
    ``h`` is *not* rounded to half precision (the reference above rounds it), so the result is
    within half precision's last bit of the references, not equal. On CPU this is 2.5-3x faster
    than half-precision products: oneDNN's bf16 GEMM has a large fixed cost at LoRA's tiny
    shapes (rank 8-16), float32 GEMM does not.

    Resolving the blocks once per adapter (``region_rows``, a view when a block lies in one
    page) and visiting segments rather than modules leaves two matrix multiplies per segment
    and module: on CPU their fixed cost (about 5 us each), not the arithmetic, is most of what
    LoRA costs in a decode step.

    Args:
        x: ``[T, d_in]``, rows grouped by segment.
        y: ``[T, d_out_total]``, the fused projection's output, updated in place.
        segments: the segments of rank > 0; rows of no segment are not touched.
    """
    if x.dtype == torch.float32:
        for seg in segments:
            xs, ys = x[seg.lo:seg.hi], y[seg.lo:seg.hi]
            for m in seg.modules:
                ys[:, m.start:m.end].addmm_(torch.mm(xs, m.a_t), m.bt, alpha=seg.scale)
        return
    if all(m.a_t.dtype == torch.float32 for seg in segments for m in seg.modules):
        _lora_segments_widened(x, y, segments)
        return
    for seg in segments:
        xs, ys = x[seg.lo:seg.hi], y[seg.lo:seg.hi]
        for m in seg.modules:
            h = (xs.float() @ m.a_t.float()).to(m.bt.dtype)
            delta = h.float() @ m.bt.float()
            out = ys[:, m.start:m.end]
            out.copy_(out.float() + seg.scale * delta)


def _lora_segments_widened(x: torch.Tensor, y: torch.Tensor,
                           segments: Sequence[SegmentBlocks]) -> None:
    """``lora_segments`` on half-precision ``x`` / ``y`` with float32 blocks (see there).

    Segment by segment, so that the float32 temporaries (the segment's rows of ``x`` widened,
    each module's product) stay cache-sized: one float32 delta over a whole prefill chunk
    (2048 x 3072) made the bf16 LoRA cost as much as the base GEMMs (memory traffic).
    """
    for seg in segments:
        xs, ys = x[seg.lo:seg.hi].float(), y[seg.lo:seg.hi]  # [rows, d_in] float32
        for m in seg.modules:
            # in place on bf16 with a float32 operand: the sum runs in float32, rounded once
            ys[:, m.start:m.end].add_(torch.mm(torch.mm(xs, m.a_t), m.bt), alpha=seg.scale)
