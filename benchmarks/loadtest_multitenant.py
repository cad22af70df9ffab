"""Multi-tenant benchmarks on the in-process engine: the prefix cache on a shared system
prompt, and fair scheduling against a noisy neighbour.

* ``prefix``: the ``shared-prefix`` trace (a 1,000-token system prompt, short questions,
  8 adapters) with the prefix cache on and off: TTFT p50 / p99 in an open loop at ``--rate``,
  and throughput in a closed loop at ``--concurrency``.
* ``fairness``: the ``noisy-neighbour`` trace (tenant ``quiet`` at ``--quiet-rate``, tenant
  ``noisy`` at ten times that, in bursts) under ``--scheduling fcfs`` and ``vtc``, with
  ``--max-num-seqs`` small enough that requests queue: each tenant's TTFT and E2E p50 / p99.

Both systems run in this process, one after the other, on the same trace file (saved beside
the results). Every run is bounded in count and time. The same comparisons over gRPC:
start ``loraplex serve`` with the flag under test and run
``python -m loraplex.loadtest run --scenario shared-prefix`` (or ``noisy-neighbour`` with
``--tenant-keys``) against it.

Usage: ``python benchmarks/loadtest_multitenant.py --out bench-out/multitenant``
(``--num-requests 20`` for a quick run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import machine_info  # noqa: E402

from loraplex.loadtest.plots import plot_latency_cdfs  # noqa: E402,I001
from loraplex.loadtest.report import build_report  # noqa: E402
from loraplex.loadtest.runner import RunConfig  # noqa: E402
from loraplex.loadtest.scenarios import noisy_neighbour_trace, scenario_trace  # noqa: E402
from loraplex.loadtest.targets import AdapterSet, EngineTarget  # noqa: E402
from loraplex.server import env  # noqa: E402
from loraplex.server.config import EngineConfig, SchedulerConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["prefix", "fairness"], default=None)
    p.add_argument("--model", default="demo")
    p.add_argument("--num-requests", type=int, default=60, help="shared-prefix requests")
    p.add_argument("--rate", type=float, default=0.5, help="shared-prefix arrivals/s")
    p.add_argument("--concurrency", type=int, default=8, help="shared-prefix closed loop")
    p.add_argument("--nn-requests", type=int, default=330, help="noisy-neighbour requests")
    p.add_argument("--quiet-rate", type=float, default=0.8, help="the quiet tenant's rate")
    p.add_argument("--max-num-seqs", type=int, default=4, help="fairness: running at most")
    p.add_argument("--max-duration", type=float, default=120.0, help="per run, seconds")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out/multitenant"))
    return p.parse_args(argv)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:8.0f}"


def _run(target: EngineTarget, trace, run: RunConfig, out: Path, name: str):
    try:
        log = target.run(trace, run)
    finally:
        target.close()
    log.save(out / f"{name}.jsonl")
    return log, build_report(log)


def bench_prefix(args: argparse.Namespace, adapters: AdapterSet, out: Path) -> dict:
    trace = scenario_trace("shared-prefix", args.num_requests, args.rate, args.seed)
    trace.save(out / "shared-prefix.trace.jsonl")
    open_run = RunConfig(progress=False, warmup_requests=args.warmup,
                         max_duration_s=args.max_duration, drain_timeout_s=args.max_duration)
    closed_run = replace(open_run, mode="closed", concurrency=args.concurrency,
                         max_requests=4 * args.concurrency)
    results, logs = {}, {}
    for caching in (True, False):
        config = EngineConfig(model=args.model, enable_prefix_caching=caching)
        name = f"cache-{'on' if caching else 'off'}"
        logs[name], report = _run(EngineTarget(config, adapters), trace, open_run, out, name)
        _, closed = _run(EngineTarget(config, adapters), trace, closed_run, out,
                         f"{name}-closed")
        results[name] = {"open": report, "closed": closed}
    plot_latency_cdfs(logs, out / "shared-prefix-cdf.png")
    print(f"\nshared prefix: {args.num_requests} requests, 1000-token system prompt, 8 "
          f"adapters; open loop at {args.rate:g}/s, closed loop at {args.concurrency}")
    print(f"{'cache':10} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E p99':>9} {'cached tok':>11} "
          f"{'closed tok/s':>13} {'closed req/s':>13} {'errors':>7}")
    for name, r in results.items():
        s, c = r["open"]["summary"], r["closed"]["summary"]
        print(f"{name:10} {_ms(s['ttft_s']['p50']):>9} {_ms(s['ttft_s']['p99']):>9} "
              f"{_ms(s['e2e_s']['p99']):>9} {s['cached_prompt_tokens']:>11} "
              f"{c['output_tokens_per_s']:>13.1f} {c['requests_per_s']:>13.2f} "
              f"{s['num_errors'] + c['num_errors']:>7}")
    on, off = results["cache-on"], results["cache-off"]
    p50 = [r["open"]["summary"]["ttft_s"]["p50"] for r in (on, off)]
    tput = [r["closed"]["summary"]["output_tokens_per_s"] for r in (on, off)]
    if None not in p50 and tput[1] > 0:
        print(f"{'on / off':10} TTFT p50 {p50[0] / p50[1]:.2f}x, closed-loop throughput "
              f"{tput[0] / tput[1]:.2f}x")
    return results


def bench_fairness(args: argparse.Namespace, adapters: AdapterSet, out: Path) -> dict:
    trace = noisy_neighbour_trace(args.nn_requests, args.quiet_rate, args.seed)
    trace.save(out / "noisy-neighbour.trace.jsonl")
    run = RunConfig(progress=False, warmup_requests=0, max_duration_s=args.max_duration,
                    drain_timeout_s=args.max_duration)
    results, logs = {}, {}
    for scheduling in ("fcfs", "vtc"):
        config = EngineConfig(model=args.model, scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, scheduling=scheduling))
        logs[scheduling], results[scheduling] = _run(EngineTarget(config, adapters), trace, run,
                                                     out, scheduling)
    plot_latency_cdfs(logs, out / "noisy-neighbour-cdf.png")
    print(f"\nnoisy neighbour: {len(trace)} requests over {trace.duration:.0f} s, quiet at "
          f"{args.quiet_rate:g}/s, noisy at {10 * args.quiet_rate:g}/s in bursts, "
          f"max_num_seqs {args.max_num_seqs}")
    print(f"{'scheduling':10} {'tenant':7} {'requests':>9} {'tok/s':>7} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'E2E p50':>9} {'E2E p99':>9} {'errors':>7}")
    for scheduling, report in results.items():
        for tenant in ("quiet", "noisy"):
            t = report["by_tenant"].get(tenant)
            if t is None:
                continue
            print(f"{scheduling:10} {tenant:7} {t['num_requests']:>9} "
                  f"{t['output_tokens_per_s']:>7.1f} {_ms(t['ttft_s']['p50']):>9} "
                  f"{_ms(t['ttft_s']['p99']):>9} {_ms(t['e2e_s']['p50']):>9} "
                  f"{_ms(t['e2e_s']['p99']):>9} {t['num_errors']:>7}")
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    adapters = AdapterSet(env.cache_dir() / "loadtest" / "adapters-bench", model=args.model)
    report: dict = {"args": {k: str(v) if isinstance(v, Path) else v
                             for k, v in vars(args).items()},
                    "machine": machine_info(torch.get_num_threads())}
    if args.only in (None, "prefix"):
        report["prefix"] = bench_prefix(args, adapters, args.out)
    if args.only in (None, "fairness"):
        report["fairness"] = bench_fairness(args, adapters, args.out)
    path = args.out / "multitenant.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
