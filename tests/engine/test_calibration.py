"""Warm-up calibration of the step cost model: an engine with ``target_itl_ms`` times dummy
steps before serving, on borrowed pages that all come back, and starts with a fitted model;
without a target it runs none."""

from __future__ import annotations

from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.calibration import calibration_shapes
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.request import SamplingParams
from loraplex.server.engine.step_cost import StepShape


def engine(model, target: float) -> Engine:
    return Engine(EngineConfig(model=str(model), num_pages=2000, scheduler=SchedulerConfig(
        page_size=4, max_num_batched_tokens=128, target_itl_ms=target)))


def test_calibration_fits_the_model_before_the_first_step(tiny_llama):
    eng = engine(tiny_llama, 50.0)
    model = eng.step_timer.model
    assert model.num_observed == len(calibration_shapes(128, eng.max_model_len))
    assert eng.pager.num_free == eng.pager.num_pages  # every borrowed page is back
    assert eng.stats().num_steps == 0 and eng.stats().step_times.num_steps == 0
    small, large = StepShape(num_prefill_tokens=8), StepShape(num_prefill_tokens=128,
                                                              num_context_tokens=128 * 129 // 2)
    assert 0 < model.predict(small) <= model.predict(large)
    eng.add_request("r", list(range(1, 40)), SamplingParams(max_tokens=3, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    times = eng.stats().step_times
    assert times.num_steps == eng.stats().num_steps and times.predicted_seconds > 0
    assert model.num_observed == len(calibration_shapes(128, eng.max_model_len)) + 3


def test_no_target_no_calibration(tiny_llama):
    eng = engine(tiny_llama, 0.0)
    assert eng.step_timer.model.num_observed == 0
    eng.add_request("r", list(range(1, 10)), SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().step_times.num_steps == 2  # measured all the same, for the metrics
    assert eng.stats().step_times.num_over_target == 0
