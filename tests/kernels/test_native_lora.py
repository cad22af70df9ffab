"""The native short-segment LoRA kernel (``loraplex/kernels/csrc/lora.c`` through
``loraplex/kernels/cpu_lora_native.py``, called by ``cpu.lora_segments``) against a float64 oracle
and the torch path: fused groups of 1-3 modules read in place from a paged pool (blocks that cross
pages are copies, the rest views), adapters that target only some modules, mixed and odd ranks,
Punica's popularity patterns, segments of 1 to 16 rows beside long ones in one call, float32
and bfloat16, one and two threads."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.kernels import cpu, cpu_lora_native, native, reference
from loraplex.kernels.layout import adapter_layout, write_region
from tests.kernels.lora_batches import PATTERNS, assign_adapters

pytestmark = pytest.mark.skipif(not native.available("lora"),
                                reason="native kernels off or no C compiler")

RANKS = (8, 16, 64, 3, 7)
D_IN = 133  # not a multiple of 16 (nor of the kernel's vector width)
WIDTHS = (7, 600, 40)  # the modules' d_out: odd, and 600 spans two tiles of a 16-row segment
# Segments of 1 to 16 rows (decode rows) and longer ones (prefill: native in float32, the torch
# path's bf16 GEMMs in bf16), up to a whole prompt of 101 rows.
# Every fifth segment (4, 9) is the base model's.
ROWS = (1, 3, 16, 40, 1, 101, 2, 17, 7, 1, 5, 12, 1)


class Case:
    """A fused projection's step: x, y0 and the segments, with the plain weights kept."""

    def __init__(self, pattern: str, dtype: torch.dtype, num_modules: int, seed: int = 0,
                 rows: tuple[int, ...] = ROWS, d_in: int = D_IN,
                 ranks: tuple[int, ...] = RANKS) -> None:
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        names = [f"m{i}" for i in range(num_modules)]
        shapes = {n: (d_in, w) for n, w in zip(names, WIDTHS)}
        starts, col = [], 5  # a gap before the first module and between modules
        for w in WIDTHS[:num_modules]:
            starts.append(col)
            col += w + 3
        self.num_cols = col + 1
        adapter_of = assign_adapters(pattern, len(rows), rng)
        page_elems = 160  # rows of 133 cross pages: some blocks are copies, some views
        layouts, targets = {}, {}
        for a in sorted(set(adapter_of)):
            # every third adapter targets all modules, the others all but one
            skip = None if a % 3 == 0 or num_modules == 1 else names[a % num_modules]
            targets[a] = [n for n in names if n != skip]
            layouts[a] = adapter_layout(ranks[a % len(ranks)], targets[a], shapes)
        num_pages = sum(lay.num_pages(page_elems) for lay in layouts.values()) + 2
        # NaN wherever no block lies: a read outside a block poisons the result
        self.pool = torch.full((num_pages, page_elems), float("nan"), dtype=dtype)
        free = list(range(num_pages))
        rng.shuffle(free)
        groups, self.dense = {}, {}
        for a, lay in layouts.items():
            pages = [free.pop() for _ in range(lay.num_pages(page_elems))]
            blocks, dense = [], []
            for n in targets[a]:
                i = names.index(n)
                w = (torch.randn(lay.rank, d_in, generator=gen) / d_in ** 0.5).to(dtype)
                b = torch.randn(WIDTHS[i], lay.rank, generator=gen).to(dtype)
                write_region(self.pool, pages, lay.a_offsets[n], w)
                write_region(self.pool, pages, lay.b_offsets[n], b.T.contiguous())
                pt = torch.tensor(pages)
                a_rows = reference.region_rows(self.pool, pt, lay.a_offsets[n], lay.rank, d_in)
                bt = reference.region_rows(self.pool, pt, lay.b_offsets[n], lay.rank, WIDTHS[i])
                blocks.append(cpu.ModuleBlocks(starts[i], starts[i] + WIDTHS[i], a_rows.t(), bt))
                dense.append((starts[i], starts[i] + WIDTHS[i], w, b))
            groups[a] = cpu.GroupBlocks(blocks)
            self.dense[a] = dense
        bounds = [0]
        for n in rows:
            bounds.append(bounds[-1] + n)
        self.x = torch.randn(bounds[-1], d_in, generator=gen).to(dtype)
        self.y0 = torch.randn(bounds[-1], self.num_cols, generator=gen).to(dtype)
        # every fifth segment is the base model's: no SegmentBlocks, its rows untouched
        self.segments = [
            cpu.SegmentBlocks(bounds[s], bounds[s + 1], 0.5 + rng.random(), groups[a])
            for s, a in enumerate(adapter_of) if s % 5 != 4]
        self.adapter = {id(groups[a]): a for a in groups}

    def exact(self) -> torch.Tensor:
        """``y0 + scale * (x A^T) B^T`` per segment and targeted module, in float64."""
        out = self.y0.double()
        for seg in self.segments:
            for start, end, w, b in self.dense[self.adapter[id(seg.group)]]:
                xs = self.x[seg.lo:seg.hi].double()
                out[seg.lo:seg.hi, start:end] += seg.scale * (xs @ w.double().T) @ b.double().T
        return out

    def magnitude(self) -> torch.Tensor:
        """``|y0| + |scale| (|x| |A|^T) |B|^T``: what float32 rounding errors scale with."""
        out = self.y0.double().abs()
        for seg in self.segments:
            for start, end, w, b in self.dense[self.adapter[id(seg.group)]]:
                xs = self.x[seg.lo:seg.hi].double().abs()
                out[seg.lo:seg.hi, start:end] += (
                    abs(seg.scale) * (xs @ w.double().abs().T) @ b.double().abs().T)
        return out

    def run(self, threads: int = 1) -> torch.Tensor:
        y = self.y0.clone()
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            cpu.lora_segments(self.x, y, self.segments)
        finally:
            torch.set_num_threads(before)
        return y

    def untouched(self) -> torch.Tensor:
        """``[T, cols]`` bool: elements no segment's module writes."""
        mask = torch.ones(self.y0.shape, dtype=torch.bool)
        for seg in self.segments:
            for start, end, _, _ in self.dense[self.adapter[id(seg.group)]]:
                mask[seg.lo:seg.hi, start:end] = False
        return mask


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    # spacing of bf16 values (8 significant bits) at |v|
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -100))) - 7)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_modules", [1, 2, 3])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_float32_equals_exact_math(pattern: str, num_modules: int, threads: int) -> None:
    # float32 sums of <= 133 products of O(1) terms (then <= 64 for the expand) in another
    # order than float64's: a few ulp of the largest term, so 1e-5 relative plus an absolute
    # 1e-5 of the outputs' scale for elements near cancellation.
    case = Case(pattern, torch.float32, num_modules)
    y = case.run(threads)
    exact = case.exact()
    torch.testing.assert_close(y.double(), exact, rtol=1e-5,
                               atol=1e-5 * exact.abs().max().item())
    keep = case.untouched()
    assert torch.equal(y[keep], case.y0[keep])  # base rows, gaps, untargeted modules
    # every float32 segment ran natively, the long ones (prefill) as well as the short ones
    assert any(s.hi - s.lo > cpu._SHORT_SEGMENT for s in case.segments)
    assert all(s.group.native is not None for s in case.segments)


