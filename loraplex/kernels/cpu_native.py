"""The CPU backend's native attention: ``loraplex/kernels/csrc/decode_attention.c`` and
``loraplex/kernels/csrc/prefill_attention.c`` called through ``ctypes``
(``loraplex/kernels/native.py``), one call per layer for every decode sequence and one for every
prefill sequence of a step.

Why native: decode attention reads every cached token's K and V once per layer for one query,
so it is bound by memory traffic and per-call overhead, not FLOPs. The torch path
(``cpu._decode``) copies K head-major, then runs a batched matmul, a softmax and an
``embedding_bag`` that reads each V row once per query head; the C loop reads K and V in
place through the page table, once per KV head (its query heads together), and keeps the
scores in a per-thread buffer. Prefill (prompt chunks, a decode row with its drafts) is bound
by FLOPs: the torch path runs SDPA one sequence at a time (a gather, a fused kernel with its
fixed cost, a copy out), the C kernel all of a step's sequences in one call, as
register-blocked tiles over keys gathered once per KV head and block of up to 256 queries, skipping
the causal upper triangle tile by tile. In bf16 on a CPU with AVX512-BF16 (head sizes 64 and
128) both products run on bf16 pairs, and the softmax's terms are rounded to bf16 between them,
as torch's SDPA does in bf16 (``prefill_rounds_bf16_probs``); elsewhere everything is float32
arithmetic on the widened values.

``decode`` and ``prefill`` return ``False`` where they do not apply (native kernels off or
unbuilt, a dtype other than float32/bfloat16, tensors off the CPU or strided unlike the
engine's; for prefill also a head size not a multiple of 16): the caller then runs the torch
path, which gives the same values up to summation order.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch

from loraplex.kernels import native
from loraplex.kernels.metadata import AttentionMetadata

__all__ = ["decode", "prefill", "prefill_rounds_bf16_probs"]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ARGTYPES = [
    ctypes.c_void_p, ctypes.c_int64,  # q, q_stride
    ctypes.c_void_p,  # pool
    ctypes.c_void_p, ctypes.c_int64,  # page_table, table_stride
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # q_rows, table_rows, seq_lens
    ctypes.c_void_p, ctypes.c_int64,  # out, out_stride
    ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # S, Hkv, G, D, P
    ctypes.c_float, ctypes.c_int, ctypes.c_int,  # scale, num_threads, dtype
]


_PREFILL_ARGTYPES = [
    ctypes.c_void_p, ctypes.c_int64,  # q, q_stride
    ctypes.c_void_p,  # pool
    ctypes.c_void_p, ctypes.c_int64,  # page_table, table_stride
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # q_starts, q_lens,
    # table_rows, seq_lens
    ctypes.c_void_p, ctypes.c_int64,  # out, out_stride
    ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # S, Hkv, G, D, P
    ctypes.c_float, ctypes.c_int, ctypes.c_int,  # scale, num_threads, dtype
]


def _function(name: str = "decode_attention") -> Callable[..., int] | None:
    lib = native.library(name)
    if lib is None:
        return None
    fn = getattr(lib, f"loraplex_{name}")
    if fn.argtypes is None:  # first use of this load of the library
        fn.argtypes = _ARGTYPES if name == "decode_attention" else _PREFILL_ARGTYPES
        fn.restype = ctypes.c_int
    return fn


def _rows_heads_dense(t: torch.Tensor, head_dim: int) -> bool:
    # [T, H, D] with each token's heads and elements contiguous (token stride free)
    return t.stride(2) == 1 and t.stride(1) == head_dim


def decode(q: torch.Tensor, kv_pool: torch.Tensor, meta: AttentionMetadata, rows: Sequence[int],
           starts: Sequence[int], out: torch.Tensor, page_size: int, num_kv_heads: int,
           scale: float) -> bool:
    """Decode attention of the sequences ``rows`` (one query token each) into ``out``.

    Semantics: ``reference.paged_attention`` for those sequences: for decode sequence ``s``
    (query row ``r = starts[s]``, ``L = seq_lens[s]``) and query head ``j`` of KV head
    ``h = j // G``: ``out[r, j] = softmax(scale * q[r, j] K_h^T) V_h`` over positions
    ``0 .. L - 1`` of its pages, scores, softmax and sums in float32, rounded once to ``q``'s
    dtype. Slots at or past ``L`` are never read.

    Args:
        q: ``[T, num_heads, head_dim]`` float32 or bfloat16, CPU.
        kv_pool: ``[num_pages, page_elems]`` one layer's pool, contiguous, ``q``'s dtype.
        meta: the step's ``AttentionMetadata``; its ``page_table`` is ``[S, max_pages]`` int32.
        rows: the decode sequences (``q_lens[s] == 1``), the same in every call with this
            ``meta`` (the per-step arrays built from them are cached on ``meta.derived``).
        starts: ``[S + 1]`` query starts (host ints).
        out: ``[T, num_heads, head_dim]``, ``q``'s dtype; rows ``starts[s]`` written.
        page_size, num_kv_heads, scale: the layer's.
    Returns:
        ``True`` if done; ``False`` if this path does not apply: the caller runs the torch path,
        which writes every decode row.
    """
    dtype = _DTYPES.get(q.dtype)
    _, num_heads, head_dim = q.shape
    table = meta.page_table
    if dtype is None or not _applies(q, kv_pool, meta, out, page_size, num_kv_heads):
        return False
    fn = _function()
    if fn is None:
        return False
    plan = meta.derived.get("native.decode")
    if plan is None:  # the first layer of the step; the others reuse it (rows follow meta)
        plan = meta.derived["native.decode"] = torch.tensor(
            [[starts[s] for s in rows], list(rows), [meta.seq_lens_host[s] for s in rows]],
            dtype=torch.int64)  # [3, num_decodes]: query row, table row, length
    if not _in_pool(meta, kv_pool):
        return False
    base = plan.data_ptr()
    step = plan.stride(0) * plan.element_size()
    status = fn(q.data_ptr(), q.stride(0), kv_pool.data_ptr(), table.data_ptr(), table.stride(0),
                base, base + step, base + 2 * step, out.data_ptr(), out.stride(0), len(rows),
                num_kv_heads, num_heads // num_kv_heads, head_dim, page_size, scale,
                torch.get_num_threads(), dtype)
    if status == 1:  # a per-thread buffer could not be allocated: the torch path still can
        return False
    if status != 0:
        raise RuntimeError(f"decode_attention: bad arguments (status {status})")
    return True


def _applies(q: torch.Tensor, kv_pool: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor,
             page_size: int, num_kv_heads: int) -> bool:
    # the layouts the C kernels read: CPU tensors of one dtype, heads and D contiguous, the
    # pool one layer of [num_pages, 2 * P * Hkv * D], an int32 page table
    _, num_heads, head_dim = q.shape
    table = meta.page_table
    return (q.device.type == "cpu" and kv_pool.dtype == q.dtype and out.dtype == q.dtype
            and kv_pool.is_contiguous() and _rows_heads_dense(q, head_dim)
            and _rows_heads_dense(out, head_dim) and table.dtype == torch.int32
            and table.device.type == "cpu" and table.is_contiguous()
            and num_heads % num_kv_heads == 0
            and kv_pool.shape[1] == 2 * page_size * num_kv_heads * head_dim)


def _in_pool(meta: AttentionMetadata, kv_pool: torch.Tensor) -> bool:
    # C reads pages unchecked: a page id outside the pool must fail as an IndexError in the
    # torch path, not crash the process (checked once per step)
    ok = meta.derived.get("native.in_pool")
    if ok is None:
        table = meta.page_table
        ok = meta.derived["native.in_pool"] = (int(table.min()) >= 0
                                               and int(table.max()) < kv_pool.shape[0])
    return bool(ok)


def prefill_rounds_bf16_probs() -> bool:
    """Whether this machine's prefill kernel runs bf16 on pair dot products, the softmax's
    terms ``exp(s - max)`` rounded to bf16 before ``P V`` (normalised by their float32 sum
    after): ``reference.paged_attention(..., round_probs=torch.bfloat16)``'s semantics.
    ``False`` where bf16 runs in float32 arithmetic throughout, or the kernel is unavailable."""
    lib = native.library("prefill_attention")
    return lib is not None and bool(lib.loraplex_prefill_attention_bf16_pairs())


def prefill(q: torch.Tensor, kv_pool: torch.Tensor, meta: AttentionMetadata,
            rows: Sequence[int], starts: Sequence[int], out: torch.Tensor, page_size: int,
            num_kv_heads: int, scale: float) -> bool:
    """Causal attention of the sequences ``rows`` (more than one query row each) into ``out``.

    Semantics: ``reference.paged_attention`` for those sequences: query ``a`` of sequence ``s``
    (row ``starts[s] + a``, ``n = q_lens[s]``, ``L = seq_lens[s]``) sits at position
    ``L - n + a`` and attends to positions ``0 .. L - n + a`` of its pages; scores, softmax
    and sums in float32, rounded once to ``q``'s dtype (in bf16 where
    ``prefill_rounds_bf16_probs()``, the softmax's terms rounded to bf16 before ``P V``, as in
    ``reference.paged_attention(..., round_probs=torch.bfloat16)``). Slots at or past ``L``
    are never read.

    Args: as ``decode``'s, with ``rows`` the sequences of ``q_lens[s] > 1``.
    Returns:
        ``True`` if done; ``False`` if this path does not apply (a dtype other than
        float32/bfloat16, a head size not a multiple of 16 or over 256, layouts the kernel
        does not read, native kernels off or unbuilt): the caller runs the torch path.
    """
    dtype = _DTYPES.get(q.dtype)
    _, num_heads, head_dim = q.shape
    if (dtype is None or head_dim % 16 or head_dim > 256
            or not _applies(q, kv_pool, meta, out, page_size, num_kv_heads)):
        return False
    fn = _function("prefill_attention")
    if fn is None:
        return False
    plan = meta.derived.get("native.prefill")
    if plan is None:  # the first layer of the step; the others reuse it
        plan = meta.derived["native.prefill"] = torch.tensor(
            [[starts[s] for s in rows], [meta.q_lens[s] for s in rows], list(rows),
             [meta.seq_lens_host[s] for s in rows]],
            dtype=torch.int64)  # [4, num_prefills]: first row, rows, table row, length
    if not _in_pool(meta, kv_pool):
        return False
    table = meta.page_table
    base = plan.data_ptr()
    step = plan.stride(0) * plan.element_size()
    status = fn(q.data_ptr(), q.stride(0), kv_pool.data_ptr(), table.data_ptr(), table.stride(0),
                base, base + step, base + 2 * step, base + 3 * step, out.data_ptr(),
                out.stride(0), len(rows), num_kv_heads, num_heads // num_kv_heads, head_dim,
                page_size, scale, torch.get_num_threads(), dtype)
    if status == 1:  # a per-thread buffer could not be allocated: the torch path still can
        return False
    if status != 0:
        raise RuntimeError(f"prefill_attention: bad arguments (status {status})")
    return True
