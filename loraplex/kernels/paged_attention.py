"""Causal attention over paged KV, in Triton: a decode kernel and a prefill kernel.

A KV page of one layer's pool ``[num_pages, page_elems]`` is viewed as
``[2, page_size, num_kv_heads, head_dim]`` (design.md §3); token ``j`` of sequence ``s`` lives
in page ``page_table[s, j // page_size]`` at slot ``j % page_size``. Both kernels gather K and V
rows through the page table in place and run an online softmax (FlashAttention) in float32,
in base 2 (``exp2``, with the scale folded into ``log2(e)``).

* Decode (``q_len == 1``): one program per (sequence, KV head, split). The program holds the
  query heads of its GQA group as the rows of one ``tl.dot`` tile (padded to 16), so each K/V
  row is read once per group. Long contexts with few sequences split the keys over
  ``num_splits`` programs whose partial results (output, log-sum-exp) a second small kernel
  merges (flash-decoding).
* Prefill (``q_len > 1``): one program per (sequence, tile of ``block_m`` queries, query head),
  looping over key tiles up to the tile's last position with the causal mask.

A mixed step launches both; each kernel's programs skip the other kind of sequence. Host-side
sizes (``meta.q_lens``, ``meta.max_seq_len``) choose the grids, so nothing syncs the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.attention_plan import (
    AttentionPlan,
    attention_constexprs,
    plan_attention,
    write_kv_constexprs,
)
from loraplex.kernels.launch import (
    Launch,
    check_dtype,
    check_kernel_device,
    check_same_device,
    num_sms,
)
from loraplex.kernels.metadata import AttentionMetadata

__all__ = ["AttentionPlan", "attention_launches", "paged_attention", "plan_attention", "write_kv"]

_LOG2E = 1.4426950408889634


@triton.jit
def _kv_offsets(table_row, j, j_mask, kv_head, stride_page,
                PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    # element offset (int64) of K row j for kv_head; V sits PAGE_SIZE * Hkv * D further on
    page = tl.load(table_row + j // PAGE_SIZE, mask=j_mask, other=0)
    slot = j % PAGE_SIZE
    return page.to(tl.int64) * stride_page + (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM


@triton.jit
def _online_softmax(q, pool_ptr, table_row, kv_head, stride_page, k_begin, k_end, pos,
                    scale_log2, d, d_mask, ROWS: tl.constexpr, CAUSAL: tl.constexpr,
                    PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """Flash attention's loop over keys ``k_begin .. k_end`` of one sequence and KV head, in
    tiles of ``BLOCK_N`` read through the page table: returns the running max ``m`` (log2
    units), the softmax sum ``l`` (both ``[ROWS]``) and the unnormalised output ``acc``
    (``[ROWS, BLOCK_D]``), all float32. ``q`` is ``[ROWS, BLOCK_D]``; with ``CAUSAL``, row
    ``r`` sees keys ``0 .. pos[r]`` only (``pos`` is unused otherwise)."""
    m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for j0 in range(k_begin, k_end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_mask = j < k_end
        offs = _kv_offsets(table_row, j, j_mask, kv_head, stride_page,
                           PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
        kv_mask = j_mask[:, None] & d_mask[None, :]
        k = tl.load(pool_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(pool_ptr + offs[:, None] + PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM + d[None, :],
                    mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if CAUSAL:
            # key 0 is in the first tile and visible to every row, so no row's max stays -inf
            qk = tl.where((j[None, :] <= pos[:, None]) & j_mask[None, :], qk, float("-inf"))
        else:
            qk = tl.where(j_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    return m, l, acc


# Arguments that follow the batch are not specialised (on == 1 or % 16), so that their values
# never pick a compiled variant (buckets.py); the others follow the model and the config.
@triton.jit(do_not_specialize=("keys_per_split", "num_splits", "stride_table"))
def _decode_kernel(
    q_ptr, pool_ptr, table_ptr, query_start_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, keys_per_split, num_splits, num_heads,
    stride_qt, stride_qh, stride_page, stride_table, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    s = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_ptr + s)
    is_decode = tl.load(query_start_ptr + s + 1) - q_row == 1
    seq_len = tl.load(seq_lens_ptr + s)
    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    g_mask = g < tl.where(is_decode, GROUP, 0)
    q = tl.load(q_ptr + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    table_row = table_ptr + s.to(tl.int64) * stride_table
    k_begin = split * keys_per_split
    k_end = tl.where(is_decode, tl.minimum(seq_len, k_begin + keys_per_split), 0)
    m, l, acc = _online_softmax(
        q, pool_ptr, table_row, kv_head, stride_page, k_begin, k_end, g, scale_log2, d, d_mask,
        BLOCK_G, False, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    if not SPLIT:
        o_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
        tl.store(o_ptrs + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & d_mask[None, :])
    else:
        # partials: [S, num_heads, num_splits, HEAD_DIM] and [S, num_heads, num_splits]
        row = (s.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], out,
                 mask=g_mask[:, None] & d_mask[None, :])
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)  # -inf marks an empty split


@triton.jit(do_not_specialize=("num_splits",))
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, query_start_ptr, out_ptr, num_splits, num_heads, stride_ot,
    stride_oh, HEAD_DIM: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_ptr + s)
    is_decode = tl.load(query_start_ptr + s + 1) - q_row == 1
    sp = tl.arange(0, BLOCK_SPLITS)
    sp_mask = sp < tl.where(is_decode, num_splits, 0)
    row = (s.to(tl.int64) * num_heads + head) * num_splits + sp
    lse = tl.load(part_lse_ptr + row, mask=sp_mask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    w = tl.where(sp_mask & (lse > float("-inf")), tl.exp2(lse - top), 0.0)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
                    mask=sp_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d < tl.where(is_decode, HEAD_DIM, 0))


@triton.jit(do_not_specialize=("stride_table",))
def _prefill_kernel(
    q_ptr, pool_ptr, table_ptr, query_start_ptr, seq_lens_ptr, out_ptr, scale_log2,
    stride_qt, stride_qh, stride_page, stride_table, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    s = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_ptr + s)
    q_len = tl.load(query_start_ptr + s + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + s)
    active = (q_len > 1) & (m0 < q_len)
    i = m0 + tl.arange(0, BLOCK_M)
    i_mask = i < tl.where(active, q_len, 0)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + i).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=i_mask[:, None] & d_mask[None, :],
                other=0.0)  # [BLOCK_M, BLOCK_D]
    pos = seq_len - q_len + i  # each query's position; it sees keys 0 .. pos
    table_row = table_ptr + s.to(tl.int64) * stride_table
    k_end = tl.where(active, tl.minimum(seq_len, seq_len - q_len + m0 + BLOCK_M), 0)
    m, l, acc = _online_softmax(
        q, pool_ptr, table_row, kv_head, stride_page, 0, k_end, pos, scale_log2, d, d_mask,
        BLOCK_M, True, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_rows = (q_start + i).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=i_mask[:, None] & d_mask[None, :])


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, slot_ptr, pool_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_page,
    HEAD_DIM: tl.constexpr, NUM_KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = (pool_ptr + (slot // PAGE_SIZE) * stride_page
           + ((slot % PAGE_SIZE) * NUM_KV_HEADS + h) * HEAD_DIM + d)
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(dst, k.to(pool_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM, v.to(pool_ptr.dtype.element_ty),
             mask=mask)


_KERNELS = {k.__name__: k for k in (_decode_kernel, _merge_splits_kernel, _prefill_kernel)}


def attention_launches(plan: AttentionPlan, q_lens: tuple[int, ...], num_heads: int,
                       num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype
                       ) -> dict[str, Launch]:
    """The launches ``paged_attention`` makes for a step: some of ``decode``, ``merge`` (key
    splits) and ``prefill``."""
    num_seqs = len(q_lens)
    variants = attention_constexprs(plan, num_heads, num_kv_heads, head_dim, page_size, dtype)
    grids = {"decode": (num_seqs, num_kv_heads, plan.num_splits), "merge": (num_seqs, num_heads),
             "prefill": (num_seqs, triton.cdiv(max(q_lens), plan.block_m), num_heads)}
    kinds = []
    if any(n == 1 for n in q_lens):
        kinds += ["decode", "merge"] if plan.num_splits > 1 else ["decode"]
    if max(q_lens) > 1:
        kinds.append("prefill")
    return {kind: Launch(_KERNELS[variants[kind][0]], grids[kind], variants[kind][1])
            for kind in kinds}


def _check_pool(kv_pool: torch.Tensor, page_size: int, num_kv_heads: int, head_dim: int) -> None:
    want = 2 * page_size * num_kv_heads * head_dim
    if kv_pool.dim() != 2 or kv_pool.shape[1] != want or kv_pool.stride(1) != 1:
        raise ValueError(f"kv_pool: expected [num_pages, {want}] (2 * page_size * num_kv_heads "
                         f"* head_dim) with unit column stride, got {tuple(kv_pool.shape)}")
    check_dtype("kv_pool", kv_pool, (torch.float16, torch.bfloat16, torch.float32))


def _check_heads(name: str, t: torch.Tensor) -> None:
    if t.dim() != 3 or t.stride(2) != 1:
        raise ValueError(f"{name}: expected [T, heads, head_dim] with unit last stride, "
                         f"got shape {tuple(t.shape)} strides {t.stride()}")


def write_kv(kv_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, page_size: int) -> None:
    """Store each token's K and V in its slot (one launch for both).

    Semantics: ``pool[slot // P, 0, slot % P] = k[t]`` and ``pool[slot // P, 1, slot % P] = v[t]``
    with ``slot = slot_mapping[t]``, each page viewed as ``[2, P, num_kv_heads, head_dim]``.

    Args:
        kv_pool: ``[num_pages, page_elems]`` one layer's pool, written in place.
        k, v: ``[T, num_kv_heads, head_dim]``, unit last stride.
        slot_mapping: ``[T]`` int64, ``page * P + offset``, each in range (not checked).
        page_size: tokens per page ``P``.
    Raises:
        ValueError: on a shape, dtype or device mismatch.
    """
    _check_heads("k", k)
    if v.shape != k.shape or v.stride(2) != 1:
        raise ValueError(f"v: expected {tuple(k.shape)}, got {tuple(v.shape)}")
    num_tokens, num_kv_heads, head_dim = k.shape
    _check_pool(kv_pool, page_size, num_kv_heads, head_dim)
    if tuple(slot_mapping.shape) != (num_tokens,) or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping: expected contiguous [{num_tokens}], "
                         f"got {tuple(slot_mapping.shape)}")
    check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    check_same_device(kv_pool, k, v, slot_mapping)
    check_kernel_device(kv_pool)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, slot_mapping, kv_pool, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_pool.stride(0), **write_kv_constexprs(num_kv_heads, head_dim, page_size))


def _check_meta(meta: AttentionMetadata, num_tokens: int) -> None:
    num_seqs = meta.num_seqs
    if sum(meta.q_lens) != num_tokens:
        raise ValueError(f"meta: query lengths sum to {sum(meta.q_lens)}, q has {num_tokens} rows")
    for name, t, shape in (("query_start", meta.query_start, (num_seqs + 1,)),
                           ("seq_lens", meta.seq_lens, (num_seqs,))):
        check_dtype(f"meta.{name}", t, (torch.int32,))
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"meta.{name}: expected contiguous {list(shape)}, "
                             f"got {tuple(t.shape)}")
    check_dtype("meta.page_table", meta.page_table, (torch.int32,))
    if meta.page_table.dim() != 2 or meta.page_table.shape[0] != num_seqs or (
            meta.page_table.stride(1) != 1):
        raise ValueError(f"meta.page_table: expected [{num_seqs}, max_pages] with unit column "
                         f"stride, got {tuple(meta.page_table.shape)}")
    if any(n > L for n, L in zip(meta.q_lens, meta.seq_lens_host)):
        raise ValueError("meta: a query is longer than its sequence")


def paged_attention(q: torch.Tensor, kv_pool: torch.Tensor, meta: AttentionMetadata,
                    page_size: int, num_kv_heads: int, scale: float, *,
                    plan: AttentionPlan | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged KV (GQA).

    Semantics, for sequence ``s`` with ``n = q_len[s]``, ``L = seq_lens[s]`` and K/V the first
    ``L`` tokens of its pages: ``out[t] = softmax(scale * q[t] K^T + mask) V``, where query row
    ``i`` (position ``L - n + i``) sees keys ``0 .. L - n + i``; query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``.

    Args:
        q: ``[T, num_heads, head_dim]`` fp16/bf16/fp32, unit last stride (rows may be strided).
        kv_pool: ``[num_pages, 2 * page_size * num_kv_heads * head_dim]``, ``q``'s dtype, K/V
            already written (``write_kv``).
        meta: the step's ``AttentionMetadata`` (device tensors on ``q``'s device).
        page_size: tokens per page.
        num_kv_heads: KV heads; divides ``num_heads``.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        plan: block sizes; ``plan_attention``'s choice when ``None``.
    Returns:
        ``[T, num_heads, head_dim]`` contiguous, in ``q``'s dtype.
    Raises:
        ValueError: on a shape, dtype or device mismatch.
    """
    _check_heads("q", q)
    num_tokens, num_heads, head_dim = q.shape
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads: must divide num_heads {num_heads}, got {num_kv_heads}")
    _check_pool(kv_pool, page_size, num_kv_heads, head_dim)
    check_dtype("q", q, (kv_pool.dtype,))
    _check_meta(meta, num_tokens)
    check_same_device(q, kv_pool, meta.page_table, meta.query_start, meta.seq_lens)
    check_kernel_device(q)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    num_seqs = meta.num_seqs
    plan = plan or plan_attention(num_seqs, num_kv_heads, head_dim, meta.max_seq_len, q.dtype,
                                  num_sms(q.device))
    launches = attention_launches(plan, meta.q_lens, num_heads, num_kv_heads, head_dim,
                                  page_size, q.dtype)
    scale_log2 = scale * _LOG2E
    strides = (q.stride(0), q.stride(1), kv_pool.stride(0), meta.page_table.stride(0),
               out.stride(0), out.stride(1))
    if "decode" in launches:
        splits = plan.num_splits
        keys_per_split = triton.cdiv(triton.cdiv(meta.max_seq_len, splits), plan.block_n)
        keys_per_split *= plan.block_n
        part_out = part_lse = out  # placeholders: unused when not split
        if splits > 1:
            part_out = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32,
                                   device=q.device)
            part_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32,
                                   device=q.device)
        decode = launches["decode"]
        decode.kernel[decode.grid](
            q, kv_pool, meta.page_table, meta.query_start, meta.seq_lens, out, part_out,
            part_lse, scale_log2, keys_per_split, splits, num_heads, *strides,
            **decode.constexprs)
        if "merge" in launches:
            merge = launches["merge"]
            merge.kernel[merge.grid](part_out, part_lse, meta.query_start, out, splits,
                                     num_heads, out.stride(0), out.stride(1),
                                     **merge.constexprs)
    if "prefill" in launches:
        prefill = launches["prefill"]
        prefill.kernel[prefill.grid](
            q, kv_pool, meta.page_table, meta.query_start, meta.seq_lens, out, scale_log2,
            *strides, **prefill.constexprs)
    return out
