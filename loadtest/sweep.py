"""Sweeps: the same trace shape run at several request rates, or over several adapter counts,
against one or more systems, each point a bounded run with its own log and report.

* ``rate_sweep``: one arrival pattern (the seed's), scaled to each rate; about
  ``duration_s`` of arrivals per point (60 s by default). Plots throughput and p99 latency
  against the offered rate: the knee is the system's capacity.
* ``adapter_sweep``: the S-LoRA experiment in small: the same arrivals and lengths with
  adapters drawn Zipf(1) over 1, 8, 64, 512, 2048 adapters, loraplex against the
  transformers + peft baseline. Plots throughput and p99 latency against the adapter count.

Everything lands in ``out_dir``: ``<kind>_sweep.json`` (rewritten after every point, so an
interrupted sweep keeps what it measured), ``<kind>_sweep.png``, per-point latency CDFs under
``cdf/`` and every run's log under ``logs/``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from loraplex.loadtest.records import RunLog, provenance
from loraplex.loadtest.report import SLO, build_report
from loraplex.loadtest.runner import RunConfig
from loraplex.loadtest.targets import Target
from loraplex.loadtest.trace import TraceConfig, generate_trace

logger = logging.getLogger(__name__)

DEFAULT_ADAPTER_COUNTS = (1, 8, 64, 512, 2048)


@dataclass(frozen=True)
class SweepConfig:
    """What every point of a sweep shares.

    Attributes:
        duration_s: seconds of arrivals per point (open loop: rate x duration requests;
            closed loop: the run's time bound).
        min_requests: at least this many requests per point.
        run: the runner settings (mode, concurrency, warm-up, timeouts); each point sets
            its own count and time bounds.
        slo: for goodput.
        out_dir: where results go.
    """

    duration_s: float = 60.0
    min_requests: int = 20
    run: RunConfig = RunConfig(progress=False)
    slo: SLO = SLO()
    out_dir: Path = Path("loadtest-out")

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise ValueError(f"duration_s: must be > 0, got {self.duration_s}")
        if self.min_requests < 1:
            raise ValueError(f"min_requests: must be >= 1, got {self.min_requests}")


def _point_trace_config(trace: TraceConfig, sweep: SweepConfig) -> TraceConfig:
    if sweep.run.mode == "closed" or math.isinf(trace.rate):
        return trace
    n = max(sweep.min_requests, math.ceil(trace.rate * sweep.duration_s))
    return replace(trace, num_requests=n + sweep.run.warmup_requests)


def _run_point(target: Target, trace_config: TraceConfig, sweep: SweepConfig, tag: str
               ) -> tuple[dict, RunLog]:
    trace = generate_trace(_point_trace_config(trace_config, sweep))
    # Arrivals of a Gamma process overshoot their mean span a little; the drain follows.
    bound = sweep.duration_s * 1.5 if sweep.run.mode == "open" else sweep.duration_s
    run = replace(sweep.run, rate=None, max_requests=None, max_duration_s=bound)
    log = target.run(trace, run)
    logs_dir = sweep.out_dir / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    log_path = logs_dir / f"{target.name}-{tag}.jsonl"
    log.save(log_path)
    report = build_report(log, sweep.slo)
    point = {"system": target.name, "num_requests": len(trace),
             "adapters_used": len({r.adapter for r in trace.requests if r.adapter}),
             "summary": report["summary"],
             "littles_law": report["littles_law"], "log": str(log_path.relative_to(
                 sweep.out_dir))}
    return point, log


def _sweep(kind: str, targets: Sequence[Target], configs: Sequence[tuple[dict, TraceConfig]],
           sweep: SweepConfig, title: str) -> dict:
    sweep.out_dir.mkdir(parents=True, exist_ok=True)
    (sweep.out_dir / "cdf").mkdir(exist_ok=True)
    result: dict = {"kind": kind, "title": title, "duration_s": sweep.duration_s,
                    "mode": sweep.run.mode, "slo": sweep.slo.__dict__,
                    "machine": provenance(), "points": []}
    path = sweep.out_dir / f"{kind}_sweep.json"
    for x, trace_config in configs:
        tag = "-".join(f"{k}{v:g}" for k, v in x.items())
        logs = {}
        for target in targets:
            point, logs[target.name] = _run_point(target, trace_config, sweep, tag)
            point.update(x)
            result["points"].append(point)
            logger.info("%s %s: %s", target.name, tag, _point_line(point))
            path.write_text(json.dumps(result, indent=2) + "\n")
        _plot("plot_latency_cdfs", logs, sweep.out_dir / "cdf" / f"{kind}-{tag}.png")
    _plot("plot_rate_sweep" if kind == "rate" else "plot_adapter_sweep", result,
          sweep.out_dir / f"{kind}_sweep.png")
    return result


def _plot(name: str, data: object, path: Path) -> None:
    try:
        from loraplex.loadtest import plots
    except ImportError as exc:
        logger.warning("no plot %s (%s): install matplotlib, e.g. loraplex[dev]", path, exc)
        return
    getattr(plots, name)(data, path)


def rate_sweep(targets: Sequence[Target], trace: TraceConfig, rates: Sequence[float],
               sweep: SweepConfig) -> dict:
    """Run ``trace`` (its seed, lengths and adapters) at each rate against every target."""
    configs = [({"rate": float(r)}, replace(trace, rate=float(r))) for r in rates]
    title = (f"{trace.adapters} over {trace.num_adapters} adapters, prompts {trace.prompt_len},"
             f" outputs {trace.output_len}, burstiness {trace.burstiness:g}")
    return _sweep("rate", targets, configs, sweep, title)


def adapter_sweep(targets: Sequence[Target], trace: TraceConfig,
                  counts: Sequence[int] = DEFAULT_ADAPTER_COUNTS,
                  sweep: SweepConfig | None = None) -> dict:
    """Run ``trace`` with each adapter count (its popularity spec, Zipf(1) by default)."""
    sweep = sweep or SweepConfig()
    configs = [({"num_adapters": int(n)}, replace(trace, num_adapters=int(n))) for n in counts]
    load = (f"{trace.rate:g} req/s" if sweep.run.mode == "open"
            else f"concurrency {sweep.run.concurrency}")
    title = (f"{trace.adapters} popularity, {load}, prompts {trace.prompt_len}, "
             f"outputs {trace.output_len}")
    return _sweep("adapters", targets, configs, sweep, title)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def _point_line(p: dict) -> str:
    s = p["summary"]
    law = p["littles_law"]
    return (f"{s['requests_per_s']:.2f} req/s, {s['output_tokens_per_s']:.1f} tok/s, "
            f"TTFT p99 {_ms(s['ttft_s']['p99'])} ms, E2E p99 {_ms(s['e2e_s']['p99'])} ms, "
            f"{s['num_errors']} errors, Little {'ok' if law and law['consistent'] else 'off'}")


def format_sweep(result: dict) -> str:
    """A plain-text table of a sweep (one row per system and point)."""
    x_key = "rate" if result["kind"] == "rate" else "num_adapters"
    head = (f"{'system':22} {x_key:>12} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'ITL p99':>8} {'E2E p99':>8} {'goodput':>8} {'err':>4} "
            f"{'Little':>7}")
    lines = [result.get("title", ""), head, "-" * len(head)]
    for p in sorted(result["points"], key=lambda p: (p["system"], p[x_key])):
        s, law = p["summary"], p["littles_law"]
        little = "-" if law is None else f"{law['relative_error']:.0%}"
        lines.append(f"{p['system'][:22]:22} {p[x_key]:>12g} {s['requests_per_s']:>7.2f} "
                     f"{s['output_tokens_per_s']:>8.1f} {_ms(s['ttft_s']['p50']):>9} "
                     f"{_ms(s['ttft_s']['p99']):>9} {_ms(s['itl_s']['p99']):>8} "
                     f"{_ms(s['e2e_s']['p99']):>8} {s['goodput']['requests_per_s']:>8.2f} "
                     f"{s['num_errors']:>4} {little:>7}")
    lines.append("(latencies in ms; goodput in req/s within the SLO; Little: |L - lambda W| "
                 "/ L over the arrival window)")
    return "\n".join(lines)
