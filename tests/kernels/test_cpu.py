"""The engine's CPU kernels (``kernels/cpu.py``) against the plain references, as the Triton
kernels are: paged attention on random steps (decodes in groups of several lengths, prefill
chunks, GQA, stale NaN in every slot no sequence owns, page tables padded with page 0) and
LoRA on mixed-rank batches (ranks 1-64 and base rows, blocks crossing pages)."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.kernels import cpu, reference
from loraplex.kernels.layout import kv_page_elems
from loraplex.kernels.metadata import AttentionMetadata
from tests.kernels.lora_batches import DEVICE, PATTERNS, make_batch
from tests.kernels.test_lora_reference import SHAPES, TOLERANCE

# Per dtype (rtol, atol, why) for attention. The oracle is the reference in float32 on the same
# stored values.
ATTENTION_TOLERANCE = {
    torch.float32: (1e-5, 1e-5, "another summation order (bmm / SDPA against einsum): ulps"),
    torch.bfloat16: (2e-2, 2e-2, "scores in float32 but probabilities and the output rounded "
                                 "to bf16 (2**-8 relative), on outputs of magnitude <= 3"),
}


def random_step(rng: random.Random, gen: torch.Generator, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int, int]:
    page_size = rng.choice([4, 16])
    num_kv_heads, group = rng.choice([1, 2, 3]), rng.choice([1, 2, 3])
    head_dim = rng.choice([8, 24, 40])
    num_seqs = rng.randint(1, 40)  # over 16 decodes: several decode groups
    q_lens = [1 if rng.random() < 0.7 else rng.randint(2, 40) for _ in range(num_seqs)]
    ctx_lens = [rng.choice([0, rng.randint(1, 5), rng.randint(1, 90)]) for _ in range(num_seqs)]
    if all(n == 1 and c == 0 for n, c in zip(q_lens, ctx_lens)):
        ctx_lens[0] = 7
    seq_lens = [n + c for n, c in zip(q_lens, ctx_lens)]
    counts = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(counts) + 6
    # Stale NaN everywhere no sequence wrote, page 0 (the tables' padding) included.
    pool = torch.full((num_pages, kv_page_elems(page_size, num_kv_heads, head_dim)),
                      float("nan"), dtype=dtype)
    free = list(range(1, num_pages))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(c)] for c in counts]
    k = torch.randn(sum(seq_lens), num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(sum(seq_lens), num_kv_heads, head_dim, generator=gen).to(dtype)
    written = AttentionMetadata.build(tables, seq_lens, seq_lens, page_size)
    reference.write_kv(pool, k, v, written.slot_mapping, page_size)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build(tables, q_lens, seq_lens, page_size)
    return q, pool, meta, page_size, num_kv_heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(12))
def test_paged_attention_matches_reference(seed: int, dtype: torch.dtype) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    q, pool, meta, page_size, num_kv_heads = random_step(rng, gen, dtype)
    scale = q.shape[-1] ** -0.5
    out = cpu.paged_attention(q, pool, meta, page_size, num_kv_heads, scale)
    expected = reference.paged_attention(q.float(), pool.float(), meta, page_size,
                                         num_kv_heads, scale)
    rtol, atol, _ = ATTENTION_TOLERANCE[dtype]
    assert out.dtype == dtype and out.isfinite().all()
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)
    # the second layer of a step reuses the cached gather plan: same result
    assert torch.equal(cpu.paged_attention(q, pool, meta, page_size, num_kv_heads, scale), out)


def _segment_blocks(batch, start: int = 0, blocks_dtype: torch.dtype | None = None
                    ) -> list[cpu.SegmentBlocks]:
    bounds = batch.seg_indptr.tolist()
    d_in = batch.x.shape[1]
    segments = []
    for s, rank in enumerate(batch.ranks.tolist()):
        if rank == 0 or bounds[s] == bounds[s + 1]:
            continue
        pages = batch.page_table[s]
        a = reference.region_rows(batch.pool, pages, int(batch.a_offsets[s]), rank, d_in)
        bt = reference.region_rows(batch.pool, pages, int(batch.b_offsets[s]), rank,
                                   batch.d_out)
        if blocks_dtype is not None:
            a, bt = a.to(blocks_dtype), bt.to(blocks_dtype)
        module = cpu.ModuleBlocks(start, start + batch.d_out, a.t(), bt)
        segments.append(cpu.SegmentBlocks(bounds[s], bounds[s + 1], batch.scales[s].item(),
                                          [module]))
    return segments


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pattern", PATTERNS)
def test_segments_equal_shrink_then_expand(pattern: str, shape: str, dtype: torch.dtype) -> None:
    # The engine's CPU path (blocks resolved once, segment by segment) against the op-signature
    # references it replaces. Blocks cross pages here (page_elems 80 against rows of 100), so
    # some are copies and some views. fp16 runs the same operations: the same bits. In fp32 the
    # expand is one addmm, which may sum in another order than mm then add (and fuse the
    # scaled add): a few ulp, within the fp32 row of TOLERANCE.
    batch = make_batch(pattern, SHAPES[shape], d_in=100, d_out=72, page_elems=80, dtype=dtype)
    y0 = torch.randn(batch.x.shape[0], 72 + 30, device=DEVICE).to(dtype)
    expected = y0.clone()
    h = reference.lora_shrink(batch.x, batch.pool, batch.page_table, batch.seg_indptr,
                              batch.ranks, batch.a_offsets, batch.max_rank)
    reference.lora_expand(h, batch.pool, batch.page_table, batch.seg_indptr, batch.ranks,
                          batch.b_offsets, batch.scales, expected[:, 30:])
    y = y0.clone()
    cpu.lora_segments(batch.x, y, _segment_blocks(batch, start=30))
    if dtype == torch.float16:
        assert torch.equal(y, expected)
    else:
        rtol, atol = TOLERANCE[dtype]
        torch.testing.assert_close(y, expected, rtol=rtol, atol=atol)
    assert not torch.equal(y, y0)  # the adapters did add something
    assert torch.equal(y[:, :30], y0[:, :30])  # columns of other modules untouched


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pattern", PATTERNS)
def test_widened_bf16_segments_within_bf16_of_reference(pattern: str, shape: str) -> None:
    # The bf16 CPU path: float32 copies of the blocks, products in float32, y rounded once;
    # h is not rounded to bf16 as the reference rounds it, so the two agree to bf16's last
    # bits (2**-8 relative on deltas of magnitude <= ~10), not bit for bit.
    batch = make_batch(pattern, SHAPES[shape], d_in=100, d_out=72, page_elems=80,
                       dtype=torch.bfloat16)
    y0 = torch.randn(batch.x.shape[0], 72, device=DEVICE).to(torch.bfloat16)
    expected = y0.clone()
    h = reference.lora_shrink(batch.x, batch.pool, batch.page_table, batch.seg_indptr,
                              batch.ranks, batch.a_offsets, batch.max_rank)
    reference.lora_expand(h, batch.pool, batch.page_table, batch.seg_indptr, batch.ranks,
                          batch.b_offsets, batch.scales, expected)
    y = y0.clone()
    cpu.lora_segments(batch.x, y, _segment_blocks(batch, blocks_dtype=torch.float32))
    torch.testing.assert_close(y.float(), expected.float(), rtol=3e-2, atol=6e-2)
    assert not torch.equal(y, y0)
