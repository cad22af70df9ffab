"""The engine's CPU kernels (``loraplex/kernels/cpu.py``) against the plain references, as the
Triton kernels are: paged attention on random steps (decodes in groups of several lengths, prefill
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
    q, pool, meta = paged_step(rng, gen, dtype, q_lens, seq_lens, page_size, num_kv_heads,
                               group, head_dim, spare_pages=6)
    return q, pool, meta, page_size, num_kv_heads


def paged_step(rng: random.Random, gen: torch.Generator, dtype: torch.dtype,
               q_lens: list[int], seq_lens: list[int], page_size: int, num_kv_heads: int,
               group: int, head_dim: int, spare_pages: int
               ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step's queries, a pool holding every sequence's K/V on shuffled pages, and the
    step's metadata. Stale NaN everywhere no sequence wrote: page 0 (the tables' padding),
    the ``spare_pages`` free ones, and the tail of every sequence's last page."""
    counts = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(counts) + spare_pages
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
    return q, pool, AttentionMetadata.build(tables, q_lens, seq_lens, page_size)


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


# (rtol, atol) of lora_segments against the op-signature references, per dtype.
SEGMENT_TOLERANCE = {
    # one addmm per expand (another summation order, the scaled add fused): a few ulp
    torch.float32: TOLERANCE[torch.float32],
    # fp16 runs widened: h stays float32 where the reference rounds it to fp16 (2**-11
    # relative on h, on deltas of magnitude <= ~10), then y is rounded once in each
    torch.float16: (4e-3, 2e-2),
    # bf16: h unrounded (short segments) or rounded by another GEMM (long ones): bf16's last
    # bits, 2**-8 relative, on deltas of magnitude <= ~10
    torch.bfloat16: (3e-2, 6e-2),
}


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
                                          cpu.GroupBlocks([module])))
    return segments


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pattern", PATTERNS)
def test_segments_equal_shrink_then_expand(pattern: str, shape: str, dtype: torch.dtype) -> None:
    # The engine's CPU path (blocks resolved once, segment by segment) against the op-signature
    # references it replaces. Blocks cross pages here (page_elems 80 against rows of 100), so
    # some are copies and some views. See SEGMENT_TOLERANCE for why each dtype's bound.
    batch = make_batch(pattern, SHAPES[shape], d_in=100, d_out=72, page_elems=80, dtype=dtype)
    y0 = torch.randn(batch.x.shape[0], 72 + 30, device=DEVICE).to(dtype)
    expected = y0.clone()
    h = reference.lora_shrink(batch.x, batch.pool, batch.page_table, batch.seg_indptr,
                              batch.ranks, batch.a_offsets, batch.max_rank)
    reference.lora_expand(h, batch.pool, batch.page_table, batch.seg_indptr, batch.ranks,
                          batch.b_offsets, batch.scales, expected[:, 30:])
    y = y0.clone()
    cpu.lora_segments(batch.x, y, _segment_blocks(batch, start=30))
    rtol, atol = SEGMENT_TOLERANCE[dtype]
    torch.testing.assert_close(y, expected, rtol=rtol, atol=atol)
    assert not torch.equal(y, y0)  # the adapters did add something
    assert torch.equal(y[:, :30], y0[:, :30])  # columns of other modules untouched


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pattern", PATTERNS)
def test_widened_bf16_segments_within_bf16_of_reference(pattern: str, shape: str) -> None:
    # The bf16 CPU path: float32 copies of the blocks, products in float32, y rounded once;
    # h is not rounded to bf16 as the reference rounds it, so the two agree to bf16's last
    # bits, not bit for bit.
    batch = make_batch(pattern, SHAPES[shape], d_in=100, d_out=72, page_elems=80,
                       dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    y0 = torch.randn(batch.x.shape[0], 72, generator=gen).to(DEVICE, torch.bfloat16)
    expected = y0.clone()
    h = reference.lora_shrink(batch.x, batch.pool, batch.page_table, batch.seg_indptr,
                              batch.ranks, batch.a_offsets, batch.max_rank)
    reference.lora_expand(h, batch.pool, batch.page_table, batch.seg_indptr, batch.ranks,
                          batch.b_offsets, batch.scales, expected)
    y = y0.clone()
    cpu.lora_segments(batch.x, y, _segment_blocks(batch, blocks_dtype=torch.float32))
    # two bf16 ulps of the largest output: an element near cancellation may round either way
    atol = 2 * 2.0 ** -8 * expected.float().abs().max().item()
    torch.testing.assert_close(y.float(), expected.float(), rtol=2.0 ** -7, atol=atol)
    assert not torch.equal(y, y0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_fused_group_segments_equal_each_module(pattern: str, dtype: torch.dtype) -> None:
    # A fused projection of three targeted modules (one shrink over their concatenated A's,
    # one expand over the zero-padded B's for short segments, per-module expands for long
    # ones, bf16 GEMMs for long bf16 segments) against each module's references, with
    # segments of every length on both sides of the short-segment bound, a column gap before
    # the first module and between the modules that no adapter targets.
    tokens = [1, 3, 40, 1, 60, 17, 7, 1, 25, 2]
    widths, starts = (72, 40, 24), (30, 110, 150)
    batches = [make_batch(pattern, tokens, d_in=100, d_out=w, page_elems=80, dtype=dtype)
               for w in widths]
    x = batches[0].x
    total = starts[-1] + widths[-1] + 5
    gen = torch.Generator().manual_seed(1)  # not the global generator: the same y0 in any order
    y0 = torch.randn(x.shape[0], total, generator=gen).to(device=DEVICE, dtype=dtype)
    expected = y0.clone()
    for batch, start, w in zip(batches, starts, widths):
        h = reference.lora_shrink(x, batch.pool, batch.page_table, batch.seg_indptr,
                                  batch.ranks, batch.a_offsets, batch.max_rank)
        reference.lora_expand(h, batch.pool, batch.page_table, batch.seg_indptr, batch.ranks,
                              batch.b_offsets, batches[0].scales,  # one scale per adapter
                              expected[:, start:start + w])
    per_module = [_segment_blocks(b, start=st) for b, st in zip(batches, starts)]
    segments = [cpu.SegmentBlocks(seg.lo, seg.hi, seg.scale, cpu.GroupBlocks(
        [m for blocks in parts for m in blocks.group.modules]))
        for seg, *parts in zip(per_module[0], *per_module)]
    if pattern == "distinct":  # both regimes in one call
        assert {s.hi - s.lo > 16 for s in segments} == {True, False}
    y = y0.clone()
    cpu.lora_segments(x, y, segments)
    rtol, atol = SEGMENT_TOLERANCE[dtype]
    if dtype == torch.bfloat16:  # and y's own rounding: two bf16 ulps of the largest output
        # (an element near a rounding boundary may land on either side: outputs reach 8-16,
        # where one ulp is 0.0625; the fixed bound alone failed for 1 element in 4 draws of y0)
        atol = max(atol, 2 * 2.0 ** -8 * expected.float().abs().max().item())
    torch.testing.assert_close(y.float(), expected.float(), rtol=rtol, atol=atol)
    assert not torch.equal(y, y0)
    for lo, hi in [(0, 30), (102, 110), (174, total)]:  # columns no module owns: untouched
        assert torch.equal(y[:, lo:hi], y0[:, lo:hi])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_write_kv_native_matches_reference(dtype: torch.dtype, tokens: int) -> None:
    """``cpu.write_kv`` (one C copy a row, ``cpu_elementwise.write_kv``) stores exactly what the
    reference's indexed store does, K and V as strided views of a fused qkv, and refuses a
    slot outside the pool as the reference does, writing nothing."""
    from loraplex.kernels import cpu_elementwise

    if not cpu_elementwise.available():
        pytest.skip("no C compiler: the native kernels do not build")
    page_size, num_kv_heads, head_dim, pages = 4, 2, 24, 100
    gen = torch.Generator().manual_seed(tokens)
    pool = torch.randn(pages, kv_page_elems(page_size, num_kv_heads, head_dim),
                       generator=gen).to(dtype)
    qkv = torch.randn(tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype)
    k, v = qkv[:, num_kv_heads: 2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens]
    expected = pool.clone()
    reference.write_kv(expected, k, v, slots, page_size)
    assert cpu_elementwise.write_kv(pool, k, v, slots, page_size)
    assert torch.equal(pool, expected)
    cpu.write_kv(pool, k.contiguous(), v, slots, page_size)  # a contiguous K too
    assert torch.equal(pool, expected)
    bad = slots.clone()
    bad[-1] = pages * page_size
    with pytest.raises(IndexError):
        cpu.write_kv(pool, k, v, bad, page_size)
    assert torch.equal(pool, expected)  # nothing written
    # what it does not take, the reference then stores: int32 slots, a pool of another dtype
    assert not cpu_elementwise.write_kv(pool, k, v, slots.int(), page_size)
    other = torch.float64 if dtype != torch.float64 else torch.float32
    assert not cpu_elementwise.write_kv(pool.to(other), k, v, slots, page_size)
