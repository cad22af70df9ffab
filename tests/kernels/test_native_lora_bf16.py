"""The native long-segment bf16 LoRA kernel (``loraplex_lora_long_bf16`` in
``loraplex/kernels/csrc/lora.c``, through ``cpu_lora_native.lora_long_bf16_segments``; called by
``cpu.lora_segments`` for every bf16 segment longer than the short kernel's) against float64
math with ``h`` rounded to bf16 (the semantics of the oneDNN path it replaces) and against that
path itself: the cases of ``test_native_lora.py`` (fused groups of 1-3 modules read in place
from a NaN-poisoned paged pool, odd ranks, a row length of 133 and module widths of 7, 600 and
40: every vector tail), segments of 17 to 300 rows (more than one 128-row work item), one and
two threads; each on AVX512-BF16's pair dot products and, where the CPU has AMX, on tiles,
those also at a row length of 96 (the tiles' depth: three 32-deep blocks) with ranks of 1 to
80 (one to four 16-rank tiles, an expand two tiles deep, and a rank over 64 left to the pair
dot products in the same call).

Runs only where the library was built with AVX512-BF16 (``has_long_bf16``; Zen 4, Zen 5,
Sapphire Rapids); elsewhere the engine keeps oneDNN's bf16 GEMMs and these tests skip. The
tile cases skip on CPUs without AMX (``tiles_available``)."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import cpu, cpu_lora_native, native
from tests.kernels.lora_batches import PATTERNS
from tests.kernels.test_native_lora import Case, _bf16_ulp, refused_before_any_write

pytestmark = pytest.mark.skipif(
    not native.available("lora") or not cpu_lora_native.has_long_bf16(),
    reason="native kernels off, no C compiler, or a CPU without AVX512-BF16")

KERNELS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_lora_native.tiles_available(), reason="a CPU without AMX tiles"))]
KERNEL_IDS = ["pairs", "tiles"]
# (row length, ranks): every tail of the pair dot products; the tiles' own shapes
SHAPES = {"odd": (133, (8, 16, 64, 3, 7)), "tiled": (96, (8, 16, 64, 1, 33, 80, 17))}


def _long(tiles: bool):
    return lambda x, y, segs: cpu_lora_native.lora_long_bf16_segments(x, y, segs, tiles=tiles)


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


@pytest.mark.parametrize("tiles", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_modules", [1, 2, 3])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_within_one_rounding_of_h_rounded_math(pattern: str, num_modules: int,
                                               threads: int, shape: str, tiles: bool) -> None:
    d_in, ranks = SHAPES[shape]
    case = Case(pattern, torch.bfloat16, num_modules, rows=LONG_ROWS, d_in=d_in, ranks=ranks)
    y = case.y0.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rest = cpu_lora_native.lora_long_bf16_segments(case.x, y, case.segments, tiles=tiles)
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


@pytest.mark.parametrize("tiles", KERNELS, ids=KERNEL_IDS)
def test_two_threads_change_no_bit(tiles: bool) -> None:
    d_in, ranks = SHAPES["tiled"]
    case = Case("distinct", torch.bfloat16, 3, seed=3, rows=LONG_ROWS, d_in=d_in, ranks=ranks)
    ys = []
    for threads in (1, 2):
        y = case.y0.clone()
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            cpu_lora_native.lora_long_bf16_segments(case.x, y, case.segments, tiles=tiles)
        finally:
            torch.set_num_threads(before)
        ys.append(y)
    assert torch.equal(ys[0], ys[1])


@pytest.mark.parametrize("tiles", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_agrees_with_the_onednn_path(shape: str, tiles: bool) -> None:
    # the path it replaces: h = torch.mm in bf16, then addmm_ into y (one rounding)
    d_in, ranks = SHAPES[shape]
    case = Case("zipf", torch.bfloat16, 3, seed=1, rows=LONG_ROWS, d_in=d_in, ranks=ranks)
    y_dnn = case.y0.clone()
    for seg in case.segments:
        g = seg.group
        y_dnn[seg.lo:seg.hi, g.span_lo:g.span_hi].addmm_(
            torch.mm(case.x[seg.lo:seg.hi], g.a_cat(torch.bfloat16)), g.b_wide(torch.bfloat16),
            alpha=seg.scale)
    y = case.y0.clone()
    cpu_lora_native.lora_long_bf16_segments(case.x, y, case.segments, tiles=tiles)
    _, bound = _h_rounded_exact(case)
    assert ((y.double() - y_dnn.double()).abs() <= 2 * bound).all()
    assert (y == y_dnn).float().mean() > 0.9  # mostly the same bits


def _order_sensitive(rows: int = 20, cols: int = 40
                     ) -> tuple[torch.Tensor, torch.Tensor, cpu.SegmentBlocks]:
    """A rank-1 segment whose h depends on the order of the shrink's sums: x . A's terms at
    depths 0, 2 and 32 are 2^25, 1 and -2^25. The pair dot products keep depths 0 and 32 in one
    lane (2^25 - 2^25) and 2 in another, so h = 1; the tiles sum a 32-deep block in order, and
    2^25 + 1 rounds to 2^25 in float32, so h = 0."""
    x = torch.zeros(rows, 64, dtype=torch.bfloat16)
    x[:, 0], x[:, 2], x[:, 32] = 2.0 ** 13, 1.0, -(2.0 ** 13)
    a = torch.zeros(1, 64, dtype=torch.bfloat16)
    a[0, 0], a[0, 2], a[0, 32] = 2.0 ** 12, 1.0, 2.0 ** 12
    bt = torch.ones(1, cols, dtype=torch.bfloat16)
    group = cpu.GroupBlocks([cpu.ModuleBlocks(0, cols, a.t(), bt)])
    return x, torch.zeros(rows, cols, dtype=torch.bfloat16), cpu.SegmentBlocks(0, rows, 1.0,
                                                                               group)


@pytest.mark.parametrize("tiles", KERNELS, ids=KERNEL_IDS)
def test_the_kernels_sum_in_their_own_orders(tiles: bool) -> None:
    x, y, seg = _order_sensitive()
    assert cpu_lora_native.lora_long_bf16_segments(x, y, [seg], tiles=tiles) == []
    assert (y == (0.0 if tiles else 1.0)).all()


@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_engine_routes_long_bf16_segments_here(switch: str, monkeypatch) -> None:
    # cpu.lora_segments and LoraPlan: short segments in the short kernel, the long ones in this
    # kernel, on tiles where the CPU has them unless LORAPLEX_AMX_LORA=0
    from tests.kernels.test_native_lora import ROWS
    monkeypatch.setenv("LORAPLEX_AMX_LORA", switch)
    tiles = switch == "1" and cpu_lora_native.tiles_available()
    assert cpu_lora_native.has_long_bf16_tiles() == tiles
    case = Case("zipf", torch.bfloat16, 3, seed=2, rows=ROWS)
    long = [s for s in case.segments if s.hi - s.lo > cpu._SHORT_SEGMENT]
    short = [s for s in case.segments if s.hi - s.lo <= cpu._SHORT_SEGMENT]
    assert long and short
    y = case.y0.clone()
    cpu.lora_segments(case.x, y, case.segments)
    expected = case.y0.clone()
    assert cpu_lora_native.lora_short_segments(case.x, expected, short, cpu._SHORT_SEGMENT) == []
    assert cpu_lora_native.lora_long_bf16_segments(case.x, expected, long) == []
    assert torch.equal(y, expected)
    # which kernel: the order-sensitive segment gives 0 on tiles, 1 on pair dot products
    x, y, seg = _order_sensitive()
    cpu.lora_segments(x, y, [seg])
    assert (y == (0.0 if tiles else 1.0)).all()
    y.zero_()
    plan = cpu.LoraPlan(torch.bfloat16, x.device,
                        [(0, x.shape[0], 1.0, cpu.GroupLayers([seg.group]))])
    plan(0, x, y)
    assert (y == (0.0 if tiles else 1.0)).all()


@pytest.mark.skipif(cpu_lora_native.tiles_available(), reason="this CPU has AMX tiles")
def test_tiles_refused_where_the_cpu_has_none() -> None:
    case = Case("uniform", torch.bfloat16, 2, rows=LONG_ROWS)
    y = case.y0.clone()
    with pytest.raises(ValueError, match="AMX tiles"):
        cpu_lora_native.lora_long_bf16_segments(case.x, y, case.segments, tiles=True)
    assert torch.equal(y, case.y0)


@pytest.mark.parametrize("tiles", KERNELS, ids=KERNEL_IDS)
def test_rounds_y_as_torch_does(tiles: bool) -> None:
    # 20 rows, rank 1, x one-hot and A[0, 0] = 1: h = 1 exactly, so row i's delta is B's row and
    # y's new value must be torch's `(y.float() + delta).to(bf16)` bit for bit: ties to even,
    # overflow to inf, NaN kept. (Not bf16 denormals: the pair dot product reads them as zero,
    # as oneDNN's AVX512-BF16 kernels do, and so do the tiles.)
    rows, cols = 20, 70
    gen = torch.Generator().manual_seed(3)
    x = torch.zeros(rows, 32, dtype=torch.bfloat16)
    x[:, 0] = 1
    a = torch.zeros(1, 32, dtype=torch.bfloat16)
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
    rest = cpu_lora_native.lora_long_bf16_segments(x, y, [cpu.SegmentBlocks(0, rows, 1.0, group)],
                                                   tiles=tiles)
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


@pytest.mark.parametrize("tiles", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("bad", ["rows", "columns", "width"])
def test_out_of_bounds_refused_before_any_write(bad: str, tiles: bool) -> None:
    d_in, ranks = SHAPES["tiled"]
    refused_before_any_write(Case("distinct", torch.bfloat16, 2, rows=LONG_ROWS, d_in=d_in,
                                  ranks=ranks), bad, _long(tiles))