def test_two_threads_change_no_bit() -> None:
    # each output element is one thread's sum in one order whatever the split of the work
    # over threads (round-robin items): one and two threads agree exactly (float32: every
    # segment native, the long one too)
    case = Case("distinct", torch.float32, 3, seed=3)
    assert max(s.hi - s.lo for s in case.segments) == 101
    assert torch.equal(case.run(1), case.run(2))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_modules", [1, 3])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_bfloat16_within_last_bit_of_exact_math(pattern: str, num_modules: int,
                                                threads: int) -> None:
    # bf16 blocks read in place, widened exactly; h and the delta in float32, y rounded once:
    # within one bf16 ulp of the exact value plus float32's error, which scales with the sum
    # of the terms' magnitudes (2**-17 of it: 128 float32 ulps, where bf16's last bit is
    # 2**-8; it matters only where y0 and the delta cancel). Long segments round h to bf16
    # (the torch path's): bf16's last bits of the outputs' scale.
    case = Case(pattern, torch.bfloat16, num_modules)
    y = case.run(threads)
    exact = case.exact()
    short = torch.zeros(y.shape, dtype=torch.bool)
    for seg in case.segments:
        if seg.hi - seg.lo <= cpu._SHORT_SEGMENT:
            short[seg.lo:seg.hi] = True
    err = (y.double() - exact).abs()
    bound = _bf16_ulp(exact) + 2.0 ** -17 * case.magnitude()
    assert (err[short] <= bound[short]).all()
    torch.testing.assert_close(y.double(), exact, rtol=3e-2, atol=6e-2)
    keep = case.untouched()
    assert torch.equal(y[keep], case.y0[keep])


