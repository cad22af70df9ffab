"""The benchmarks' step profiler (benchmarks/step_profile.py) on the demo model: every stage is
charged, the stages add up to the step, and detaching leaves the engine as it was."""

from __future__ import annotations

import sys
from pathlib import Path

from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.models import llama
from loraplex.server.engine.request import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from step_profile import CATEGORIES, StepProfiler, profile_table  # noqa: E402


def test_profile_charges_every_stage_and_detaches():
    engine = Engine(EngineConfig(model="demo", num_pages=64,
                                 scheduler=SchedulerConfig(page_size=16)))
    linear, step = llama.linear, engine.step
    prof = StepProfiler(engine)
    for i in range(3):
        engine.add_request(f"r{i}", [1, 2, 3, 4 + i], SamplingParams(max_tokens=4,
                                                                     ignore_eos=True))
    tokens = []
    while engine.has_unfinished():
        running = engine.scheduler.running
        decode = bool(running) and engine.scheduler.num_waiting == 0 and all(
            r.num_tokens - r.num_computed_tokens == 1 for r in running)
        tokens += [t for out in engine.step() for t in out.new_token_ids]
        prof.record("decode" if decode else "mixed")
    prof.detach()
    assert len(tokens) == 12
    decode = prof.breakdowns["decode"]
    assert decode.num_steps == 3
    layers = engine.model_config.num_layers
    assert decode.calls["gemm"] == 3 * 4 * layers  # qkv, o, gate_up, down per layer per step
    assert decode.calls["attention"] == 3 * 2 * layers  # write_kv and attention
    assert decode.calls["lm_head"] == 2 * 3  # compute_logits and its linear, charged to it
    for cat in ("gemm", "attention", "lm_head", "model other", "sampling", "scheduling",
                "engine other"):
        assert decode.seconds[cat] > 0, cat
    assert set(decode.seconds) <= set(CATEGORIES)
    table = profile_table(prof.breakdowns, 1e-6)
    assert any(line.startswith("gemm") for line in table)
    assert llama.linear is linear and "step" not in vars(engine)
    assert engine.step.__func__ is step.__func__
