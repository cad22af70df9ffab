"""The figures of a run: latency percentiles, throughput, goodput, Little's law, errors.

Everything is computed from a ``RunLog``'s records:

* TTFT (send to first token), ITL (every gap between consecutive tokens, pooled over
  requests), TPOT (each request's mean ITL) and E2E (send to last token): mean, p50, p90,
  p99 over successful requests (numpy's linear-interpolation percentiles);
* throughput over the measured span (first send to last end): successful requests/s, and
  output (and prompt) tokens/s of successful requests;
* goodput under an ``SLO``: requests/s (and the fraction) that succeeded with TTFT, TPOT and
  E2E within their limits (DistServe's definition; a limit left unset does not apply);
* Little's law L = lambda W over the arrival window (first to last measured send): L is the
  time-average number of requests in flight (every record, warm-up included), lambda the
  arrival rate, W the mean latency of the requests sent in the window. They agree in steady
  state; they part when the queue grows (offered load above capacity) or when records lose
  time (a client bug). Warm-up requests make the window's start representative; without
  them expect a bias of about W / window.
* errors by status code; the client's lag behind the schedule (open loop).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from loraplex.loadtest.records import RequestRecord, RunLog

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    """Latency targets a request must meet to count towards goodput (seconds; None: none).

    Attributes:
        ttft_s: time to first token.
        itl_s: the request's mean inter-token latency (TPOT).
        e2e_s: end-to-end latency.
    """

    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s", "e2e_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {value}")

    def met_by(self, r: RequestRecord) -> bool:
        """Whether ``r`` succeeded within every limit (a one-token request has no ITL)."""
        if not r.ok:
            return False
        ttft, tpot = r.ttft, r.tpot
        if self.ttft_s is not None and (ttft is None or ttft > self.ttft_s):
            return False
        if self.itl_s is not None and tpot is not None and tpot > self.itl_s:
            return False
        return self.e2e_s is None or r.e2e <= self.e2e_s


def latency_stats(values: Sequence[float] | np.ndarray,
                  percentiles: Iterable[int] = PERCENTILES) -> dict[str, float | int | None]:
    """``count``, ``mean``, ``max`` and ``p<q>`` for each percentile (None when empty)."""
    x = np.asarray(values, dtype=np.float64)
    keys = ["mean", *(f"p{q}" for q in percentiles), "max"]
    if x.size == 0:
        return {"count": 0, **dict.fromkeys(keys)}
    out: dict[str, float | int | None] = {"count": int(x.size), "mean": float(x.mean())}
    for q in percentiles:
        out[f"p{q}"] = float(np.percentile(x, q))
    out["max"] = float(x.max())
    return out


@dataclass(frozen=True)
class LittlesLaw:
    """L = lambda W over the arrival window; see the module docstring."""

    window_s: float
    arrival_rate: float  # lambda: measured sends per second in the window
    completion_rate: float  # ends per second in the window (below lambda: a growing queue)
    mean_latency_s: float  # W: mean E2E of the requests sent in the window
    mean_in_flight: float  # L: time-average of requests in flight over the window
    tolerance: float

    @property
    def predicted_in_flight(self) -> float:
        return self.arrival_rate * self.mean_latency_s

    @property
    def relative_error(self) -> float:
        a, b = self.mean_in_flight, self.predicted_in_flight
        return abs(a - b) / max(a, b) if max(a, b) > 0 else 0.0

    @property
    def consistent(self) -> bool:
        return self.relative_error <= self.tolerance

    def to_dict(self) -> dict:
        return {**asdict(self), "predicted_in_flight": self.predicted_in_flight,
                "relative_error": self.relative_error, "consistent": self.consistent}


def littles_law(records: Sequence[RequestRecord], tolerance: float = 0.1
                ) -> LittlesLaw | None:
    """Check Little's law on a run's records (all of them: warm-up requests are in flight
    too). None when fewer than two measured requests span a positive window."""
    done = [r for r in records if math.isfinite(r.end_time)]
    measured = [r for r in done if not r.warmup]
    if len(measured) < 2:
        return None
    start = min(r.send_time for r in measured)
    stop = max(r.send_time for r in measured)
    window = stop - start
    if window <= 0:
        return None
    busy = sum(max(0.0, min(r.end_time, stop) - max(r.send_time, start)) for r in done)
    completions = sum(start <= r.end_time <= stop for r in done)
    return LittlesLaw(window_s=window, arrival_rate=(len(measured) - 1) / window,
                      completion_rate=completions / window,
                      mean_latency_s=float(np.mean([r.e2e for r in measured])),
                      mean_in_flight=busy / window, tolerance=tolerance)


def summarize(records: Sequence[RequestRecord], slo: SLO | None = None) -> dict:
    """The main figures of ``records`` (typically the measured ones of one run or tenant)."""
    slo = slo or SLO()
    ok = [r for r in records if r.ok]
    errors = Counter(r.status for r in records if not r.ok)
    ends = [r.end_time for r in records if math.isfinite(r.end_time)]
    span = (max(ends) - min(r.send_time for r in records)) if ends else 0.0
    per_s = (lambda x: x / span) if span > 0 else (lambda x: 0.0)
    out_tokens = sum(r.num_output_tokens for r in ok)
    in_tokens = sum(r.num_prompt_tokens for r in ok)
    good = [r for r in ok if slo.met_by(r)]
    lags = [r.client_lag for r in records if r.client_lag is not None]
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": sum(errors.values()),
        "errors": dict(sorted(errors.items())),
        "duration_s": span,
        "requests_per_s": per_s(len(ok)),
        "output_tokens": out_tokens,
        "output_tokens_per_s": per_s(out_tokens),
        "prompt_tokens_per_s": per_s(in_tokens),
        "cached_prompt_tokens": sum(r.num_cached_tokens for r in ok),
        "ttft_s": latency_stats([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": latency_stats([g for r in ok for g in r.itls]),
        "tpot_s": latency_stats([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": latency_stats([r.e2e for r in ok]),
        "goodput": {"requests_per_s": per_s(len(good)),
                    "output_tokens_per_s": per_s(sum(r.num_output_tokens for r in good)),
                    "fraction": len(good) / len(records) if records else 0.0},
        "client_lag_s": latency_stats(lags),
    }


def build_report(log: RunLog, slo: SLO | None = None, tolerance: float = 0.1) -> dict:
    """The full report of a run: the measured summary, Little's law, warm-up apart, and the
    same summary per tenant."""
    slo = slo or SLO()
    measured = log.measured
    warmup = [r for r in log.records if r.warmup]
    law = littles_law(log.records, tolerance)
    tenants = sorted({r.tenant for r in measured})
    return {
        "meta": log.meta,
        "slo": asdict(slo),
        "summary": summarize(measured, slo),
        "littles_law": law.to_dict() if law is not None else None,
        "warmup": summarize(warmup, slo) if warmup else None,
        "by_tenant": {t: summarize([r for r in measured if r.tenant == t], slo)
                      for t in tenants},
    }


def save_report(report: dict, path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def _ms(value: float | int | None) -> str:
    return "-" if value is None else f"{1000 * value:.1f}"


def format_report(report: dict) -> str:
    """A plain-text table of a report (what the CLI prints)."""
    s = report["summary"]
    meta = report.get("meta", {})
    lines = [f"system {meta.get('system', '?')}  target {meta.get('target', '-')}  "
             f"{s['num_requests']} requests ({s['num_ok']} ok, {s['num_errors']} errors) "
             f"in {s['duration_s']:.1f} s",
             f"{'latency (ms)':14} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}"]
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT"),
                       ("e2e_s", "E2E")):
        st = s[key]
        lines.append(f"{label:14} " + " ".join(f"{_ms(st[k]):>9}" for k in
                                               ("mean", "p50", "p90", "p99", "max")))
    g = s["goodput"]
    lines += [f"throughput     {s['requests_per_s']:.2f} req/s, "
              f"{s['output_tokens_per_s']:.1f} output tok/s, "
              f"{s['prompt_tokens_per_s']:.1f} prompt tok/s",
              f"goodput        {g['requests_per_s']:.2f} req/s ({g['fraction']:.0%} of requests "
              f"within SLO {_slo_text(report.get('slo', {}))})"]
    law = report.get("littles_law")
    if law is not None:
        lines.append(f"Little's law   L={law['mean_in_flight']:.2f} in flight, lambda*W="
                     f"{law['arrival_rate']:.2f}/s * {law['mean_latency_s']:.3f} s = "
                     f"{law['predicted_in_flight']:.2f} (error {law['relative_error']:.1%}, "
                     f"{'consistent' if law['consistent'] else 'NOT consistent'}; completions "
                     f"{law['completion_rate']:.2f}/s)")
    if s["errors"]:
        lines.append("errors         " + ", ".join(f"{k} {v}" for k, v in s["errors"].items()))
    lag = s["client_lag_s"]
    if lag["count"]:
        lines.append(f"client lag     p50 {_ms(lag['p50'])} ms, p99 {_ms(lag['p99'])} ms "
                     "behind schedule")
    if report.get("warmup"):
        w = report["warmup"]
        lines.append(f"warm-up        {w['num_requests']} requests, TTFT p50 "
                     f"{_ms(w['ttft_s']['p50'])} ms, E2E p50 {_ms(w['e2e_s']['p50'])} ms")
    if len(report.get("by_tenant", {})) > 1:
        lines.append(f"{'tenant':14} {'requests':>9} {'tok/s':>9} {'TTFT p50':>9} "
                     f"{'TTFT p99':>9} {'E2E p99':>9}")
        for tenant, t in report["by_tenant"].items():
            lines.append(f"{tenant[:14]:14} {t['num_requests']:>9} "
                         f"{t['output_tokens_per_s']:>9.1f} {_ms(t['ttft_s']['p50']):>9} "
                         f"{_ms(t['ttft_s']['p99']):>9} {_ms(t['e2e_s']['p99']):>9}")
    return "\n".join(lines)


def _slo_text(slo: dict) -> str:
    parts = [f"{label}<={1000 * slo[k]:g}ms" for k, label in
             (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_s", "E2E")) if slo.get(k)]
    return " ".join(parts) if parts else "none set"


def format_comparison(reports: dict[str, dict]) -> str:
    """One row per system (same trace), then each system's throughput and p99 TTFT relative
    to the first."""
    head = (f"{'system':22} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'ITL p99':>8} {'E2E p99':>8} {'goodput':>8} {'errors':>6}")
    lines = [head, "-" * len(head)]
    for name, report in reports.items():
        s = report["summary"]
        lines.append(f"{name[:22]:22} {s['requests_per_s']:>7.2f} "
                     f"{s['output_tokens_per_s']:>8.1f} {_ms(s['ttft_s']['p50']):>9} "
                     f"{_ms(s['ttft_s']['p99']):>9} {_ms(s['itl_s']['p99']):>8} "
                     f"{_ms(s['e2e_s']['p99']):>8} {s['goodput']['requests_per_s']:>8.2f} "
                     f"{s['num_errors']:>6}")
    names = list(reports)
    first = reports[names[0]]["summary"]
    for name in names[1:]:
        s = reports[name]["summary"]
        if s["output_tokens_per_s"] > 0 and first["ttft_s"]["p99"] and s["ttft_s"]["p99"]:
            lines.append(f"{names[0]} / {name}: output tokens/s "
                         f"{first['output_tokens_per_s'] / s['output_tokens_per_s']:.2f}x, "
                         f"TTFT p99 {first['ttft_s']['p99'] / s['ttft_s']['p99']:.2f}x")
    lines.append("(latencies in ms; goodput: requests/s within the SLO)")
    return "\n".join(lines)
