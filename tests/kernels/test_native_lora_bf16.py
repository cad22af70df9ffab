"""The native long-segment bf16 LoRA kernel (``loraplex_lora_long_bf16`` in
``loraplex/kernels/csrc/lora.c``, through ``cpu_lora_native.lora_long_bf16_segments``; called by
``cpu.lora_segments`` on a CPU without AMX) against float64 math with ``h`` rounded to bf16 (the
semantics of the oneDNN path it replaces) and against that path itself: the cases of
``test_native_lora.py`` (fused groups of 1-3 modules read in place from a NaN-poisoned paged
pool, odd ranks, a row length of 133 and module widths of 7, 600 and 40: every vector tail),
segments of 17 to 300 rows (more than one 128-row work item), one and two threads.

Runs only where the library was built with AVX512-BF16 (``has_long_bf16``; Zen 4, Zen 5,
Sapphire Rapids); elsewhere the engine keeps oneDNN's bf16 GEMMs and these tests skip."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import cpu, cpu_lora_native, native
from tests.kernels.lora_batches import PATTERNS
from tests.kernels.test_native_lora import Case, _bf16_ulp, refused_before_any_write

pytestmark = pytest.mark.skipif(
    not native.available("lora") or not cpu_lora_native.has_long_bf16(),
    reason="native kernels off, no C compiler, or a CPU without AVX512-BF16")

# long segments only (the kernel's own cases), one past a 128-row work item
LONG_ROWS = (17, 40, 101, 300, 33, 20, 129, 64)


def _h_rounded_exact(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``y0 + scale * bf16(x A^T) B^T`` and the bound on the kernel's distance from it.

    The kernel's h is float32's sum rounded to bf16, which may round the other way than the
    float64 sum does where it lies within float32's error of a tie: one bf16 ulp of h, times
    |B|; then y's one rounding (one bf16 ulp) and float32's error in the expand.
    """
    out = case.y0.double().clone()
    bound = _bf16_ulp(out).mul(0)
    for seg in case.segments:
        for start, end, w, b in case.dense[case.adapter[id(seg.group)]]:
            h = case.x[seg.lo:seg.hi].double() @ w.double().T
            hr = h.to(torch.bfloat16).double()
            out[seg.lo:seg.hi, start:end] += seg.scale * hr @ b.double().T
            bound[seg.lo:seg.hi, start:end] += abs(seg.scale) * (
                _bf16_ulp(h) @ b.double().abs().T + 2.0 ** -20 * (hr.abs() @ b.double().abs().T))
    return out, bound + _bf16_ulp(out)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_modules", [1, 2, 3])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_within_one_rounding_of_h_rounded_math(pattern: str, num_modules: int,
                                               threads: int) -> None:
    case = Case(pattern, torch.bfloat16, num_modules, rows=LONG_ROWS)
    y = case.y0.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rest = cpu_lora_native.lora_long_bf16_segments(case.x, y, case.segments)
    finally:
        torch.set_num_threads(before)
    assert rest == []
    exact, bound = _h_rounded_exact(case)
    err = (y.double() - exact).abs()
    assert y.isfinite().all()  # nothing read from the pool's NaN outside the blocks
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    keep = case.untouched()
    assert torch.equal(y[keep], case.y0[keep])  # base rows, gaps, untargeted modules
    assert not torch.equal(y, case.y0)


def test_two_threads_change_no_bit() -> None:
    case = Case("distinct", torch.bfloat16, 3, seed=3, rows=LONG_ROWS)
    ys = []
    for threads in (1, 2):
        y = case.y0.clone()
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            cpu_lora_native.lora_long_bf16_segments(case.x, y, case.segments)
        finally:
            torch.set_num_threads(before)
        ys.append(y)
    assert torch.equal(ys[0], ys[1])


def test_agrees_with_the_onednn_path() -> None:
    # the path it replaces: h = torch.mm in bf16, then addmm_ into y (one rounding)
    case = Case("zipf", torch.bfloat16, 3, seed=1, rows=LONG_ROWS)
    y_dnn = case.y0.clone()
    for seg in case.segments:
        g = seg.group
        y_dnn[seg.lo:seg.hi, g.span_lo:g.span_hi].addmm_(
            torch.mm(case.x[seg.lo:seg.hi], g.a_cat(torch.bfloat16)), g.b_wide(torch.bfloat16),
            alpha=seg.scale)
    y = case.y0.clone()
    cpu_lora_native.lora_long_bf16_segments(case.x, y, case.segments)
    _, bound = _h_rounded_exact(case)
    assert ((y.double() - y_dnn.double()).abs() <= 2 * bound).all()
    assert (y == y_dnn).float().mean() > 0.9  # mostly the same bits


