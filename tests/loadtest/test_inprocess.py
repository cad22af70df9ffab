"""The in-process systems on a tiny random model: the engine replay (adapters, tenants,
prefix caching, fairness), the transformers + peft baseline with dynamic batching, and both
sweeps."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from loraplex.loadtest.baseline import BaselineRequest, PeftBaseline, next_batch
from loraplex.loadtest.report import build_report
from loraplex.loadtest.runner import RunConfig
from loraplex.loadtest.sweep import SweepConfig, adapter_sweep, format_sweep, rate_sweep
from loraplex.loadtest.targets import AdapterSet, BaselineTarget, EngineTarget
from loraplex.loadtest.trace import TraceConfig, generate_trace
from loraplex.server.config import EngineConfig, SchedulerConfig
from tests.helpers import make_model

QUIET = RunConfig(progress=False, max_duration_s=30, drain_timeout_s=30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("lt-model") / "llama", seed=3)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    return AdapterSet(tmp_path_factory.mktemp("lt-adapters"), model=str(model_dir), rank=4)


def small_trace(**overrides):
    cfg = dict(num_requests=24, rate=40.0, num_adapters=3, base_fraction=0.2,
               prompt_len="uniform:4:20", output_len="uniform:2:6",
               tenants=(("a", 2.0), ("b", 1.0)), seed=11)
    cfg.update(overrides)
    return generate_trace(TraceConfig(**cfg))


def engine(model_dir, adapters, **overrides) -> EngineTarget:
    sched = SchedulerConfig(**{k: overrides.pop(k) for k in list(overrides)
                               if k in SchedulerConfig.__dataclass_fields__})
    return EngineTarget(EngineConfig(model=str(model_dir), num_pages=256, scheduler=sched,
                                     **overrides), adapters)


def test_engine_replay_serves_every_request(model_dir, adapters):
    tr = small_trace()
    target = engine(model_dir, adapters)
    try:
        log = target.run(tr, RunConfig(progress=False, warmup_requests=4))
        closed = target.run(tr, RunConfig(progress=False, mode="closed", concurrency=3))
    finally:
        target.close()
    for run in (log, closed):
        assert len(run.records) == 24 and all(r.ok for r in run.records), [
            (r.status, r.error) for r in run.records if not r.ok]
        want = {r.request_id: r for r in tr.requests}
        for r in run.records:
            assert r.num_output_tokens == want[r.request_id].output_len
            assert r.num_prompt_tokens == len(want[r.request_id].prompt)
    assert {r.adapter for r in log.records} >= {"", "lt-0000"}
    report = build_report(log)
    assert set(report["by_tenant"]) == {"a", "b"} and report["littles_law"] is not None
    assert all(r.arrival_time is None for r in closed.records)


def test_engine_replay_reports_refusals(model_dir):
    from loraplex.loadtest.engine_replay import replay_engine
    from loraplex.server.engine.engine import Engine

    tr = small_trace(num_requests=6, num_adapters=0)
    long = replace(tr.requests[1], prompt=(1,) * 500)
    unknown = replace(tr.requests[2], adapter="nope")
    tr = replace(tr, requests=(tr.requests[0], long, unknown, *tr.requests[3:]))
    log = replay_engine(Engine(EngineConfig(model=str(model_dir), num_pages=256)), tr, QUIET,
                        adapter_digests={})
    status = {r.request_id: r.status for r in log.records}
    assert status[long.request_id] == "INVALID_ARGUMENT"
    assert status[unknown.request_id] == "NOT_FOUND"
    assert sum(s == "OK" for s in status.values()) == 4


@pytest.mark.parametrize("caching", [True, False])
def test_shared_prefix_hits_the_cache_only_when_enabled(model_dir, adapters, caching):
    tr = small_trace(num_requests=12, rate=20.0, prefix_len=48, num_adapters=2,
                     adapters="uniform", base_fraction=0.0, tenants=(("a", 1.0),))
    target = engine(model_dir, adapters, enable_prefix_caching=caching)
    try:
        log = target.run(tr, QUIET)
    finally:
        target.close()
    assert all(r.ok for r in log.records)
    cached = sum(r.num_cached_tokens for r in log.records)
    assert (cached > 0) == caching
    assert log.meta["enable_prefix_caching"] is caching


def test_fairness_modes_run_the_noisy_neighbour_shape(model_dir, adapters):
    quiet = small_trace(num_requests=6, rate=10.0, tenants=(("quiet", 1.0),))
    tr = small_trace(num_requests=30, rate=60.0, tenants=(("noisy", 1.0),), seed=12)
    from loraplex.loadtest.trace import merge_traces

    both = merge_traces([quiet, tr], ["q", "n"])
    for scheduling in ("fcfs", "vtc"):
        target = engine(model_dir, adapters, scheduling=scheduling, max_num_seqs=2)
        try:
            log = target.run(both, QUIET)
        finally:
            target.close()
        report = build_report(log)
        assert report["summary"]["num_errors"] == 0
        assert set(report["by_tenant"]) == {"quiet", "noisy"}
        assert log.meta["scheduling"] == scheduling


def _req(i: int, adapter: str, t: float) -> BaselineRequest:
    return BaselineRequest(f"r{i}", [5, 6, 7 + i], 3, adapter, t)


def test_next_batch_policies():
    waiting = [_req(0, "x", 0), _req(1, "y", 0), _req(2, "x", 0), _req(3, "", 0)]
    assert [r.request_id for r in next_batch(waiting, "mixed", 3)] == ["r0", "r1", "r2"]
    assert [r.request_id for r in next_batch(waiting, "grouped", 16)] == ["r0", "r2"]
    assert [r.request_id for r in next_batch(waiting[3:], "grouped", 16)] == ["r3"]
    with pytest.raises(ValueError, match="policy"):
        next_batch(waiting, "random", 4)


def test_baseline_dynamic_batching_gathers_within_the_window(model_dir, adapters):
    dirs = adapters.ensure(small_trace(num_adapters=2, num_requests=40))
    baseline = PeftBaseline(model_dir, dirs, max_loaded_adapters=1, pad_token_id=258)
    # three arrive within 50 ms: one batch; one arrives 0.3 s later: a second batch
    reqs = [_req(0, "lt-0000", 0.0), _req(1, "lt-0001", 0.01), _req(2, "", 0.02),
            _req(3, "lt-0000", 0.3)]
    run = baseline.serve_trace(reqs, "mixed", max_batch_size=16, window_s=0.05)
    assert [b.num_requests for b in run.batches] == [3, 1]
    assert all(len(r.token_ids) == 3 for r in run.results)
    first = {r.request_id: r for r in run.results}
    assert first["r0"].start_time == 0.0 and first["r0"].token_times[0] >= 0.02
    grouped = baseline.serve_trace(reqs, "grouped", max_batch_size=16, window_s=0.05)
    assert [b.num_requests for b in grouped.batches] == [1, 1, 1, 1]
    assert baseline.num_loads >= 3  # one adapter kept loaded: they were swapped


@pytest.mark.parametrize("policy", ["mixed", "grouped"])
def test_baseline_target_logs_like_the_engine(model_dir, adapters, policy):
    tr = small_trace()
    log = BaselineTarget(str(model_dir), adapters, policy).run(tr, QUIET)
    assert len(log.records) == 24 and all(r.ok for r in log.records)
    want = {r.request_id: r.output_len for r in tr.requests}
    assert all(r.num_output_tokens == want[r.request_id] for r in log.records)
    assert log.meta["system"] == f"transformers-{policy}" and log.meta["num_batches"] >= 1


def test_sweeps_write_json_and_plots(model_dir, adapters, tmp_path):
    base = TraceConfig(rate=30.0, num_adapters=2, prompt_len="uniform:4:12",
                       output_len="uniform:2:4", seed=5)
    target = engine(model_dir, adapters)
    sweep = SweepConfig(duration_s=0.3, min_requests=6, out_dir=tmp_path / "rate",
                        run=RunConfig(progress=False, warmup_requests=1))
    try:
        result = rate_sweep([target], base, [20.0, 40.0], sweep)
        counts = adapter_sweep([target, BaselineTarget(str(model_dir), adapters)], base,
                               [1, 4], SweepConfig(duration_s=0.3, min_requests=6,
                                                   out_dir=tmp_path / "adapters",
                                                   run=RunConfig(progress=False)))
    finally:
        target.close()
    assert [(p["system"], p["rate"]) for p in result["points"]] == [
        ("loraplex-engine", 20.0), ("loraplex-engine", 40.0)]
    assert result["points"][1]["summary"]["num_requests"] == 12  # 40/s x 0.3 s, 1 warm-up
    saved = json.loads((tmp_path / "rate" / "rate_sweep.json").read_text())
    assert saved["points"] == json.loads(json.dumps(result["points"]))
    assert (tmp_path / "rate" / "rate_sweep.png").stat().st_size > 0
    assert sorted((tmp_path / "rate" / "logs").iterdir())
    assert {(p["system"], p["num_adapters"]) for p in counts["points"]} == {
        ("loraplex-engine", 1), ("loraplex-engine", 4), ("transformers-mixed", 1),
        ("transformers-mixed", 4)}
    assert all(p["summary"]["num_errors"] == 0 for p in counts["points"])
    assert (tmp_path / "adapters" / "adapters_sweep.png").exists()
    assert "transformers-mixed" in format_sweep(counts)


def test_baseline_records_what_it_could_not_serve(model_dir, adapters):
    # everything arrives at once; batches of 4 may start only in the first 50 ms. Each batch
    # generates 40-48 tokens (a forward at least each), so the six batches cannot all start
    # in time even on a fast CPU: with 2-6 tokens a Zen 5 core started all six (no CANCELLED)
    tr = small_trace(rate=float("inf"), output_len="uniform:40:48")
    bound = RunConfig(progress=False, max_duration_s=0.05, drain_timeout_s=0.0)
    log = BaselineTarget(str(model_dir), adapters, max_batch_size=4).run(tr, bound)
    assert [r.request_id for r in log.records] == [r.request_id for r in tr.requests]
    assert {r.status for r in log.records} == {"OK", "CANCELLED"}
    assert all(r.end_time >= r.send_time for r in log.records)
