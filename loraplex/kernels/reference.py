"""Plain-torch versions of every kernel: the oracle that the Triton kernels and the tuned CPU
path (``loraplex/kernels/cpu.py``) are tested against. Signatures match the Triton launchers one to
one; each op is the math of its docstring, written to be read, not to be fast."""

from __future__ import annotations

import torch

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
                    page_size: int, num_kv_heads: int, scale: float, *,
                    round_probs: torch.dtype | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged KV (GQA).

    Semantics, for sequence ``s`` with ``n = q_len[s]``, ``L = seq_lens[s]`` and K/V the first
    ``L`` tokens of its pages: ``out[t] = softmax(scale * q[t] K^T + mask) V``, where query row
    ``i`` (position ``L - n + i``) sees keys ``0 .. L - n + i``; query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``.

    Args:
        q: ``[T, num_heads, head_dim]``.
        kv_pool: ``[num_pages, page_elems]`` one layer's pool, K/V already written.
        meta: the step's ``AttentionMetadata``.
        round_probs: ``None``, or a dtype (bf16) that the softmax's terms ``exp(s - max)``
            are rounded to before the product with ``V``, normalised by their float32 sum
            after: the bf16 prefill kernel on pair dot products (``cpu_native.prefill``), as
            torch's SDPA rounds its probabilities in bf16.
    Returns:
        ``[T, num_heads, head_dim]`` in ``q``'s dtype.
    """
    pool = kv_view(kv_pool, page_size, num_kv_heads)
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    start = 0
    for s, n in enumerate(meta.q_lens):
        length = meta.seq_lens_host[s]
        pages = meta.page_table[s, : -(-length // page_size)].long()
        k = pool[pages, 0].reshape(-1, num_kv_heads, pool.shape[-1])[:length]  # [L, Hkv, D]
        v = pool[pages, 1].reshape(-1, num_kv_heads, pool.shape[-1])[:length]
        k = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.float().repeat_interleave(group, dim=1)
        qs = q[start:start + n].float()  # [n, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale  # [Hq, n, L]
        q_pos = torch.arange(length - n, length, device=q.device)[:, None]
        future = torch.arange(length, device=q.device)[None, :] > q_pos  # [n, L]
        scores = scores.masked_fill(future, float("-inf"))
        if round_probs is None:
            probs = scores.softmax(-1)
        else:
            terms = (scores - scores.amax(-1, keepdim=True)).exp()
            probs = terms.to(round_probs).float() / terms.sum(-1, keepdim=True)
        out[start:start + n] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        start += n
    return out


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
