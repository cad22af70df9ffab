"""The LoRA reference ops against dense math on the plain A / B tensors: this is what makes
them the oracle for the Triton kernels and the engine's CPU path (``tests/kernels/test_cpu.py``)."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import reference
from loraplex.kernels.layout import adapter_layout, read_region, write_region
from tests.kernels.lora_batches import DEVICE, PATTERNS, make_batch

# Per dtype (rtol, atol). The reference and the dense oracle multiply the same stored values;
# the oracle sums in float64 and rounds once.
TOLERANCE = {
    # float32 sums of <= 100 O(1) products: a few ulp (1.2e-7 each) from summation order
    torch.float32: (1e-5, 1e-5),
    # y is rounded to fp16 once in each: a last-bit flip is 2**-10 relative
    torch.float16: (2e-3, 2e-3),
}
SHAPES = {
    "decode7": [1] * 7,
    "decode133": [1] * 133,
    "prefill133": [40, 1, 60, 25, 7],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pattern", PATTERNS)
def test_reference_matches_dense(pattern: str, shape: str, dtype: torch.dtype) -> None:
    batch = make_batch(pattern, SHAPES[shape], d_in=100, d_out=72, page_elems=80, dtype=dtype)
    rtol, atol = TOLERANCE[dtype]
    h = reference.lora_shrink(batch.x, batch.pool, batch.page_table, batch.seg_indptr,
                              batch.ranks, batch.a_offsets, batch.max_rank)
    torch.testing.assert_close(h, batch.dense_shrink(), rtol=rtol, atol=atol)
    y0 = torch.randn(batch.x.shape[0], 72, device=DEVICE).to(dtype)
    y = y0.clone()
    reference.lora_expand(h, batch.pool, batch.page_table, batch.seg_indptr, batch.ranks,
                          batch.b_offsets, batch.scales, y)
    torch.testing.assert_close(y, batch.dense_expand(h, y0), rtol=rtol, atol=atol)
    base_rows = [t for s, a in enumerate(batch.a) if a is None
                 for t in range(batch.seg_indptr[s], batch.seg_indptr[s + 1])]
    assert base_rows, "every batch has base-model rows"
    assert torch.equal(y[base_rows], y0[base_rows])  # rank 0: untouched, bit for bit
    assert not h[base_rows].any()


def test_reference_segments_sharing_pages() -> None:
    # one segment per request: segments repeat an adapter's page-table row
    batch = make_batch("identical", [3, 1, 2, 5], d_in=33, d_out=20, page_elems=64,
                       merge=False)
    assert batch.num_segments == 4
    h = reference.lora_shrink(batch.x, batch.pool, batch.page_table, batch.seg_indptr,
                              batch.ranks, batch.a_offsets, batch.max_rank)
    torch.testing.assert_close(h, batch.dense_shrink(), rtol=1e-5, atol=1e-5)


def test_region_rows_crosses_pages() -> None:
    page_elems = 16
    pool = torch.zeros(10, page_elems)
    pages = torch.tensor([7, 2, 9, 0], dtype=torch.int32)
    lay = adapter_layout(3, ["m"], {"m": (10, 6)})  # A rows of 10 straddle the 16-element pages
    a = torch.arange(30, dtype=torch.float32).view(3, 10)
    write_region(pool, pages, lay.a_offsets["m"], a)
    assert torch.equal(reference.region_rows(pool, pages, 0, 3, 10), a)
    assert torch.equal(read_region(pool, pages, 0, 30).view(3, 10), a)
    # a block inside one page is a view, not a copy
    assert reference.region_rows(pool, pages, 0, 1, 10).data_ptr() == pool[7].data_ptr()


@pytest.mark.parametrize("indptr,ranks,match", [
    ([0, 2], [1], "rise from 0 to 3"),
    ([0, 3, 1, 3], [1, 1, 1], "rise from 0"),
    ([0, 3], [5], r"ranks: must lie in \[0, 4\]"),
    ([0, 1, 3], [1], "disagree"),
])
def test_reference_refuses_bad_segments(indptr: list[int], ranks: list[int], match: str) -> None:
    x = torch.zeros(3, 8)
    pool = torch.zeros(4, 64)
    table = torch.zeros(len(ranks), 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        reference.lora_shrink(x, pool, table, torch.tensor(indptr, dtype=torch.int32),
                              torch.tensor(ranks, dtype=torch.int32),
                              torch.zeros(len(ranks), dtype=torch.int64), max_rank=4)
