"""LoRA shrink and expand over segments of heterogeneous rank, reading adapter weights in place
from the unified page pool (design.md §3, "The page layout").

A step's tokens are grouped into segments, runs of rows that share an adapter. Segment ``s``
has its own rank ``ranks[s]`` (0 for the base model), scale, page-table row and the offsets of
this module's ``A`` and ``B^T`` rows in its adapter's region. Region element ``e`` lives at
``pool[page_table[s, e // page_elems], e % page_elems]``; a row may cross a page boundary.

Each op is one launch across all segments and ranks. Loads are masked to each segment's own
rank, so a rank-8 segment moves rank-8 bytes even when another segment in the batch has rank
64; the rank tile is padded to >= 16 only in registers (the GPU compiler rejects smaller
``tl.dot`` tiles). There are two paths, picked on the host from sizes alone (no device sync) by
``sgmv_plan.py``:

* ``bgmv`` (decode): one program per token and tile; the program finds its segment by counting
  segment ends, and reduces with elementwise multiply-adds (no tensor cores needed for one row).
* ``sgmv`` (prefill): one program per tile of ``block_m`` tokens of one segment, ``tl.dot`` on
  the tile. Tiles are numbered segment by segment; a program finds its segment with a cumsum of
  per-segment tile counts, so the grid needs only ``T`` and ``S`` (never ``max(len_s)``).

The weight gather: for each weight row the program divides once per step to find the page of
the step's first column; a step never spans more than two pages (``block_d <= page_elems``),
so each element picks one of two page ids. Pool addresses are int64 (a pool can exceed 2**31
elements); region arithmetic within a step is int32.

The shrink output ``h`` is float32: it is tiny, and split-K programs add into it atomically.
Expand rounds ``h`` to the weights' dtype before multiplying, as peft's ``lora_B(lora_A(x))``
does, and accumulates in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.launch import (
    Launch,
    check_dtype,
    check_kernel_device,
    check_same_device,
    num_sms,
)
from loraplex.kernels.sgmv_plan import (
    SgmvPlan,
    check_plan,
    expand_constexprs,
    num_tiles,
    plan_expand,
    plan_shrink,
    row_align,
    shrink_constexprs,
)

# --------------------------------------------------------------------------- device helpers


@triton.jit
def _token_segment(indptr_ptr, ranks_ptr, num_segments, max_rank, t, BLOCK_S: tl.constexpr):
    # (segment s of token t, its rank). seg_indptr[s] <= t < seg_indptr[s + 1] holds for s =
    # the number of segment ends <= t. Rank 0 if seg_indptr does not cover t.
    s = 0
    for j in range(0, num_segments, BLOCK_S):
        idx = j + tl.arange(0, BLOCK_S)
        ends = tl.load(indptr_ptr + 1 + idx, mask=idx < num_segments, other=2147483647)
        s += tl.sum((ends <= t).to(tl.int32), axis=0)
    valid = s < num_segments
    s = tl.minimum(s, num_segments - 1)
    return s, tl.where(valid, tl.minimum(tl.load(ranks_ptr + s), max_rank), 0)


@triton.jit
def _tile_rows(indptr_ptr, ranks_ptr, num_segments, max_rank, tile, BLOCK_M: tl.constexpr,
               BLOCK_S: tl.constexpr):
    # (segment s, rows, row mask, rank) of a tile. Segment s owns tiles first_s ..
    # first_s + cdiv(len_s, BLOCK_M) - 1; a tile past the last has no rows and rank 0.
    s = 0
    first = 0
    done = 0
    for j in range(0, num_segments, BLOCK_S):
        idx = j + tl.arange(0, BLOCK_S)
        mask = idx < num_segments
        lo = tl.load(indptr_ptr + idx, mask=mask, other=0)
        hi = tl.load(indptr_ptr + idx + 1, mask=mask, other=0)
        tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
        ends = done + tl.cumsum(tiles, axis=0)
        starts = ends - tiles
        s += tl.sum((ends <= tile).to(tl.int32), axis=0)
        first += tl.sum(tl.where((starts <= tile) & (tile < ends), starts, 0), axis=0)
        done += tl.sum(tiles, axis=0)
    valid = s < num_segments
    s = tl.minimum(s, num_segments - 1)
    rows = tl.load(indptr_ptr + s) + (tile - first) * BLOCK_M + tl.arange(0, BLOCK_M)
    # scalar conditions go into the bounds: the interpreter rejects `block & scalar` masks
    m_mask = rows < tl.where(valid, tl.load(indptr_ptr + s + 1), 0)
    return s, rows, m_mask, tl.where(valid, tl.minimum(tl.load(ranks_ptr + s), max_rank), 0)


@triton.jit
def _row_origin(offset, rows, row_len, page_elems):
    # (page-table column, in-page offset) of each row's first element; int64 only here
    base = offset + rows.to(tl.int64) * row_len
    return (base // page_elems).to(tl.int32), (base % page_elems).to(tl.int32)


@triton.jit
def _weight_ptrs(pool_ptr, stride_page, table_row, num_table_cols, page_elems,
                 origin_col, origin_within, c0, row_mask, BLOCK_C: tl.constexpr,
                 ROW_ALIGN: tl.constexpr):
    # Pointers to columns c0 .. c0 + BLOCK_C - 1 of each row. BLOCK_C <= page_elems, so a step
    # touches at most the page holding its first column and the next one. Every in-page offset
    # is a multiple of ROW_ALIGN (the launcher checks the sizes; layout.ALIGN the offsets), so
    # both halves of a row stay contiguous and aligned: the loads vectorize.
    w = origin_within + c0
    q = w // page_elems
    col_lo = origin_col + q
    w_lo = tl.multiple_of(w - q * page_elems, ROW_ALIGN)
    crosses = row_mask & (w_lo + BLOCK_C > page_elems) & (col_lo + 1 < num_table_cols)
    page_lo = tl.load(table_row + col_lo, mask=row_mask & (col_lo < num_table_cols), other=0)
    page_hi = tl.load(table_row + col_lo + 1, mask=crosses, other=0)
    lo = pool_ptr + page_lo.to(tl.int64) * stride_page + w_lo
    hi = pool_ptr + page_hi.to(tl.int64) * stride_page + (w_lo - page_elems)
    cols = tl.arange(0, BLOCK_C)
    upper = (w_lo[:, None] + cols[None, :]) >= page_elems
    return tl.where(upper, hi[:, None] + cols[None, :], lo[:, None] + cols[None, :])


# --------------------------------------------------------------------------- shrink kernels
# Arguments that follow the batch: not specialised (on == 1 or % 16), so that their values never
# pick a compiled variant (buckets.py). The strides of x, y and the pool follow the model.
_BATCH_ARGS = ("num_segments", "max_rank", "num_table_cols", "stride_table", "stride_h")



@triton.jit(do_not_specialize=_BATCH_ARGS + ("split_k",))
def _shrink_bgmv_kernel(
    x_ptr, pool_ptr, table_ptr, indptr_ptr, ranks_ptr, offsets_ptr, h_ptr,
    num_segments, d_in, max_rank, page_elems, num_table_cols, split_k,
    stride_x, stride_page, stride_table, stride_h,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLIT: tl.constexpr, ROW_ALIGN: tl.constexpr,
):
    t = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_k = tl.program_id(2)
    s, rank = _token_segment(indptr_ptr, ranks_ptr, num_segments, max_rank, t, BLOCK_S)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < rank
    origin_col, origin_within = _row_origin(tl.load(offsets_ptr + s), r, d_in, page_elems)
    table_row = table_ptr + s.to(tl.int64) * stride_table
    x_row = x_ptr + t.to(tl.int64) * stride_x
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    k_end = tl.where(pid_r * BLOCK_R < rank, d_in, 0)  # rank tiles past the rank load nothing
    for k0 in range(pid_k * BLOCK_K, k_end, split_k * BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < d_in
        xv = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
        ptrs = _weight_ptrs(pool_ptr, stride_page, table_row, num_table_cols, page_elems,
                            origin_col, origin_within, k0, r_mask, BLOCK_K, ROW_ALIGN)
        a = tl.load(ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += a.to(tl.float32) * xv[None, :]
    h = tl.sum(acc, axis=1)
    out = h_ptr + t.to(tl.int64) * stride_h + r
    if not SPLIT:
        tl.store(out, h, mask=r < max_rank)
    else:
        tl.atomic_add(out, h, mask=r_mask)


@triton.jit(do_not_specialize=_BATCH_ARGS + ("split_k",))
def _shrink_sgmv_kernel(
    x_ptr, pool_ptr, table_ptr, indptr_ptr, ranks_ptr, offsets_ptr, h_ptr,
    num_segments, d_in, max_rank, page_elems, num_table_cols, split_k,
    stride_x, stride_page, stride_table, stride_h,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
):
    pid_r = tl.program_id(1)
    pid_k = tl.program_id(2)
    s, rows, m_mask, rank = _tile_rows(indptr_ptr, ranks_ptr, num_segments, max_rank,
                                       tl.program_id(0), BLOCK_M, BLOCK_S)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < rank
    origin_col, origin_within = _row_origin(tl.load(offsets_ptr + s), r, d_in, page_elems)
    table_row = table_ptr + s.to(tl.int64) * stride_table
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    k_end = tl.where(pid_r * BLOCK_R < rank, d_in, 0)
    for k0 in range(pid_k * BLOCK_K, k_end, split_k * BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < d_in
        xt = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        ptrs = _weight_ptrs(pool_ptr, stride_page, table_row, num_table_cols, page_elems,
                            origin_col, origin_within, k0, r_mask, BLOCK_K, ROW_ALIGN)
        at = tl.load(ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(xt, tl.trans(at), acc, input_precision=DOT_PRECISION)
    out = h_ptr + rows.to(tl.int64)[:, None] * stride_h + r[None, :]
    if not SPLIT:
        tl.store(out, acc, mask=m_mask[:, None] & (r < max_rank)[None, :])
    else:
        tl.atomic_add(out, acc, mask=m_mask[:, None] & r_mask[None, :])


# --------------------------------------------------------------------------- expand kernels


@triton.jit(do_not_specialize=_BATCH_ARGS)
def _expand_bgmv_kernel(
    h_ptr, pool_ptr, table_ptr, indptr_ptr, ranks_ptr, offsets_ptr, scales_ptr, y_ptr,
    num_segments, d_out, max_rank, page_elems, num_table_cols,
    stride_h, stride_page, stride_table, stride_y,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
):
    t = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    s, rank = _token_segment(indptr_ptr, ranks_ptr, num_segments, max_rank, t, BLOCK_S)
    offset = tl.load(offsets_ptr + s)
    table_row = table_ptr + s.to(tl.int64) * stride_table
    h_row = h_ptr + t.to(tl.int64) * stride_h
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < d_out
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < rank
        hv = tl.load(h_row + r, mask=r_mask, other=0.0)
        hv = hv.to(pool_ptr.dtype.element_ty).to(tl.float32)
        origin_col, origin_within = _row_origin(offset, r, d_out, page_elems)
        ptrs = _weight_ptrs(pool_ptr, stride_page, table_row, num_table_cols, page_elems,
                            origin_col, origin_within, n0, r_mask, BLOCK_N, ROW_ALIGN)
        b = tl.load(ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.sum(b.to(tl.float32) * hv[:, None], axis=0)
    out_mask = n < tl.where(rank > 0, d_out, 0)
    y_row = y_ptr + t.to(tl.int64) * stride_y + n
    y = tl.load(y_row, mask=out_mask, other=0.0).to(tl.float32)
    y += tl.load(scales_ptr + s) * acc
    tl.store(y_row, y.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=_BATCH_ARGS)
def _expand_sgmv_kernel(
    h_ptr, pool_ptr, table_ptr, indptr_ptr, ranks_ptr, offsets_ptr, scales_ptr, y_ptr,
    num_segments, d_out, max_rank, page_elems, num_table_cols,
    stride_h, stride_page, stride_table, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, DOT_PRECISION: tl.constexpr, ROW_ALIGN: tl.constexpr,
):
    n0 = tl.program_id(1) * BLOCK_N
    s, rows, m_mask, rank = _tile_rows(indptr_ptr, ranks_ptr, num_segments, max_rank,
                                       tl.program_id(0), BLOCK_M, BLOCK_S)
    offset = tl.load(offsets_ptr + s)
    table_row = table_ptr + s.to(tl.int64) * stride_table
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < d_out
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < rank
        ht = tl.load(h_rows + r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        origin_col, origin_within = _row_origin(offset, r, d_out, page_elems)
        ptrs = _weight_ptrs(pool_ptr, stride_page, table_row, num_table_cols, page_elems,
                            origin_col, origin_within, n0, r_mask, BLOCK_N, ROW_ALIGN)
        bt = tl.load(ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(ht.to(bt.dtype), bt, acc, input_precision=DOT_PRECISION)
    out_mask = m_mask[:, None] & (n < tl.where(rank > 0, d_out, 0))[None, :]
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * stride_y + n[None, :]
    y = tl.load(y_rows, mask=out_mask, other=0.0).to(tl.float32)
    y += tl.load(scales_ptr + s) * acc
    tl.store(y_rows, y.to(y_ptr.dtype.element_ty), mask=out_mask)


# --------------------------------------------------------------------------- launches
# (a plan from sgmv_plan.py, made into the launch that runs it)


_KERNELS = {k.__name__: k for k in (_shrink_bgmv_kernel, _shrink_sgmv_kernel,
                                     _expand_bgmv_kernel, _expand_sgmv_kernel)}


def shrink_launch(plan: SgmvPlan, num_tokens: int, num_segments: int, max_rank: int,
                  dtype: torch.dtype, row_align: int) -> Launch:
    """The shrink launch for ``plan`` (``row_align``: see ``_weight_ptrs``)."""
    grid = (num_tiles(plan.path, plan.block_m, num_tokens, num_segments),
            triton.cdiv(max_rank, plan.block_r), plan.split_k)
    name, meta = shrink_constexprs(plan, dtype, row_align)
    return Launch(_KERNELS[name], grid, meta)


def expand_launch(plan: SgmvPlan, num_tokens: int, num_segments: int, d_out: int,
                  dtype: torch.dtype, row_align: int) -> Launch:
    """The expand launch for ``plan``."""
    grid = (num_tiles(plan.path, plan.block_m, num_tokens, num_segments),
            triton.cdiv(d_out, plan.block_d))
    name, meta = expand_constexprs(plan, dtype, row_align)
    return Launch(_KERNELS[name], grid, meta)


# --------------------------------------------------------------------------- launchers


def _check_segments(pool: torch.Tensor, page_table: torch.Tensor, seg_indptr: torch.Tensor,
                    ranks: torch.Tensor, offsets: torch.Tensor, offsets_name: str) -> int:
    if pool.dim() != 2 or pool.stride(1) != 1:
        raise ValueError(f"pool: expected [num_pages, page_elems] with unit column stride, "
                         f"got shape {tuple(pool.shape)} strides {pool.stride()}")
    check_dtype("pool", pool, (torch.float16, torch.bfloat16, torch.float32))
    if seg_indptr.dim() != 1 or seg_indptr.numel() < 2:
        raise ValueError(f"seg_indptr: expected [S+1] with S >= 1, got {tuple(seg_indptr.shape)}")
    num_segments = seg_indptr.numel() - 1
    if page_table.dim() != 2 or page_table.shape[0] != num_segments:
        raise ValueError(f"page_table: expected [{num_segments}, max_pages], "
                         f"got {tuple(page_table.shape)}")
    if page_table.stride(1) != 1:
        raise ValueError("page_table: expected unit column stride")
    for name, t, dtype in (("page_table", page_table, torch.int32),
                           ("seg_indptr", seg_indptr, torch.int32),
                           ("ranks", ranks, torch.int32),
                           (offsets_name, offsets, torch.int64)):
        check_dtype(name, t, (dtype,))
        if t is not page_table and t is not seg_indptr and tuple(t.shape) != (num_segments,):
            raise ValueError(f"{name}: expected [{num_segments}], got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
    return num_segments


def _check_rows(name: str, t: torch.Tensor, num_tokens: int | None) -> None:
    if t.dim() != 2 or (num_tokens is not None and t.shape[0] != num_tokens):
        want = f"[{num_tokens if num_tokens is not None else 'T'}, d]"
        raise ValueError(f"{name}: expected {want}, got {tuple(t.shape)}")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{name}: rows must have unit column stride, got strides {t.stride()}")


def _row_align(pool: torch.Tensor, d: int) -> int:
    return row_align(d, pool.shape[1], pool.stride(0), pool.data_ptr() // pool.element_size())


def sgmv_shrink(x: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor,
                seg_indptr: torch.Tensor, ranks: torch.Tensor, a_offsets: torch.Tensor,
                max_rank: int, *, plan: SgmvPlan | None = None) -> torch.Tensor:
    """LoRA shrink of every segment with its own adapter and rank, in one launch.

    Semantics, for segment ``s`` with rows ``seg_indptr[s]:seg_indptr[s+1]`` and rank
    ``r = ranks[s]``::

        h[rows, :r] = x[rows] @ A_s.T      # A_s: [r, d_in] at a_offsets[s] of s's region
        h[rows, r:] = 0                    # rank 0 (base model) rows are all zero

    Args:
        x: ``[T, d_in]`` fp16/bf16/fp32, rows grouped by segment, unit column stride.
        pool: ``[num_pages, page_elems]`` one layer's pool, ``x``'s dtype, unit column stride.
        page_table: ``[S, max_pages]`` int32, row ``s`` lists the pages of ``s``'s adapter.
        seg_indptr: ``[S+1]`` int32, ``seg_indptr[0] == 0``, ``seg_indptr[S] == T``,
            non-decreasing (not checked on the device: that would sync).
        ranks: ``[S]`` int32, each in ``[0, max_rank]`` (larger ones are clamped).
        a_offsets: ``[S]`` int64, region element where ``A_s`` starts (row-major); a multiple
            of ``layout.ALIGN``, as ``adapter_layout`` places it (the loads assume it).
        max_rank: width of ``h``.
        plan: block sizes; ``plan_shrink``'s choice when ``None``.
    Returns:
        ``h``: ``[T, max_rank]`` float32, contiguous.
    Raises:
        ValueError: on a shape, dtype, stride or device mismatch.
    """
    num_segments = _check_segments(pool, page_table, seg_indptr, ranks, a_offsets, "a_offsets")
    _check_rows("x", x, None)
    check_dtype("x", x, (pool.dtype,))
    check_same_device(x, pool, page_table, seg_indptr, ranks, a_offsets)
    check_kernel_device(x)
    if max_rank < 0:
        raise ValueError(f"max_rank: must be >= 0, got {max_rank}")
    num_tokens, d_in = x.shape
    if num_tokens == 0 or max_rank == 0 or d_in == 0:
        return torch.zeros(num_tokens, max_rank, dtype=torch.float32, device=x.device)
    page_elems = pool.shape[1]
    plan = plan or plan_shrink(num_tokens, num_segments, d_in, max_rank, page_elems,
                               num_sms(x.device))
    check_plan(plan, page_elems)
    alloc = torch.zeros if plan.split_k > 1 else torch.empty
    h = alloc(num_tokens, max_rank, dtype=torch.float32, device=x.device)  # [T, max_rank]
    launch = shrink_launch(plan, num_tokens, num_segments, max_rank, x.dtype,
                           _row_align(pool, d_in))
    launch.kernel[launch.grid](
        x, pool, page_table, seg_indptr, ranks, a_offsets, h,
        num_segments, d_in, max_rank, page_elems, page_table.shape[1], plan.split_k,
        x.stride(0), pool.stride(0), page_table.stride(0), h.stride(0), **launch.constexprs)
    return h


def sgmv_expand(h: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor,
                seg_indptr: torch.Tensor, ranks: torch.Tensor, b_offsets: torch.Tensor,
                scales: torch.Tensor, y: torch.Tensor, *, plan: SgmvPlan | None = None) -> None:
    """LoRA expand of every segment with its own adapter, rank and scale, added into ``y``.

    Semantics, for segment ``s`` with rows ``seg_indptr[s]:seg_indptr[s+1]`` and rank
    ``r = ranks[s] > 0``::

        y[rows] += scales[s] * h[rows, :r].to(pool.dtype) @ BT_s   # BT_s: [r, d_out] at
                                                                   # b_offsets[s] of s's region
    Rank-0 (base model) rows of ``y`` are not touched.

    Args:
        h: ``[T, max_rank]`` float32 (or ``pool``'s dtype), unit column stride.
        pool: ``[num_pages, page_elems]`` one layer's pool, unit column stride.
        page_table: ``[S, max_pages]`` int32, row ``s`` lists the pages of ``s``'s adapter.
        seg_indptr: ``[S+1]`` int32, as in ``sgmv_shrink``.
        ranks: ``[S]`` int32, each in ``[0, max_rank]`` (larger ones are clamped).
        b_offsets: ``[S]`` int64, region element where ``B_s^T`` starts (row-major); a
            multiple of ``layout.ALIGN``, as ``adapter_layout`` places it.
        scales: ``[S]`` float32.
        y: ``[T, d_out]`` in ``pool``'s dtype, unit column stride; updated in place.
        plan: block sizes; ``plan_expand``'s choice when ``None``.
    Raises:
        ValueError: on a shape, dtype, stride or device mismatch.
    """
    num_segments = _check_segments(pool, page_table, seg_indptr, ranks, b_offsets, "b_offsets")
    _check_rows("h", h, None)
    num_tokens, max_rank = h.shape
    _check_rows("y", y, num_tokens)
    check_dtype("h", h, (torch.float32, pool.dtype))
    check_dtype("y", y, (pool.dtype,))
    check_dtype("scales", scales, (torch.float32,))
    if tuple(scales.shape) != (num_segments,) or not scales.is_contiguous():
        raise ValueError(f"scales: expected contiguous [{num_segments}], "
                         f"got {tuple(scales.shape)}")
    check_same_device(h, pool, page_table, seg_indptr, ranks, b_offsets, scales, y)
    check_kernel_device(y)
    d_out = y.shape[1]
    if num_tokens == 0 or max_rank == 0 or d_out == 0:
        return
    page_elems = pool.shape[1]
    plan = plan or plan_expand(num_tokens, num_segments, d_out, max_rank, page_elems,
                               num_sms(y.device))
    check_plan(plan, page_elems)
    launch = expand_launch(plan, num_tokens, num_segments, d_out, y.dtype,
                           _row_align(pool, d_out))
    launch.kernel[launch.grid](
        h, pool, page_table, seg_indptr, ranks, b_offsets, scales, y,
        num_segments, d_out, max_rank, page_elems, page_table.shape[1],
        h.stride(0), pool.stride(0), page_table.stride(0), y.stride(0), **launch.constexprs)

