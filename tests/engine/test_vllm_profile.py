"""The vLLM peer's step profile (benchmarks/vllm_profile.py): torch profiler events charged to
loraplex's step categories by their names and their scopes, per engine step. The peer's venv is
not needed: the events here are torch's own, from scopes named as vLLM's model runner and the
driver name them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import step_profile  # noqa: E402
import vllm_profile  # noqa: E402


def _step(x: torch.Tensor, w: torch.Tensor, vocab: torch.Tensor) -> None:
    with record_function(vllm_profile.SCHEDULE_SCOPE):
        torch.zeros(4)
    with record_function("gpu_model_runner: preprocess"):
        torch.arange(8)
    with record_function("gpu_model_runner: forward"):
        h = torch.mm(x, w)  # a layer's projection
        h = h + 1  # elementwise: the model's own
        q = h.view(1, 1, 4, 16)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        with record_function(vllm_profile.LORA_SCOPE):
            torch.mm(x, w)  # a product inside the LoRA wrapper is LoRA's
    with record_function("gpu_model_runner: postprocess"):
        logits = torch.mm(h, vocab)
    with record_function("gpu_model_runner: sample"):
        logits.argmax(-1)


def test_events_by_category_and_step_kind() -> None:
    x, w, vocab = torch.randn(4, 16), torch.randn(16, 16), torch.randn(16, 50)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.mm(x, w)  # outside every step: left out
        for i in range(4):
            with record_function(f"{vllm_profile.STEP_SCOPE}{i}"):
                _step(x, w, vocab)
    events = list(prof.events())
    by_name = {}
    for ev in events:
        by_name.setdefault(ev.name, []).append(vllm_profile.classify(ev))
    assert by_name["aten::mm"][0] == (None, "gemm")
    assert [c for _, c in by_name["aten::mm"][1:4]] == ["gemm", "lora", "lm_head"]
    assert {c for _, c in by_name["aten::add"]} == {"model other"}
    assert {c for _, c in by_name["aten::arange"]} == {"batch build"}
    assert {c for _, c in by_name["aten::argmax"]} == {"sampling"}
    assert {c for _, c in by_name["aten::scaled_dot_product_attention"]} == {"attention"}
    assert {c for _, c in by_name[vllm_profile.SCHEDULE_SCOPE]} == {"scheduling"}
    assert [s for s, _ in by_name["aten::argmax"]] == [0, 1, 2, 3]

    # step 1 is not counted (no outputs), 0 mixed, 2 and 3 decode
    out = vllm_profile.breakdowns(events, ["mixed", None, "decode", "decode"])
    assert set(out) == {"decode", "mixed"}
    assert out["decode"]["num_steps"] == 2 and out["mixed"]["num_steps"] == 1
    assert tuple(out["decode"]["ms_per_step"]) == step_profile.CATEGORIES
    calls = out["decode"]["calls_per_step"]
    assert calls["gemm"] == 1 and calls["lm_head"] >= 2 and calls["lora"] >= 1  # with scopes
    assert calls["scheduling"] >= 1 and calls["sampling"] >= 1 and calls["engine other"] == 1
    ms = out["decode"]["ms_per_step"]
    assert all(v >= 0 for v in ms.values()) and ms["gemm"] > 0 and ms["lm_head"] > 0
    # every event of the counted steps is charged once: the steps' wall time, self times summed
    steps = [ev for ev in events if ev.name in (f"{vllm_profile.STEP_SCOPE}{i}" for i in (2, 3))]
    total_ms = sum(ev.cpu_time_total for ev in steps) / 1000 / 2
    assert sum(ms.values()) == pytest.approx(total_ms, rel=1e-6)


def test_op_names() -> None:
    assert vllm_profile.op_category("_C::onednn_mm") == "gemm"
    assert vllm_profile.op_category("_C::cpu_attention_with_kv_cache") == "attention"
    assert vllm_profile.op_category("_C::cpu_attn_reshape_and_cache") == "attention"
    assert vllm_profile.op_category("vllm::unified_kv_cache_update") == "attention"
    assert vllm_profile.op_category("_C::rotary_embedding") == "rope"
    assert vllm_profile.op_category("## Call CompiledFxGraph abc ##") is None
    assert vllm_profile.op_category("_C::greedy_argmax") is None


def test_breakdowns_round_trip_to_the_table() -> None:
    data = {"decode": {"num_steps": 4, "clock": "wall",
                       "ms_per_step": {c: float(i) for i, c in
                                       enumerate(step_profile.CATEGORIES)},
                       "calls_per_step": {c: 2.0 for c in step_profile.CATEGORIES}}}
    back = step_profile.breakdowns_from_json(data)
    assert step_profile.breakdowns_json(back) == data
    lines = step_profile.profile_table(back, 1e-6, "profiled events")
    assert any(line.startswith("gemm") and " 0.00 " in line for line in lines)
    assert lines[-1] == ("decode: 20 profiled events a step add ~0.02 ms (1.00 us each), "
                         "included above")


def test_profiler_event_cost() -> None:
    """What the driver reports each profiled event to cost: positive, microseconds."""
    import vllm_driver

    cost = vllm_driver.profiler_event_cost(3000)
    assert 0 < cost < 1e-3
