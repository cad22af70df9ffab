"""The report on synthetic timing logs: percentiles, throughput, goodput, errors and Little's
law checked against values worked out by hand or by queueing theory."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loraplex.loadtest.plots import plot_adapter_sweep, plot_latency_cdfs, plot_rate_sweep
from loraplex.loadtest.records import RequestRecord, RunLog
from loraplex.loadtest.report import (
    SLO,
    build_report,
    format_report,
    latency_stats,
    littles_law,
    summarize,
)


def rec(rid: str, send: float, tokens: list[float], end: float | None = None,
        status: str = "OK", tenant: str = "default", warmup: bool = False) -> RequestRecord:
    end = end if end is not None else (tokens[-1] if tokens else send)
    return RequestRecord(rid, tenant, "", send, send, end, list(tokens), num_prompt_tokens=10,
                         status=status, warmup=warmup)


@pytest.fixture
def hand_log() -> list[RequestRecord]:
    return [
        rec("r1", 0.0, [0.1, 0.2, 0.3]),
        rec("r2", 0.5, [0.9, 1.0, 1.3, 1.4]),
        rec("r3", 1.0, [1.2]),
        rec("r4", 1.5, [], end=2.5, status="DEADLINE_EXCEEDED"),
        rec("r5", 1.6, [], end=1.6, status="RESOURCE_EXHAUSTED"),
    ]


def test_percentiles_throughput_and_errors_by_hand(hand_log):
    s = summarize(hand_log)
    assert s["num_requests"] == 5 and s["num_ok"] == 3
    assert s["errors"] == {"DEADLINE_EXCEEDED": 1, "RESOURCE_EXHAUSTED": 1}
    # TTFT of the successful requests: 0.1, 0.4, 0.2 (numpy's linear interpolation)
    ttft = s["ttft_s"]
    assert ttft["count"] == 3
    assert ttft["p50"] == pytest.approx(0.2)
    assert ttft["p90"] == pytest.approx(0.2 + 0.8 * 0.2)
    assert ttft["p99"] == pytest.approx(0.2 + 0.98 * 0.2)
    assert ttft["mean"] == pytest.approx(0.7 / 3)
    # ITL pools every gap: 0.1, 0.1 | 0.1, 0.3, 0.1
    itl = s["itl_s"]
    assert itl["count"] == 5
    assert itl["p50"] == pytest.approx(0.1)
    assert itl["p90"] == pytest.approx(0.1 + 0.6 * 0.2)
    assert itl["p99"] == pytest.approx(0.1 + 0.96 * 0.2)
    assert itl["max"] == pytest.approx(0.3)
    # TPOT is per request: 0.1 and 0.5 / 3 (r3 has one token, no TPOT)
    assert s["tpot_s"]["count"] == 2
    assert s["tpot_s"]["mean"] == pytest.approx((0.1 + 0.5 / 3) / 2)
    assert s["e2e_s"]["mean"] == pytest.approx((0.3 + 0.9 + 0.2) / 3)
    # span: first send (0) to last end (2.5, the deadline error)
    assert s["duration_s"] == pytest.approx(2.5)
    assert s["requests_per_s"] == pytest.approx(3 / 2.5)
    assert s["output_tokens"] == 8
    assert s["output_tokens_per_s"] == pytest.approx(8 / 2.5)
    assert s["prompt_tokens_per_s"] == pytest.approx(30 / 2.5)


def test_goodput_counts_requests_within_every_limit(hand_log):
    s = summarize(hand_log, SLO(ttft_s=0.25, itl_s=0.15))
    # r1 (TTFT 0.1, TPOT 0.1) and r3 (TTFT 0.2, one token) meet it; r2's TTFT is 0.4
    assert s["goodput"]["requests_per_s"] == pytest.approx(2 / 2.5)
    assert s["goodput"]["fraction"] == pytest.approx(2 / 5)
    assert s["goodput"]["output_tokens_per_s"] == pytest.approx(4 / 2.5)
    tight = summarize(hand_log, SLO(ttft_s=0.25, itl_s=0.05))
    assert tight["goodput"]["fraction"] == pytest.approx(1 / 5)  # only r3 (no ITL)
    e2e = summarize(hand_log, SLO(e2e_s=0.5))
    assert e2e["goodput"]["fraction"] == pytest.approx(2 / 5)  # r1, r3
    none = summarize(hand_log)
    assert none["goodput"]["fraction"] == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="ttft_s"):
        SLO(ttft_s=0)


def test_empty_stats_are_none():
    assert latency_stats([]) == {"count": 0, "mean": None, "p50": None, "p90": None,
                                 "p99": None, "max": None}
    s = summarize([rec("x", 0.0, [], end=1.0, status="UNAVAILABLE")])
    assert s["ttft_s"]["p99"] is None and s["requests_per_s"] == 0


def test_littles_law_by_hand_and_what_warm_up_fixes():
    # one request a second for 11 s, each taking 2.5 s: W = 2.5, lambda = 1
    log = [rec(f"r{i}", float(i), [i + 2.5]) for i in range(11)]
    law = littles_law(log)
    assert law.window_s == 10 and law.arrival_rate == 1 and law.mean_latency_s == 2.5
    # in flight over [0, 10]: 8 full requests (20 s) + 2 + 1 + 0 partial = 23 s
    assert law.mean_in_flight == pytest.approx(2.3)
    assert law.relative_error == pytest.approx(0.2 / 2.5)
    # three warm-up requests before the window fill its start exactly
    warm = [rec(f"w{i}", float(i), [i + 2.5], warmup=True) for i in range(3)]
    shifted = [rec(f"r{i}", i + 3.0, [i + 5.5]) for i in range(11)]
    law = littles_law(warm + shifted)
    assert law.mean_in_flight == pytest.approx(2.5)
    assert law.relative_error == pytest.approx(0.0, abs=1e-12)
    assert law.consistent


def _fifo_log(rate: float, service: float, n: int, seed: int) -> list[RequestRecord]:
    """A single-server FIFO queue with Poisson arrivals and a fixed service time."""
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, n))
    records, free_at = [], 0.0
    for i, a in enumerate(arrivals):
        begin = max(a, free_at)
        free_at = begin + service
        records.append(rec(f"r{i}", float(a), [begin + service / 2, free_at],
                           warmup=i < n // 20))
    return records


def test_littles_law_holds_in_steady_state_and_fails_in_overload():
    stable = littles_law(_fifo_log(rate=10, service=0.05, n=4000, seed=0))
    assert stable.relative_error < 0.05 and stable.consistent
    # M/D/1 at load 0.5: W = service + rho * service / (2 (1 - rho)) = 0.075
    assert stable.mean_latency_s == pytest.approx(0.075, rel=0.1)
    overload = littles_law(_fifo_log(rate=10, service=0.15, n=2000, seed=0))
    assert not overload.consistent
    assert overload.completion_rate < 0.75 * overload.arrival_rate


def test_build_report_splits_warm_up_and_tenants(tmp_path):
    log = RunLog([rec("w", 0.0, [0.5, 0.6], warmup=True),
                  rec("a1", 1.0, [1.1, 1.2], tenant="a"),
                  rec("a2", 1.5, [1.6, 1.7], tenant="a"),
                  rec("b1", 2.0, [2.4, 2.5], tenant="b"),
                  rec("b2", 2.5, [], end=2.6, status="NOT_FOUND", tenant="b")],
                 {"system": "test"})
    report = build_report(log, SLO(ttft_s=0.2))
    assert report["summary"]["num_requests"] == 4
    assert report["warmup"]["num_requests"] == 1
    assert report["warmup"]["ttft_s"]["p50"] == pytest.approx(0.5)
    assert set(report["by_tenant"]) == {"a", "b"}
    assert report["by_tenant"]["a"]["ttft_s"]["p99"] == pytest.approx(0.1)
    assert report["by_tenant"]["b"]["errors"] == {"NOT_FOUND": 1}
    assert report["littles_law"] is not None
    text = format_report(report)
    for needle in ("TTFT", "ITL", "E2E", "goodput", "Little's law", "NOT_FOUND 1",
                   "warm-up", "tenant"):
        assert needle in text
    path = tmp_path / "log.jsonl"
    log.records[-1].end_time = math.nan  # a request that never ended survives the file
    log.save(path)
    loaded = RunLog.load(path)
    assert loaded.meta == log.meta and len(loaded.records) == 5
    assert math.isnan(loaded.records[-1].end_time)
    assert loaded.records[0] == log.records[0]


def test_plots_write_pngs(tmp_path):
    log = RunLog(_fifo_log(rate=10, service=0.05, n=200, seed=1))
    plot_latency_cdfs({"a": log, "b": log}, tmp_path / "cdf.png")
    summary = build_report(log)["summary"]
    rate = {"kind": "rate", "points": [{"system": s, "rate": r, "summary": summary}
                                       for s in ("x", "y") for r in (1, 2, 4)]}
    plot_rate_sweep(rate, tmp_path / "rate.png")
    adapters = {"kind": "adapters", "title": "t",
                "points": [{"system": "x", "num_adapters": n, "summary": summary}
                           for n in (1, 8, 64)]}
    plot_adapter_sweep(adapters, tmp_path / "adapters.png")
    for name in ("cdf.png", "rate.png", "adapters.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 200_000
