"""``python -m loraplex.loadtest`` (or ``loraplex bench``): trace | run | report | sweep.

    # a trace file: 600 requests, Poisson at 4/s, Zipf(1) over 64 adapters
    python -m loraplex.loadtest trace --num-requests 600 --rate 4 --num-adapters 64 -o t.jsonl
    # run it against a gateway (uploading the adapters it names), 10 warm-up requests
    python -m loraplex.loadtest run --trace t.jsonl --address 127.0.0.1:50051 --warmup 10 \\
        --slo-ttft-ms 500 --slo-itl-ms 100 --out results/
    # the standard benchmark: a local 'loraplex serve' against transformers + peft
    python -m loraplex.loadtest run --scenario standard --serve --warmup 10 \\
        --systems loraplex,transformers-mixed,transformers-grouped --out results/standard
    # sweeps
    python -m loraplex.loadtest sweep rate --rates 1,2,4,8 --systems loraplex --out sweep/
    python -m loraplex.loadtest sweep adapters --rate 4 \\
        --systems loraplex-engine,transformers-mixed --out sweep/

``run`` writes ``log.jsonl`` (every request's timestamps), ``report.json`` and
``latency_cdf.png`` into ``--out`` and prints the report. Modules are imported by the command
that needs them, so adding ``bench`` to the ``loraplex`` parser costs nothing until it runs;
plots need matplotlib (the dev extras) and are skipped with a warning without it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraplex.loadtest.records import RunLog

logger = logging.getLogger(__name__)


def plot_cdfs(logs: dict[str, RunLog], path: Path) -> bool:
    """Latency CDFs of ``logs`` into ``path``; False (with a warning) without matplotlib."""
    try:
        from loraplex.loadtest.plots import plot_latency_cdfs
    except ImportError as exc:
        logger.warning("no plot (%s): install matplotlib, e.g. loraplex[dev]", exc)
        return False
    plot_latency_cdfs(logs, path)
    return True


def _trace(args: argparse.Namespace) -> int:
    from loraplex.loadtest import cli_args

    trace = cli_args.load_trace(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    trace.save(args.out)
    used = trace.adapters_by_tenant()
    print(f"wrote {args.out}: {len(trace)} requests over {trace.duration:.1f} s, tenants "
          f"{', '.join(trace.tenants())}, {len({a for v in used.values() for a in v})} "
          "adapters used")
    return 0


def _write_run(log: RunLog, out: Path, args: argparse.Namespace) -> dict:
    from loraplex.loadtest import cli_args
    from loraplex.loadtest.report import build_report, save_report

    out.mkdir(parents=True, exist_ok=True)
    log.save(out / "log.jsonl")
    report = build_report(log, cli_args.slo(args), args.little_tolerance)
    save_report(report, out / "report.json")
    plot_cdfs({log.meta.get("system", "run"): log}, out / "latency_cdf.png")
    return report


@contextlib.contextmanager
def _maybe_serve(args: argparse.Namespace) -> Iterator[None]:
    """With ``--serve`` and a ``loraplex`` or ``loraplex-http`` system, a local server for
    the block (both wires of the same server)."""
    from loraplex.loadtest import cli_args

    if not args.serve or not {"loraplex", "loraplex-http"} & set(cli_args.systems(args)):
        yield
        return
    from loraplex.loadtest.local_server import LocalServer

    with LocalServer(args.model, shlex.split(args.serve_args)) as server:
        args.address, args.http_url = server.address, server.http_url
        print(f"started loraplex serve --model {args.model} {args.serve_args} on "
              f"{server.address} (HTTP {server.http_url})", file=sys.stderr)
        yield


def _run(args: argparse.Namespace) -> int:
    from loraplex.loadtest import cli_args
    from loraplex.loadtest.records import provenance
    from loraplex.loadtest.report import format_comparison, format_report

    trace = cli_args.load_trace(args)
    config = cli_args.run_config(args, trace_file=args.trace is not None)
    names = cli_args.systems(args)
    adapters = cli_args.adapter_set(args)
    reports, logs = {}, {}
    with _maybe_serve(args):
        for name in names:
            target = cli_args.make_target(args, name, adapters)
            try:
                log = target.run(trace, config)
            finally:
                target.close()
            log.meta.update(trace=str(args.trace) if args.trace else (args.scenario
                                                                        or "generated"),
                            trace_config=trace.config.to_dict() if trace.config else None,
                            model=args.model, machine=provenance())
            out = args.out if len(names) == 1 else args.out / name
            reports[name], logs[name] = _write_run(log, out, args), log
            print(format_report(reports[name]) + "\n")
    if len(names) > 1:
        plot_cdfs(logs, args.out / "latency_cdf.png")
        print(format_comparison(reports))
        print(f"wrote {args.out}/<system>/log.jsonl, report.json, latency_cdf.png and "
              f"{args.out}/latency_cdf.png")
    else:
        print(f"wrote {args.out}/log.jsonl, report.json, latency_cdf.png")
    return 0


def _report(args: argparse.Namespace) -> int:
    from loraplex.loadtest import cli_args
    from loraplex.loadtest.records import RunLog
    from loraplex.loadtest.report import build_report, format_report, save_report

    logs = {}
    for i, path in enumerate(args.logs):
        log = RunLog.load(path)
        label = args.labels[i] if args.labels and i < len(args.labels) else (
            f"{log.meta.get('system', 'run')} ({Path(path).parent.name or path})")
        logs[label] = log
        report = build_report(log, cli_args.slo(args), args.little_tolerance)
        print(f"== {label}\n{format_report(report)}\n")
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            save_report(report, args.out / f"report-{i}.json")
    if args.out is not None:
        plot_cdfs(logs, args.out / "latency_cdf.png")
        print(f"wrote {args.out}/report-*.json, latency_cdf.png")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from loraplex.loadtest import cli_args
    from loraplex.loadtest.sweep import SweepConfig, adapter_sweep, format_sweep, rate_sweep

    trace = cli_args.trace_config(args)
    config = cli_args.run_config(args, trace_file=False)
    adapters = cli_args.adapter_set(args)
    sweep = SweepConfig(duration_s=args.duration, min_requests=args.min_requests, run=config,
                        slo=cli_args.slo(args), out_dir=args.out)
    with _maybe_serve(args):
        targets = [cli_args.make_target(args, s, adapters) for s in cli_args.systems(args)]
        try:
            if args.kind == "rate":
                result = rate_sweep(targets, trace, cli_args.parse_rates(args.rates), sweep)
            else:
                counts = [int(c) for c in args.counts.split(",") if c.strip()]
                result = adapter_sweep(targets, trace, counts, sweep)
        finally:
            for target in targets:
                target.close()
    print(format_sweep(result))
    print(f"wrote {args.out}/{args.kind}_sweep.json, {args.kind}_sweep.png")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``trace``, ``run``, ``report`` and ``sweep`` to a subparsers object."""
    from loraplex.loadtest import cli_args
    from loraplex.loadtest.sweep import DEFAULT_ADAPTER_COUNTS

    trace = sub.add_parser("trace", help="generate a trace and save it as JSONL")
    cli_args.add_trace_args(trace)
    trace.add_argument("-o", "--out", type=Path, required=True, help="the JSONL to write")
    trace.set_defaults(func=_trace)

    run = sub.add_parser("run", help="run a trace against one system and report")
    cli_args.add_trace_args(run)
    cli_args.add_run_args(run)
    cli_args.add_system_args(run)
    run.add_argument("--out", type=Path, default=Path("loadtest-out"))
    run.add_argument("--little-tolerance", type=float, default=0.1)
    run.set_defaults(func=_run)

    report = sub.add_parser("report", help="report (and compare) saved run logs")
    report.add_argument("logs", nargs="+", type=Path, help="log.jsonl files")
    report.add_argument("--labels", nargs="*", default=None)
    report.add_argument("--out", type=Path, default=None,
                        help="write report JSON and the latency CDFs here")
    report.add_argument("--little-tolerance", type=float, default=0.1)
    for flag in ("--slo-ttft-ms", "--slo-itl-ms", "--slo-e2e-ms"):
        report.add_argument(flag, type=float, default=None)
    report.set_defaults(func=_report)

    sweep = sub.add_parser("sweep", help="rate sweep, or throughput against adapter count")
    sweep.add_argument("kind", choices=["rate", "adapters"])
    cli_args.add_trace_args(sweep)
    cli_args.add_run_args(sweep)
    cli_args.add_system_args(sweep)
    sweep.add_argument("--rates", default="1,2,4,8", help="rate sweep: requests/s, comma-sep")
    sweep.add_argument("--counts", default=",".join(map(str, DEFAULT_ADAPTER_COUNTS)),
                       help="adapter sweep: adapter counts, comma-separated")
    sweep.add_argument("--duration", type=float, default=60.0,
                       help="seconds of arrivals per point (closed loop: time bound)")
    sweep.add_argument("--min-requests", type=int, default=20)
    sweep.add_argument("--out", type=Path, default=Path("loadtest-sweep"))
    sweep.set_defaults(func=_sweep)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` to the ``loraplex`` parser: ``loraplex bench ARGS`` is
    ``python -m loraplex.loadtest ARGS`` (parsed when it runs, so building the ``loraplex``
    parser imports nothing of the load tester)."""
    bench = subparsers.add_parser(
        "bench", help="load tests: traces, runs against loraplex and transformers + peft, "
        "reports, sweeps ('loraplex bench --help')", add_help=False, prefix_chars="\0")
    bench.add_argument("argv", nargs=argparse.REMAINDER)
    bench.set_defaults(func=lambda args: main(args.argv, prog="loraplex bench"))


def build_parser(prog: str = "python -m loraplex.loadtest") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog,
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="WARNING")
    add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m loraplex.loadtest") -> int:
    """Run one command; returns the exit status (2 for a usage error)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(func(args) or 0)
    except ValueError as exc:
        print(f"loadtest {args.command}: {exc}", file=sys.stderr)
        return 2
