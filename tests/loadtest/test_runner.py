"""The asyncio runner against an in-process fake stream (no server): open-loop timing,
closed-loop concurrency, count and time bounds, errors by status code."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from loraplex.loadtest.report import build_report
from loraplex.loadtest.runner import RunConfig, run_stream
from loraplex.loadtest.trace import TraceConfig, generate_trace
from loraplex.server.api import GenerateChunk, ServiceError, Usage


class FakeServer:
    """Streams ``output_len`` tokens: the first after ``ttft`` s, then one every ``itl`` s;
    requests whose id is in ``fail`` end with that status after the first token."""

    def __init__(self, ttft: float = 0.02, itl: float = 0.005,
                 fail: dict[str, grpc.StatusCode] | None = None) -> None:
        self.ttft, self.itl, self.fail = ttft, itl, fail or {}
        self.in_flight = 0
        self.max_in_flight = 0

    async def stream(self, req, timeout):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.ttft)
            for i in range(req.output_len):
                if i:
                    await asyncio.sleep(self.itl)
                if req.request_id in self.fail and i == 1:
                    raise ServiceError(self.fail[req.request_id], "injected")
                last = i == req.output_len - 1
                yield GenerateChunk(req.request_id, [i], usage=Usage(len(req.prompt), i + 1, 3)
                                    if last else None, finish_reason="length" if last else None)
        finally:
            self.in_flight -= 1


def trace(n: int = 30, rate: float = 50.0, seed: int = 0):
    return generate_trace(TraceConfig(num_requests=n, rate=rate, output_len="uniform:3:6",
                                      prompt_len="uniform:4:8", seed=seed))


def run(tr, server: FakeServer, **kwargs):
    config = RunConfig(progress=False, **kwargs)
    return asyncio.run(run_stream(tr, server.stream, config))


def run_timing_the_loop(tr, server: FakeServer, **kwargs):
    """``run``, and the longest the event loop itself was held up meanwhile (a ticker's
    oversleep): a stall of the whole process (a GC pass, another test's thread holding the
    GIL) delays every send, which is no fault of the runner's schedule."""
    async def main():
        stalls = [0.0]

        async def ticker():
            while True:
                start = time.perf_counter()
                await asyncio.sleep(0.002)
                stalls.append(time.perf_counter() - start - 0.002)

        tick = asyncio.create_task(ticker())
        try:
            log = await run_stream(tr, server.stream, RunConfig(progress=False, **kwargs))
        finally:
            tick.cancel()
        return log, max(stalls)
    return asyncio.run(main())


def test_open_loop_sends_on_schedule_and_times_every_token():
    tr = trace()
    server = FakeServer()
    log, stall = run_timing_the_loop(tr, server, warmup_requests=5)
    assert len(log.records) == 30 and all(r.ok for r in log.records)
    assert [r.warmup for r in log.records].count(True) == 5
    by_id = {r.request_id: r for r in log.records}
    for req in tr.requests:
        r = by_id[req.request_id]
        assert r.num_output_tokens == req.output_len
        assert r.num_cached_tokens == 3 and r.num_prompt_tokens == len(req.prompt)
        assert r.arrival_time == req.arrival_time
        assert 0 <= r.client_lag < 0.05 + stall  # sent on time (loose: shared CI machines)
        assert r.ttft >= 0.02 and all(g >= 0.004 for g in r.itls)
        assert r.send_time <= r.token_times[0] <= r.end_time
    report = build_report(log)
    assert report["summary"]["num_errors"] == 0
    assert report["summary"]["ttft_s"]["p50"] == pytest.approx(0.02, abs=0.015)


def test_open_loop_rescales_a_trace():
    tr = trace(n=10, rate=50.0)
    log = run(tr, FakeServer(ttft=0.001, itl=0.001), rate=100.0)
    sends = sorted(r.arrival_time for r in log.records)
    assert sends == pytest.approx([r.arrival_time / 2 for r in tr.requests])
    assert log.meta["rate"] == 100.0


def test_closed_loop_keeps_concurrency_and_littles_law():
    server = FakeServer(ttft=0.01, itl=0.004)
    log = run(trace(n=60), server, mode="closed", concurrency=4, warmup_requests=8)
    assert server.max_in_flight == 4
    assert all(r.ok and r.arrival_time is None for r in log.records)
    law = build_report(log)["littles_law"]
    # in a closed loop L is the concurrency (less the client's own gaps between requests)
    assert law["mean_in_flight"] == pytest.approx(4, rel=0.1)
    assert law["consistent"]


def test_bounds_in_count_and_time():
    log = run(trace(n=30), FakeServer(), max_requests=7)
    assert len(log.records) == 7
    # sending stops at max_duration_s; what is still streaming is cancelled after the drain
    slow = FakeServer(ttft=5.0)
    log = run(trace(n=30, rate=100.0), slow, max_duration_s=0.1, drain_timeout_s=0.1)
    assert 3 <= len(log.records) < 30
    assert {r.status for r in log.records} == {"CANCELLED"}
    assert max(r.end_time for r in log.records) < 1.0
    assert slow.in_flight == 0


def test_errors_are_recorded_by_status_code():
    tr = trace(n=12)
    ids = [r.request_id for r in tr.requests]
    fail = {ids[2]: grpc.StatusCode.RESOURCE_EXHAUSTED, ids[5]: grpc.StatusCode.NOT_FOUND,
            ids[7]: grpc.StatusCode.RESOURCE_EXHAUSTED}
    log = run(tr, FakeServer(fail=fail))
    s = build_report(log)["summary"]
    assert s["errors"] == {"NOT_FOUND": 1, "RESOURCE_EXHAUSTED": 2}
    assert s["num_ok"] == 9
    failed = next(r for r in log.records if r.request_id == ids[5])
    assert failed.error == "injected" and failed.num_output_tokens == 1


def test_a_client_side_exception_is_a_result():
    async def broken(req, timeout):
        raise RuntimeError("boom")
        yield  # an async generator

    log = asyncio.run(run_stream(trace(n=3), broken, RunConfig(progress=False)))
    assert {r.status for r in log.records} == {"CLIENT_ERROR"}


@pytest.mark.parametrize("bad", [{"mode": "both"}, {"concurrency": 0}, {"rate": -1},
                                 {"max_requests": 0}, {"max_duration_s": 0},
                                 {"request_timeout_s": 0}, {"warmup_requests": -1}])
def test_run_config_validation(bad):
    with pytest.raises(ValueError):
        RunConfig(**bad)