@pytest.mark.parametrize("cpu_amx", [True, False], indirect=True)
def test_the_engine_routes_long_bf16_segments_by_amx(cpu_amx: bool) -> None:
    # cpu.lora_segments: short segments in the short kernel either way; the long ones in this
    # kernel without AMX, on oneDNN's (AMX) bf16 GEMMs with it
    from tests.kernels.test_native_lora import ROWS
    case = Case("zipf", torch.bfloat16, 3, seed=2, rows=ROWS)
    long = [s for s in case.segments if s.hi - s.lo > cpu._SHORT_SEGMENT]
    short = [s for s in case.segments if s.hi - s.lo <= cpu._SHORT_SEGMENT]
    assert long and short
    y = case.y0.clone()
    cpu.lora_segments(case.x, y, case.segments)
    expected = case.y0.clone()
    assert cpu_lora_native.lora_short_segments(case.x, expected, short, cpu._SHORT_SEGMENT) == []
    if cpu_amx:
        for seg in long:
            g = seg.group
            expected[seg.lo:seg.hi, g.span_lo:g.span_hi].addmm_(
                torch.mm(case.x[seg.lo:seg.hi], g.a_cat(torch.bfloat16)),
                g.b_wide(torch.bfloat16), alpha=seg.scale)
    else:
        assert cpu_lora_native.lora_long_bf16_segments(case.x, expected, long) == []
    assert torch.equal(y, expected)


def test_rounds_y_as_torch_does() -> None:
    # 20 rows, rank 1, x one-hot and A[0, 0] = 1: h = 1 exactly, so row i's delta is B's row and
    # y's new value must be torch's `(y.float() + delta).to(bf16)` bit for bit: ties to even,
    # overflow to inf, NaN kept. (Not bf16 denormals: the pair dot product reads them as zero,
    # as oneDNN's AVX512-BF16 kernels do.)
    rows, cols = 20, 70
    gen = torch.Generator().manual_seed(3)
    x = torch.zeros(rows, 8, dtype=torch.bfloat16)
    x[:, 0] = 1
    a = torch.zeros(1, 8, dtype=torch.bfloat16)
    a[0, 0] = 1
    bt = (torch.randn(1, cols, generator=gen) * 3).to(torch.bfloat16)
    y0 = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    specials = [(1.0, 2.0 ** -8), (1.0 + 2.0 ** -7, 2.0 ** -8), (-3.0, -2.0 ** -7),
                (3.3e38, 3.3e38), (1.0, float("nan")), (float("nan"), 1.0),
                (float("inf"), -1.0)]
    for i, (yv, d) in enumerate(specials):
        y0[:, 65 - i], bt[0, 65 - i] = yv, d  # in the last 16-column vector's tail
    group = cpu.GroupBlocks([cpu.ModuleBlocks(0, cols, a.t(), bt)])
    y = y0.clone()
    rest = cpu_lora_native.lora_long_bf16_segments(x, y, [cpu.SegmentBlocks(0, rows, 1.0, group)])
    assert rest == []
    expected = (y0.float() + bt.float()).to(torch.bfloat16)
    nan = expected.isnan()
    assert torch.equal(y.isnan(), nan) and nan.sum() == 2 * rows
    assert torch.equal(y[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert y[0, 65] == 1.0 and y[0, 64] == 1.0 + 2.0 ** -6 and y[0, 62] == float("inf")


def test_other_dtypes_left_to_the_caller() -> None:
    f32 = Case("uniform", torch.float32, 2, rows=LONG_ROWS)
    y = f32.y0.clone()
    assert cpu_lora_native.lora_long_bf16_segments(f32.x, y, f32.segments) is f32.segments
    # bf16 activations with float32 blocks (a table of float32 rows): returned, not run
    bf = Case("uniform", torch.bfloat16, 2, rows=LONG_ROWS)
    y = bf.y0.clone()
    assert cpu_lora_native.lora_long_bf16_segments(bf.x, y, f32.segments) == f32.segments
    assert cpu_lora_native.lora_long_bf16_segments(bf.x, y.t(), bf.segments) is bf.segments
    assert torch.equal(y, bf.y0)


@pytest.mark.parametrize("bad", ["rows", "columns", "width"])
def test_out_of_bounds_refused_before_any_write(bad: str) -> None:
    refused_before_any_write(Case("distinct", torch.bfloat16, 2, rows=LONG_ROWS), bad,
                             cpu_lora_native.lora_long_bf16_segments)
