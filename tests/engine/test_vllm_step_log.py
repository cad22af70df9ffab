"""The vLLM peer's per-step timings (benchmarks/vllm_driver.py, ``StepLog``): which of the engine
core's steps count as decode-only (every unfinished request decoded one token, none still
waiting for its first), and each step's seconds from the engine core's timestamps. The peer's
venv is not needed: the driver imports vLLM only in ``main``; the outputs here carry the fields
the driver reads from vLLM's ``EngineCoreOutputs``."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vllm_driver  # noqa: E402
from common import EngineRun, StepTiming  # noqa: E402


def _outs(ts: float, *tokens: tuple[str, int, bool]) -> SimpleNamespace:
    return SimpleNamespace(timestamp=ts, outputs=[
        SimpleNamespace(request_id=rid, new_token_ids=[7] * n,
                        finish_reason="length" if done else None) for rid, n, done in tokens])


def test_decode_only_steps_and_their_seconds() -> None:
    log = vllm_driver.StepLog(3, start=10.0)
    log.record(_outs(10.5, ("a", 1, False)))  # a's prompt done; b, c still prefilling
    log.record(_outs(10.8, ("a", 1, False), ("b", 1, False), ("c", 1, False)))  # b, c first
    log.record(_outs(11.0, ("a", 1, False), ("b", 1, False), ("c", 1, False)))
    log.record(_outs(11.3, ("a", 1, True), ("b", 1, False), ("c", 1, False)))  # a finishes
    log.record(_outs(11.4, ("b", 1, False), ("c", 1, False)))  # the two left
    log.record(_outs(11.6, ("b", 2, False), ("c", 1, True)))  # b two tokens: not a decode step
    assert log.steps == [[0.5, 0], [pytest.approx(0.3), 0], [pytest.approx(0.2), 3],
                         [pytest.approx(0.3), 3], [pytest.approx(0.1), 2],
                         [pytest.approx(0.2), 0]]
    # as the benchmark reads them: the full-batch decode steps' rates
    run = EngineRun({}, 1.6, [StepTiming(s, float("nan"), n) for s, n in log.steps])
    assert run.decode_step_rates(3) == [pytest.approx(15.0), pytest.approx(10.0)]


def test_a_step_missing_a_running_request_is_not_decode_only() -> None:
    log = vllm_driver.StepLog(2, start=0.0)
    log.record(_outs(1.0, ("a", 1, False), ("b", 1, False)))
    log.record(_outs(2.0, ("a", 1, False)))  # b skipped (preempted): not every request decoded
    log.record(_outs(3.0, ("a", 1, False), ("b", 1, False)))
    assert [n for _, n in log.steps] == [0, 0, 2]
