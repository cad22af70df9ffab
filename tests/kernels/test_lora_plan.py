"""``cpu.LoraPlan``: one step's LoRA segments routed once for every layer (the native calls'
segment arrays built up front, ``cpu_lora_native.LayerCall``) against ``cpu.lora_segments`` on
the same layer's blocks, bit for bit: float32 and bfloat16, short and long segments, with and
without AMX (the routing of long bf16 segments), without the native library, tensors the
routing was not made for, and bad calls refused before any write."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.kernels import cpu, cpu_lora_native, native
from tests.kernels.test_native_lora import Case

LAYERS = 3


class Layers:
    """``LAYERS`` cases of one pattern: the same rows and segments, each layer's own blocks,
    x and y0 (``Case`` seeded by layer), the segments' rows and scales those of layer 0."""

    def __init__(self, pattern: str, dtype: torch.dtype, num_modules: int) -> None:
        self.cases = [Case(pattern, dtype, num_modules, seed=layer) for layer in range(LAYERS)]
        first = self.cases[0].segments
        if any(len(c.segments) != len(first) for c in self.cases):
            raise RuntimeError("cases disagree on their segments")
        self.plan_segments = [
            (seg.lo, seg.hi, seg.scale, cpu.GroupLayers([c.segments[i].group for c in self.cases]))
            for i, seg in enumerate(first)]

    def expected(self, layer: int) -> torch.Tensor:
        case = self.cases[layer]
        y = case.y0.clone()
        cpu.lora_segments(case.x, y, [cpu.SegmentBlocks(lo, hi, scale, g.layers[layer])
                                      for lo, hi, scale, g in self.plan_segments])
        return y


@pytest.mark.parametrize("amx_lora", ["0", "1"])  # long bf16 segments on pair products / tiles
@pytest.mark.parametrize("num_modules", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["distinct", "zipf", "identical"])
def test_plan_equals_lora_segments_in_every_layer(pattern: str, dtype: torch.dtype,
                                                  num_modules: int, amx_lora: str,
                                                  monkeypatch) -> None:
    monkeypatch.setenv("LORAPLEX_AMX_LORA", amx_lora)
    layers = Layers(pattern, dtype, num_modules)
    plan = cpu.LoraPlan(dtype, torch.device("cpu"), layers.plan_segments)
    order = list(range(LAYERS)) * 2
    random.Random(0).shuffle(order)  # any layer, any order, more than once
    for layer in order:
        case = layers.cases[layer]
        y = case.y0.clone()
        plan(layer, case.x, y)
        assert torch.equal(y, layers.expected(layer)), f"layer {layer}"
        assert not torch.equal(y, case.y0)


def test_routing_takes_every_segment_natively_where_it_can() -> None:
    if not native.available("lora"):
        pytest.skip("native kernels off or no C compiler")
    f32 = cpu.LoraPlan(torch.float32, torch.device("cpu"),
                       Layers("zipf", torch.float32, 2).plan_segments)
    assert f32._rest == [] and len(f32._calls) == 1  # float32: every length in one call
    bf16 = cpu.LoraPlan(torch.bfloat16, torch.device("cpu"),
                        Layers("zipf", torch.bfloat16, 2).plan_segments)
    long_rows = [hi - lo for lo, hi, _, _ in bf16._rest]
    assert all(rows > cpu._SHORT_SEGMENT for rows in long_rows)
    if cpu_lora_native.has_long_bf16():  # on AMX tiles or pair dot products
        assert long_rows == [] and len(bf16._calls) == 2
    else:  # the long ones on oneDNN's bf16 GEMMs
        assert long_rows and len(bf16._calls) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_the_library_the_torch_path_runs_everything(monkeypatch,
                                                            dtype: torch.dtype) -> None:
    layers = Layers("uniform", dtype, 2)
    monkeypatch.setattr(native, "library", lambda name: None)
    plan = cpu.LoraPlan(dtype, torch.device("cpu"), layers.plan_segments)
    assert plan._calls == [] and len(plan._rest) == len(layers.plan_segments)
    for layer in range(LAYERS):
        case = layers.cases[layer]
        y = case.y0.clone()
        plan(layer, case.x, y)
        assert torch.equal(y, layers.expected(layer))


def test_tensors_the_routing_was_not_made_for_run_lora_segments() -> None:
    layers = Layers("skewed", torch.float32, 3)
    plan = cpu.LoraPlan(torch.float32, torch.device("cpu"), layers.plan_segments)
    case = layers.cases[1]
    y = case.y0.t().contiguous().t()  # columns of unit stride no longer: not for the kernel
    plan(1, case.x, y)
    expected = case.y0.t().contiguous().t()
    cpu.lora_segments(case.x, expected, [cpu.SegmentBlocks(lo, hi, s, g.layers[1])
                                         for lo, hi, s, g in layers.plan_segments])
    assert torch.equal(y, expected) and not torch.equal(y, case.y0)
    y64, x64 = case.y0.double(), case.x.double()  # another dtype than the plan's
    plan(1, x64, y64)
    expected = case.y0.double()
    cpu.lora_segments(x64, expected, [cpu.SegmentBlocks(lo, hi, s, g.layers[1])
                                      for lo, hi, s, g in layers.plan_segments])
    assert torch.equal(y64, expected) and not torch.equal(y64, case.y0.double())


def test_bad_calls_refused_before_any_write() -> None:
    if not native.available("lora"):
        pytest.skip("native kernels off or no C compiler")
    layers = Layers("distinct", torch.float32, 2)
    plan = cpu.LoraPlan(torch.float32, torch.device("cpu"), layers.plan_segments)
    case = layers.cases[0]
    for layer in (-1, LAYERS):
        y = case.y0.clone()
        with pytest.raises(ValueError, match="layer"):
            plan(layer, case.x, y)
        assert torch.equal(y, case.y0)
    # a step's plan on fewer rows than its segments span: the kernel's bounds check, no write
    rows = layers.plan_segments[-1][1] - 1
    y = case.y0[:rows].clone()
    with pytest.raises(ValueError, match="native LoRA"):
        plan(0, case.x[:rows], y)
    assert torch.equal(y, case.y0[:rows])


def test_segments_of_different_depths_refused() -> None:
    if not native.available("lora"):
        pytest.skip("native kernels off or no C compiler")
    layers = Layers("distinct", torch.float32, 1)
    lo, hi, scale, g = layers.plan_segments[0]
    short = (lo, hi, scale, cpu.GroupLayers(g.layers[:2]))
    with pytest.raises(ValueError, match="numbers of layers"):
        cpu.LoraPlan(torch.float32, torch.device("cpu"), [layers.plan_segments[1], short])
