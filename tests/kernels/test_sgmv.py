"""The Triton SGMV / BGMV kernels against the torch references (interpreter on CPU, native on
a GPU): mixed ranks 1..64 with base-model segments, Punica's popularity patterns, odd sizes,
shuffled pages and rows that cross page boundaries."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton

from loraplex.kernels import reference, sgmv, sgmv_plan
from loraplex.kernels.sgmv_plan import SgmvPlan, plan_expand, plan_shrink
from tests.kernels.lora_batches import DEVICE, PATTERNS, LoraBatch, make_batch

# Per dtype (rtol, atol, why). Kernel and reference multiply the same stored values and
# accumulate in float32; they differ only in summation order and in final roundings.
TOLERANCE = {
    torch.float32: (1e-5, 1e-5, "same fp32 products, other summation order (tiles, split-K "
                                "atomics): a few ulp of 1.2e-7 on O(1)-O(10) sums"),
    torch.float16: (2e-3, 2e-3, "y is rounded to fp16 (2**-10 relative) after an fp32 sum whose "
                                "order differs: one last-bit flip"),
    torch.bfloat16: (1.6e-2, 1.6e-2, "GPU only (the interpreter's bf16 arithmetic is wrong): "
                                     "y rounded to bf16 (2**-7 relative), one last-bit flip"),
}
D_IN, D_OUT, PAGE_ELEMS = 100, 72, 80  # not multiples of 16; A and B^T rows cross pages
SHAPES = {
    "decode7": [1] * 7,
    "decode133": [1] * 133,
    "prefill133": [40, 1, 60, 25, 7],
}


def _check(batch: LoraBatch, dtype: torch.dtype, shrink_plan: SgmvPlan | None = None,
           expand_plan: SgmvPlan | None = None, max_rank: int | None = None) -> None:
    rtol, atol, _ = TOLERANCE[dtype]
    max_rank = max_rank or batch.max_rank
    seg = (batch.page_table, batch.seg_indptr, batch.ranks)
    h = sgmv.sgmv_shrink(batch.x, batch.pool, *seg, batch.a_offsets, max_rank,
                         plan=shrink_plan)
    h_ref = reference.lora_shrink(batch.x, batch.pool, *seg, batch.a_offsets, max_rank)
    assert h.dtype == torch.float32 and h.shape == (batch.x.shape[0], max_rank)
    torch.testing.assert_close(h, h_ref, rtol=rtol, atol=atol)
    y0 = torch.randn(batch.x.shape[0], batch.d_out, device=DEVICE).to(dtype)
    y, y_ref = y0.clone(), y0.clone()
    sgmv.sgmv_expand(h_ref, batch.pool, *seg, batch.b_offsets, batch.scales, y,
                     plan=expand_plan)
    reference.lora_expand(h_ref, batch.pool, *seg, batch.b_offsets, batch.scales, y_ref)
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol)
    bounds = batch.seg_indptr.tolist()
    for s, a in enumerate(batch.a):
        if a is None:  # base-model rows: y untouched bit for bit, h zero
            rows = slice(bounds[s], bounds[s + 1])
            assert torch.equal(y[rows], y0[rows]) and not h[rows].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pattern", PATTERNS)
def test_sgmv_matches_reference(pattern: str, shape: str, dtype: torch.dtype) -> None:
    batch = make_batch(pattern, SHAPES[shape], D_IN, D_OUT, PAGE_ELEMS, dtype)
    _check(batch, dtype)


@pytest.mark.parametrize("path", ["bgmv", "sgmv"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_both_paths_on_one_batch(path: str, split_k: int) -> None:
    # a mixed step: long prefill segments, single-token segments, segments sharing pages
    batch = make_batch("uniform", [19, 1, 1, 33, 2, 1, 1, 5], D_IN, D_OUT, PAGE_ELEMS,
                       merge=False, seed=3)
    block_m = 1 if path == "bgmv" else 16
    # max rank 64 over rank tiles of 32: two tiles, the second empty for most segments
    shrink = SgmvPlan(path, block_m, block_r=32, block_d=32, split_k=split_k)
    expand = SgmvPlan(path, block_m, block_r=32, block_d=32)
    _check(batch, torch.float32, shrink, expand)


def test_max_rank_wider_than_every_segment() -> None:
    # two rank tiles of 64: the second holds only zeros (h columns past each rank)
    batch = make_batch("distinct", [2, 3, 1], D_IN, D_OUT, PAGE_ELEMS, base_every=0, seed=1)
    _check(batch, torch.float32, max_rank=100)


def test_expand_takes_h_in_the_weights_dtype() -> None:
    # expand rounds h to the weights' dtype first, so an fp16 h gives the same y bit for bit
    batch = make_batch("zipf", [5, 1, 9], D_IN, D_OUT, PAGE_ELEMS, torch.float16, seed=5)
    seg = (batch.pool, batch.page_table, batch.seg_indptr, batch.ranks, batch.b_offsets,
           batch.scales)
    h = torch.randn(batch.x.shape[0], batch.max_rank, device=DEVICE)
    y0 = torch.randn(batch.x.shape[0], D_OUT, device=DEVICE).half()
    y32, y16 = y0.clone(), y0.clone()
    sgmv.sgmv_expand(h, *seg, y32)
    sgmv.sgmv_expand(h.half(), *seg, y16)
    assert torch.equal(y32, y16)


def test_only_base_model_segments() -> None:
    batch = make_batch("identical", [3, 4], D_IN, D_OUT, PAGE_ELEMS, base_every=1)
    assert not batch.ranks.any()
    _check(batch, torch.float32)


def test_large_pages_and_empty_segments() -> None:
    # a realistic page (one tile never crosses) and empty segments, which the engine may send
    batch = make_batch("zipf", [4, 1, 9], 48, 40, page_elems=4096, seed=2)
    batch.seg_indptr = torch.tensor([0] + batch.seg_indptr.tolist(), dtype=torch.int32,
                                    device=DEVICE)
    for name in ("ranks", "a_offsets", "b_offsets", "scales"):
        t = getattr(batch, name)
        setattr(batch, name, torch.cat([t[:1], t]))
    batch.page_table = torch.cat([batch.page_table[:1], batch.page_table])
    batch.a = [batch.a[0], *batch.a]
    batch.b = [batch.b[0], *batch.b]
    _check(batch, torch.float32)


@pytest.mark.parametrize("path", ["bgmv", "sgmv"])
def test_segment_lookup_over_several_chunks(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # programs scan segment boundaries SEGMENT_BLOCK at a time; 40 segments take 3 steps of 16
    monkeypatch.setattr(sgmv_plan, "SEGMENT_BLOCK", 16)
    tokens = [1, 2, 1, 5, 1, 1, 3] * 6
    batch = make_batch("distinct", tokens, 40, 24, 64, merge=False, seed=4)
    assert batch.num_segments > 32
    block_m = 1 if path == "bgmv" else 16
    _check(batch, torch.float32, SgmvPlan(path, block_m, 64, 32), SgmvPlan(path, block_m, 64, 32))


# --------------------------------------------------------------------------- plans

PLAN_SIZES = [
    # (tokens, segments, d, max_rank, page_elems, sms)
    (1, 1, 4096, 8, 32768, 132),
    (256, 256, 4096, 64, 32768, 132),
    (256, 16, 11008, 16, 32768, 132),
    (4096, 4, 4096, 64, 32768, 132),
    (133, 7, 100, 1, 80, 4),
    (7, 7, 100, 33, 20, 4),
    (3, 1, 5, 128, 16, 4),
]


@pytest.mark.parametrize("sizes", PLAN_SIZES)
def test_plans_respect_gpu_limits(sizes: tuple[int, ...]) -> None:
    tokens, segments, d, max_rank, page_elems, sms = sizes
    for plan in (plan_shrink(*sizes), plan_expand(*sizes)):
        # tl.dot tiles under 16 compile under the interpreter but not for the GPU
        assert plan.block_r >= 16 and plan.block_r == triton.next_power_of_2(plan.block_r)
        assert plan.block_d >= 16 and plan.block_d == triton.next_power_of_2(plan.block_d)
        assert plan.block_d <= max(page_elems, 16)  # a step spans at most two pages
        assert plan.block_r <= 64  # rank tiles beyond 64 loop instead of growing registers
        if plan.path == "sgmv":
            assert plan.block_m >= 16
        if tokens < 4 * segments:
            assert plan.path == "bgmv"


def test_plan_choices() -> None:
    # decode with distinct adapters: one program per token, rank tile covering every rank
    plan = plan_shrink(256, 256, 4096, 64, 32768, 132)
    assert (plan.path, plan.block_r) == ("bgmv", 64)
    # one token: too few programs, so the d_in loop is split across programs
    assert plan_shrink(1, 1, 4096, 16, 32768, 132).split_k >= 16
    # prefill on one adapter: large token tiles, enough of them without splitting d_in
    plan = plan_shrink(65536, 1, 4096, 16, 32768, 132)
    assert (plan.path, plan.block_m, plan.block_r, plan.split_k) == ("sgmv", 64, 16, 1)
    # expand with one token narrows its column tiles to occupy the device
    assert plan_expand(1, 1, 4096, 16, 32768, 132).block_d == 32
    assert plan_expand(256, 256, 4096, 16, 32768, 132).block_d == 256


@pytest.mark.parametrize("changes,match", [
    ({"block_r": 8}, "block_r"),
    ({"block_d": 48}, "block_d"),
    ({"path": "dense"}, "path"),
    ({"path": "sgmv", "block_m": 1}, "block_m"),
    ({"split_k": 0}, "split_k"),
])
def test_plan_validation(changes: dict[str, object], match: str) -> None:
    base = SgmvPlan("bgmv", 1, 16, 32)
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(base, **changes)


# --------------------------------------------------------------------------- launcher errors


def _shrink_args(batch: LoraBatch) -> dict[str, object]:
    return dict(x=batch.x, pool=batch.pool, page_table=batch.page_table,
                seg_indptr=batch.seg_indptr, ranks=batch.ranks, a_offsets=batch.a_offsets,
                max_rank=batch.max_rank)


def _expand_args(batch: LoraBatch) -> dict[str, object]:
    return dict(h=torch.zeros(batch.x.shape[0], batch.max_rank, device=DEVICE),
                pool=batch.pool, page_table=batch.page_table, seg_indptr=batch.seg_indptr,
                ranks=batch.ranks, b_offsets=batch.b_offsets, scales=batch.scales,
                y=torch.zeros(batch.x.shape[0], D_OUT, device=DEVICE))


@pytest.mark.parametrize("op,name,bad,match", [
    ("shrink", "x", lambda t: t.double(), "x: expected dtype"),
    ("shrink", "x", lambda t: t[:, None], "x: expected"),
    ("shrink", "x", lambda t: t.t(), "unit column stride"),
    ("shrink", "pool", lambda t: t.half(), "x: expected dtype"),
    ("shrink", "pool", lambda t: t.reshape(-1), "pool: expected"),
    ("shrink", "page_table", lambda t: t.long(), "page_table: expected dtype"),
    ("shrink", "page_table", lambda t: t[:-1], "page_table: expected"),
    ("shrink", "seg_indptr", lambda t: t.long(), "seg_indptr: expected dtype"),
    ("shrink", "ranks", lambda t: t[:-1], "ranks: expected"),
    ("shrink", "a_offsets", lambda t: t.int(), "a_offsets: expected dtype"),
    ("shrink", "max_rank", lambda v: -1, "max_rank"),
    ("shrink", "plan", lambda v: SgmvPlan("bgmv", 1, 16, 128), "exceeds page_elems"),
    ("expand", "h", lambda t: t.double(), "h: expected dtype"),
    ("expand", "y", lambda t: t[:-1], "y: expected"),
    ("expand", "y", lambda t: t.half(), "y: expected dtype"),
    ("expand", "scales", lambda t: t.double(), "scales: expected dtype"),
    ("expand", "scales", lambda t: t[:-1], "scales: expected"),
    ("expand", "b_offsets", lambda t: t[:-1], "b_offsets: expected"),
])
def test_launchers_refuse_bad_arguments(op: str, name: str, bad, match: str) -> None:
    batch = make_batch("uniform", [2, 3, 1], D_IN, D_OUT, PAGE_ELEMS)
    args = _shrink_args(batch) if op == "shrink" else _expand_args(batch)
    args[name] = bad(args.get(name))
    fn = sgmv.sgmv_shrink if op == "shrink" else sgmv.sgmv_expand
    with pytest.raises(ValueError, match=match):
        fn(**args)


def test_launchers_refuse_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_batch("uniform", [2, 3], D_IN, D_OUT, PAGE_ELEMS)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    args = _shrink_args(batch)
    args = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(ValueError, match="CUDA"):
        sgmv.sgmv_shrink(**args)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("tokens", [[1] * 256, [700, 1, 300, 45, 1, 1, 129]])
def test_sgmv_bf16_on_gpu(pattern: str, tokens: list[int]) -> None:
    batch = make_batch(pattern, tokens, 1000, 2752, page_elems=2 * 16 * 8 * 128,
                       dtype=torch.bfloat16)
    rtol, atol, _ = TOLERANCE[torch.bfloat16]
    seg = (batch.page_table, batch.seg_indptr, batch.ranks)
    h = sgmv.sgmv_shrink(batch.x, batch.pool, *seg, batch.a_offsets, batch.max_rank)
    h_ref = reference.lora_shrink(batch.x, batch.pool, *seg, batch.a_offsets, batch.max_rank)
    torch.testing.assert_close(h, h_ref, rtol=1e-3, atol=1e-3)  # both fp32 sums
    y0 = torch.randn(batch.x.shape[0], 2752, device=DEVICE).bfloat16()
    y, y_ref = y0.clone(), y0.clone()
    sgmv.sgmv_expand(h_ref, batch.pool, *seg, batch.b_offsets, batch.scales, y)
    reference.lora_expand(h_ref, batch.pool, *seg, batch.b_offsets, batch.scales, y_ref)
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol)