def test_bfloat16_rounds_as_torch_does() -> None:
    # One row, rank 1, x one-hot and A[0, 0] = 1: h = 1 exactly, so the delta is B's row
    # (float32 blocks) and y's new value must be torch's `(y.float() + delta).to(bf16)` bit for
    # bit: ties to even, overflow to inf, NaN kept.
    cols = 64
    gen = torch.Generator().manual_seed(3)
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    x[0, 0] = 1
    a = torch.zeros(1, 8)
    a[0, 0] = 1
    bt = torch.randn(1, cols, generator=gen) * 3
    y0 = torch.randn(1, cols, generator=gen).to(torch.bfloat16)
    specials = [(1.0, 2.0 ** -8), (1.0 + 2.0 ** -7, 2.0 ** -8), (-3.0, -2.0 ** -7),
                (3.3e38, 3.3e38), (1.0, float("nan")), (float("nan"), 1.0),
                (float("inf"), -1.0), (2.0 ** -130, 2.0 ** -131)]
    for i, (yv, d) in enumerate(specials):
        y0[0, i], bt[0, i] = yv, d
    group = cpu.GroupBlocks([cpu.ModuleBlocks(0, cols, a.t(), bt)])
    y = y0.clone()
    rest = cpu_lora_native.lora_short_segments(x, y, [cpu.SegmentBlocks(0, 1, 1.0, group)], 16)
    assert rest == []
    expected = (y0.float() + bt).to(torch.bfloat16)
    nan = expected.isnan()
    assert torch.equal(y.isnan(), nan) and nan.sum() == 2
    assert torch.equal(y[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert y[0, 0] == 1.0 and y[0, 1] == 1.0 + 2.0 ** -6 and y[0, 3] == float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_disabled_takes_the_torch_path_and_agrees(dtype: torch.dtype, monkeypatch) -> None:
    on = Case("zipf", dtype, 3, seed=1)
    y_on = on.run()
    monkeypatch.setenv("LORAPLEX_NATIVE_KERNELS", "0")
    monkeypatch.setattr(native, "_loaded", {})
    off = Case("zipf", dtype, 3, seed=1)
    y_off = off.run()
    assert all(s.group.native is None for s in off.segments)  # nothing ran natively
    assert torch.equal(on.y0, off.y0)
    if dtype == torch.float32:  # the same math in another summation order
        torch.testing.assert_close(y_on, y_off, rtol=1e-5, atol=1e-5)
    else:  # both round float32 sums once: one bf16 ulp apart plus float32's error (above)
        bound = _bf16_ulp(y_off.double()) + 2.0 ** -16 * on.magnitude()
        assert ((y_on.double() - y_off.double()).abs() <= bound).all()
    assert not torch.equal(y_on, on.y0)


def test_half_precision_and_strided_outputs_left_to_torch() -> None:
    case = Case("uniform", torch.float32, 2)
    y = case.y0.clone()
    half = case.x.half()
    assert cpu_lora_native.lora_short_segments(half, y.half(), case.segments, 16) is \
        case.segments
    assert cpu_lora_native.lora_short_segments(case.x, y.t(), case.segments, 16) is \
        case.segments
    assert torch.equal(y, case.y0)


def refused_before_any_write(case: Case, bad: str, run) -> None:
    """``run(x, y, segments)`` on a segment past x's rows, a y narrower than a module's columns,
    or an x narrower than A's rows: a ValueError and y untouched (the checks run in C first)."""
    seg = case.segments[0]
    x, y = case.x, case.y0.clone()
    if bad == "rows":
        segments = [seg, cpu.SegmentBlocks(x.shape[0] - 1, x.shape[0] + 1, 1.0, seg.group)]
    elif bad == "columns":
        y = y[:, :seg.group.span_hi - 1]
        segments = [seg]
    else:
        x = x[:, :x.shape[1] - 1]
        segments = [seg]
    before = y.clone()
    with pytest.raises(ValueError, match="native LoRA"):
        run(x, y, segments)
    assert torch.equal(y, before)


@pytest.mark.parametrize("bad", ["rows", "columns", "width"])
def test_out_of_bounds_refused_before_any_write(bad: str) -> None:
    refused_before_any_write(Case("distinct", torch.float32, 2), bad,
                             lambda x, y, segs: cpu_lora_native.lora_short_segments(x, y, segs, 16))


needs_pairs = pytest.mark.skipif(not cpu_lora_native.has_long_bf16(),
                                 reason="the library has no AVX512-BF16 pair dot products")
# decode-like batches: segments of 1-3 rows (read in memory order when on) beside 4 and 16 rows
STREAM_ROWS = (1, 2, 3, 1, 1, 4, 2, 1, 3, 16, 1, 2, 1, 3)


@pytest.fixture
def stream_mode():
    """``cpu_lora_native.set_stream`` for one test, the process's mode restored after."""
    before: list[int] = []

    def set_mode(mode: int) -> None:
        old = cpu_lora_native.set_stream(mode)
        if not before:
            before.append(old)

    yield set_mode
    if before:
        cpu_lora_native.set_stream(before[0])


@pytest.mark.parametrize("d_in", [D_IN, 64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", [torch.float32,
                                   pytest.param(torch.bfloat16, marks=needs_pairs)])
def test_memory_order_changes_no_bit(dtype: torch.dtype, pattern: str, threads: int, d_in: int,
                                     stream_mode) -> None:
    # Short segments of 1-3 rows read module by module in memory order behind one prefetch
    # stream: every sum in the work items' order, so the same bits, and no read outside a
    # block (the pool is NaN there); segments of 4 and 16 rows still run as items (float32's
    # 16-row one on the long path).
    stream_mode(0)
    off = Case(pattern, dtype, 3, rows=STREAM_ROWS, d_in=d_in)
    y_off = off.run(threads)
    stream_mode(1)
    on = Case(pattern, dtype, 3, rows=STREAM_ROWS, d_in=d_in)
    before = cpu_lora_native.stream_segments()
    y_on = on.run(threads)
    streamed = sum(1 for s in on.segments if s.hi - s.lo <= 3)
    assert streamed >= 5 and cpu_lora_native.stream_segments() - before == streamed
    assert not y_on.isnan().any()
    assert torch.equal(y_on, y_off)
    assert not torch.equal(y_on, on.y0)


def test_memory_order_not_for_mixed_dtypes(stream_mode) -> None:
    # bf16 x against float32 blocks (fp16 adapters copied up) stays on the work items
    stream_mode(1)
    case = Case("distinct", torch.bfloat16, 2, rows=STREAM_ROWS)
    for seg in case.segments:  # the tables rebuilt over float32 copies of the blocks
        seg.group.modules = tuple(m._replace(a_t=m.a_t.float(), bt=m.bt.float())
                                  for m in seg.group.modules)
        seg.group.native = None
    before = cpu_lora_native.stream_segments()
    y = case.run()
    assert cpu_lora_native.stream_segments() == before
    exact = case.exact()
    err = (y.double() - exact).abs()
    assert (err <= _bf16_ulp(exact) + 2.0 ** -16 * case.magnitude()).all()


@needs_pairs
@pytest.mark.parametrize("value, mode", [("0", 0), ("on", 1), ("auto", -1), ("", -1)])
def test_memory_order_switch_read_once(value: str, mode: int, monkeypatch, stream_mode) -> None:
    # LORAPLEX_LORA_STREAM sets the library's mode when it is first used for short segments
    stream_mode(-1)
    lib = native.library("lora")
    monkeypatch.setenv("LORAPLEX_LORA_STREAM", value)
    monkeypatch.delitem(lib.__dict__, "_loraplex_stream_set")
    case = Case("uniform", torch.bfloat16, 1, rows=(1, 2))
    case.run()
    assert cpu_lora_native.set_stream(-1) == mode
