"""The native LoRA kernel's long float32 segments (``csrc/lora.c``: rows >= its ``LONG_ROWS``,
tiles of rows with the ranks in vector lanes) against a float64 oracle: odd ranks and ranks past
three vectors, ``d_in`` and module widths that are not multiples of the vector width, blocks and
rows of ``x`` / ``y`` with strides larger than their widths (NaN beyond them: a read outside a
block poisons the result), short segments in the same call, one and two threads."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import cpu, cpu_lora_native, native

pytestmark = pytest.mark.skipif(not native.available("lora"),
                                reason="native kernels off or no C compiler")

NAN = float("nan")
# segment rows: long ones (a partial last tile, one of exactly two tiles, a whole prompt) and
# short ones (decode rows, taken by the short path) in the same call
ROWS = (16, 1, 17, 31, 3, 101, 2, 200, 40)


def _blocks(rank: int, d_in: int, width: int, gen: torch.Generator, pad: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    # A [rank, d_in] and B^T [rank, width] as views of wider NaN-filled tensors (row strides
    # d_in + pad and width + pad), values O(1) / sqrt(d_in) and O(1)
    a_full = torch.full((rank, d_in + pad), NAN)
    b_full = torch.full((rank, width + pad), NAN)
    a = a_full[:, :d_in]
    b = b_full[:, :width]
    a.copy_(torch.randn(rank, d_in, generator=gen) / d_in ** 0.5)
    b.copy_(torch.randn(rank, width, generator=gen))
    return a, b


class Case:
    def __init__(self, d_in: int, ranks: tuple[int, ...], widths: tuple[int, ...],
                 seed: int = 0, pad: int = 5) -> None:
        gen = torch.Generator().manual_seed(seed)
        starts, col = [], 3  # a gap before the first module and between modules
        for w in widths:
            starts.append(col)
            col += w + 2
        self.cols = col
        bounds = [0]
        for n in ROWS:
            bounds.append(bounds[-1] + n)
        rows = bounds[-1]
        x_full = torch.full((rows, d_in + pad), NAN)
        self.x = x_full[:, :d_in]
        self.x.copy_(torch.randn(rows, d_in, generator=gen))
        self.y_full = torch.randn(rows, col + pad, generator=gen)
        self.segments, self.dense = [], []
        for s in range(len(ROWS)):
            # each segment its own adapter, ranks rotated over the modules
            blocks, dense = [], []
            for j, (start, w) in enumerate(zip(starts, widths)):
                rank = ranks[(s + j) % len(ranks)]
                a, b = _blocks(rank, d_in, w, gen, pad)
                blocks.append(cpu.ModuleBlocks(start, start + w, a.t(), b))
                dense.append((start, start + w, a.double(), b.double()))
            scale = 0.5 + s / len(ROWS)
            self.segments.append(cpu.SegmentBlocks(bounds[s], bounds[s + 1], scale,
                                                   cpu.GroupBlocks(blocks)))
            self.dense.append(dense)

    def run(self, threads: int) -> torch.Tensor:
        y_full = self.y_full.clone()
        y = y_full[:, :self.cols]  # rows y_full.stride(0) apart, wider than the written span
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            rest = cpu_lora_native.lora_short_segments(self.x, y, self.segments, 1 << 62)
        finally:
            torch.set_num_threads(before)
        assert not rest
        return y_full

    def exact(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float64 result and the magnitude float32 rounding errors scale with."""
        out = self.y_full.double()
        mag = out.abs()
        for seg, dense in zip(self.segments, self.dense):
            xs = self.x[seg.lo:seg.hi].double()
            for start, end, a, b in dense:
                out[seg.lo:seg.hi, start:end] += seg.scale * (xs @ a.T) @ b
                mag[seg.lo:seg.hi, start:end] += abs(seg.scale) * (xs.abs() @ a.abs().T) @ b.abs()
        return out, mag


CASES = [
    # d_in, ranks (rotated over the modules), module widths
    (576, (8, 16), (576, 192, 192)),    # SmolLM2's q/k/v, the engine's ranks
    (576, (16, 8), (576,)),             # its o
    (133, (1, 3, 7), (7, 600, 40)),     # odd everything, narrow modules
    (40, (64, 33), (17, 1, 48)),        # ranks past three vectors, a one-column module
    (7, (17, 2), (100, 16)),            # d_in under one vector
    (1, (5,), (33,)),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("d_in,ranks,widths", CASES)
def test_long_float32_segments_equal_exact_math(d_in: int, ranks: tuple[int, ...],
                                                widths: tuple[int, ...], threads: int) -> None:
    case = Case(d_in, ranks, widths)
    y = case.run(threads)
    exact, mag = case.exact()
    # float32 sums in another order than float64's: within 1e-5 of the terms' magnitude
    err = (y.double() - exact).abs()
    assert not torch.isnan(y).any()
    assert (err <= 1e-5 * mag + 1e-30).all(), float((err / mag).max())
    # columns outside every module (gaps, the padding past the span) untouched
    written = torch.zeros(y.shape, dtype=torch.bool)
    for seg, dense in zip(case.segments, case.dense):
        for start, end, _, _ in dense:
            written[seg.lo:seg.hi, start:end] = True
    assert torch.equal(y[~written], case.y_full[~written])


@pytest.mark.parametrize("d_in,ranks,widths", CASES[:4])
def test_long_segments_two_threads_change_no_bit(d_in: int, ranks: tuple[int, ...],
                                                 widths: tuple[int, ...]) -> None:
    # a long segment's rows are split over the threads in whole tiles; each element is one
    # chain of FMAs in a fixed order whatever the split
    case = Case(d_in, ranks, widths, seed=1)
    assert torch.equal(case.run(1), case.run(2))
