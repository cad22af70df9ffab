"""Serving benchmark: ``loraplex serve`` (gRPC, its OpenAI HTTP API, and with the inter-token
latency target at two values) against ``vllm serve`` (OpenAI HTTP), on one trace with the load
tester (issues 21 and 22).

The trace (issue 22): 8 adapters on q, k, v, o (rank 8 for even indices, 16 for odd) written
once as PEFT folders: loraplex gets them uploaded over gRPC, vLLM as ``--lora-modules`` (the
same bytes); ``--num-requests`` token-id prompts of 64-192 tokens, 48 new tokens, EOS
ignored, adapters drawn uniformly, every request streaming. ``--num-adapters`` and
``--adapter-popularity`` draw from more (issue 21's N = 64 / 512 with ``zipf:1``): only the
adapters the traces name are written and given to either system (vLLM's ``--max-loras`` is
their number, so it never swaps one out during a run). Each load point is a closed loop
at a ``--concurrency`` or, with ``--rates``, an open loop at a Poisson rate (req/s).

Systems: ``loraplex`` (gRPC) and ``loraplex-http`` (the OpenAI API of the same server, target
off), ``loraplex-t<ms>`` (gRPC, ``--target-itl-ms <ms>``: one server each), ``vllm`` (vLLM's
CPU build from ``.venv-vllm``, ``make bench-peers``). One system at a time: the loraplex
servers run through a phase (their runs interleave, the order rotating by round, so the
target-off and target-on runs of a load point are back to back), then stop; then ``vllm
serve`` starts for its phase (``--phases loraplex,vllm,loraplex`` brackets it). Every process
uses one thread (``OMP_NUM_THREADS=1``; vLLM's worker ``VLLM_CPU_OMP_THREADS_BIND=0``, no core
reserved); vLLM's engine core (its scheduler loop) is a process of its own beside the worker
and the API server, and its CPU time is reported apart (``cpu_by_process``).

Reported per run: output tokens/s, TTFT p50/p99, ITL p50/p99 (client side, streamed), goodput
under ``--slo-ttft-ms`` / ``--slo-tpot-ms``, the servers' CPU seconds per wall second, the
share of ITL gaps under 0.5 ms (tokens that arrived in one chunk), the 1-minute load before
and after; for loraplex the engine's steps over target and its cost model's predicted over
measured step time (``/metrics``). Then issue 22's checks for every target-on run. The report
(``serve_bench.json``) carries the commit and refuses a dirty tree unless ``--allow-dirty``.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/serve_bench.py --out bench-out/serve``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from common import git_commit, machine_info  # noqa: E402
from serve_report import checks, checks_table, print_table  # noqa: E402
from stall_free import TARGETS, model_path, scrape  # noqa: E402
from vllm_peer import peer_version, process_cpu_s  # noqa: E402
from vllm_serve import VllmServer, cpu_delta  # noqa: E402

from loraplex.loadtest.adapters import ensure_adapter_dirs  # noqa: E402,I001
from loraplex.loadtest.local_server import LocalServer, free_port  # noqa: E402
from loraplex.loadtest.records import RunLog  # noqa: E402
from loraplex.loadtest.report import SLO, build_report  # noqa: E402
from loraplex.loadtest.runner import RunConfig  # noqa: E402
from loraplex.loadtest.targets import AdapterSet, GrpcTarget, OpenAITarget, Target  # noqa: E402
from loraplex.loadtest.trace import Trace, TraceConfig, adapter_name, generate_trace  # noqa: E402
from loraplex.server import env  # noqa: E402
from loraplex.server.engine.models.config import ModelConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2, bench, demo or a directory")
    p.add_argument("--targets", default="0,150,250",
                   help="target_itl_ms of each loraplex server (0: off; it also serves HTTP)")
    p.add_argument("--systems", default="loraplex,loraplex-http,vllm",
                   help="which of the target-off systems run (the target-on ones always do)")
    p.add_argument("--phases", default="loraplex,vllm",
                   help="one system at a time, in this order (a system may come twice)")
    p.add_argument("--concurrency", default="8,32", help="closed-loop load points")
    p.add_argument("--rates", default="", help="open-loop load points, requests/s (Poisson)")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--num-adapters", type=int, default=8, help="adapters the trace draws from")
    p.add_argument("--adapter-popularity", default="uniform",
                   help="how requests pick them (zipf:1, uniform, ...: loadtest/trace.py)")
    p.add_argument("--prompt-len", default="uniform:64:192")
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds per loraplex phase")
    p.add_argument("--vllm-rounds", type=int, default=1, help="rounds per vllm phase")
    p.add_argument("--num-pages", type=int, default=768)
    p.add_argument("--min-prefill-chunk", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="both systems")
    p.add_argument("--max-num-seqs", type=int, default=256, help="both systems")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--serve-args", default="", help="more `loraplex serve` flags")
    p.add_argument("--vllm-bind", default="0", help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--vllm-args", default="", help="more `vllm serve` flags")
    p.add_argument("--slo-ttft-ms", type=float, default=5000.0, help="goodput: TTFT limit")
    p.add_argument("--slo-tpot-ms", type=float, default=200.0,
                   help="goodput: limit on a request's mean inter-token latency")
    p.add_argument("--idle-s", type=float, default=5.0,
                   help="CPU seconds of each idle server are measured over this window")
    p.add_argument("--max-duration", type=float, default=300.0, help="per run, seconds")
    p.add_argument("--allow-dirty", action="store_true",
                   help="report from a tree with uncommitted changes (the commit says -dirty)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out/serve"))
    return p.parse_args(argv)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def load_points(args: argparse.Namespace) -> list[tuple[str, float]]:
    points = [("closed", float(c)) for c in args.concurrency.split(",") if c]
    return points + [("open", float(r)) for r in args.rates.split(",") if r]


def run_config(mode: str, value: float, args: argparse.Namespace) -> RunConfig:
    common = dict(mode=mode, progress=False, max_duration_s=args.max_duration,
                  drain_timeout_s=args.max_duration)
    if mode == "closed":
        return RunConfig(concurrency=int(value), **common)  # type: ignore[arg-type]
    return RunConfig(rate=value, **common)  # type: ignore[arg-type]


def merged_share(log: RunLog) -> float | None:
    """Share of inter-token gaps under 0.5 ms: tokens that reached the client in one chunk
    (an HTTP server merges them when its client lags; the load tester stamps extra tokens at
    the stream's end)."""
    gaps = [g for r in log.measured if r.ok for g in r.itls]
    return sum(g < 5e-4 for g in gaps) / len(gaps) if gaps else None


class Bench:
    """The trace, the adapters and the results of one benchmark invocation."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.path = model_path(args.model)
        config = ModelConfig.from_pretrained(self.path)
        tc = TraceConfig(num_requests=args.num_requests, rate=float("inf"),
                         adapters=args.adapter_popularity,
                         num_adapters=args.num_adapters, prompt_len=args.prompt_len,
                         output_len=f"fixed:{args.output_len}",
                         vocab_size=min(config.vocab_size, 32000), seed=args.seed)
        self.trace = generate_trace(tc)
        self.open_trace = generate_trace(replace(tc, rate=1.0))  # rescaled per rate
        self.warmup = generate_trace(replace(tc, num_requests=8, seed=args.seed + 1))
        root = env.cache_dir() / "loadtest" / f"adapters-serve-bench-{Path(self.path).name}"
        self.adapter_dirs: dict[str, Path] = {}
        used = {name for t in (self.trace, self.open_trace, self.warmup)
                for names in t.adapters_by_tenant().values() for name in names}
        for i in range(args.num_adapters):  # ranks 8 and 16, alternating; written once, reused
            if adapter_name(i) in used:
                self.adapter_dirs.update(ensure_adapter_dirs(
                    root, [adapter_name(i)], config, rank=8 if i % 2 == 0 else 16,
                    targets=TARGETS, seed=i))
        self.adapters = AdapterSet(root, model=self.path)
        self.runs: list[dict] = []
        self.phases: list[dict] = []
        self.rounds_done = 0

    def measure(self, system: str, target: Target, point: tuple[str, float], rnd: int,
                pid: int, metrics_port: int | None, target_ms: float = 0.0) -> None:
        args = self.args
        mode, value = point
        trace: Trace = self.trace if mode == "closed" else self.open_trace
        load0, cpu0 = os.getloadavg()[0], process_cpu_s(pid)
        before = scrape(metrics_port) if metrics_port else None
        t0 = time.monotonic()
        log = target.run(trace, run_config(mode, value, args))
        wall = time.monotonic() - t0
        cpu = cpu_delta(cpu0, process_cpu_s(pid))
        name = f"{system}-{mode}{value:g}-r{rnd}"
        log.save(args.out / f"{name}.jsonl")
        s = build_report(log, SLO(ttft_s=args.slo_ttft_ms / 1000,
                                  itl_s=args.slo_tpot_ms / 1000))["summary"]
        run = {"system": system, "target_itl_ms": target_ms, "mode": mode, "load": value,
               "round": rnd, "wall_s": wall, "output_tokens": s["output_tokens"],
               "output_tokens_per_s": s["output_tokens_per_s"],
               "ttft_s": s["ttft_s"], "itl_s": s["itl_s"], "tpot_s": s["tpot_s"],
               "goodput": s["goodput"], "num_errors": s["num_errors"],
               "errors": s["errors"], "merged_share": merged_share(log),
               "cpu_s": sum(cpu.values()), "cpu_by_process": cpu,
               "load_before": load0, "load_after": os.getloadavg()[0]}
        if before is not None and metrics_port:
            d = {k: v - before[k] for k, v in scrape(metrics_port).items()}
            steps, secs = d["loraplex_worker_steps_total"], d["loraplex_worker_step_seconds_total"]
            run.update(num_steps=steps, mean_step_s=secs / steps if steps else None,
                       steps_over_target=(d["loraplex_worker_steps_over_target_total"] / steps
                                          if steps and target_ms else None),
                       predicted_over_measured=(
                           d["loraplex_worker_step_predicted_seconds_total"] / secs
                           if secs else None))
        self.runs.append(run)
        print(f"  {name}: {run['output_tokens_per_s']:.1f} tok/s, {wall:.0f} s, "
              f"load {load0:.1f}->{run['load_after']:.1f}", file=sys.stderr)

    def idle_cpu(self, pid: int) -> dict[str, float]:
        """CPU seconds per wall second of each process of an idle server."""
        c0 = process_cpu_s(pid)
        time.sleep(self.args.idle_s)
        return {k: v / self.args.idle_s for k, v in cpu_delta(c0, process_cpu_s(pid)).items()}

    def loraplex_phase(self) -> dict:
        args = self.args
        targets = [float(t) for t in args.targets.split(",")]
        wanted = args.systems.split(",")
        servers: dict[float, tuple[LocalServer, int]] = {}
        systems: list[tuple[str, float, str]] = []  # (name, target, wire)
        info: dict = {"system": "loraplex", "uptime_before": uptime(), "idle_cpu": {}}
        try:
            for target in targets:  # every server up before any measured run
                port = free_port()
                # no prefix caching: rounds and systems repeat the trace's prompts
                serve = ["--no-enable-prefix-caching", "--target-itl-ms", f"{target:g}",
                         "--min-prefill-chunk", str(args.min_prefill_chunk),
                         "--num-pages", str(args.num_pages), "--dtype", args.dtype,
                         "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                         "--max-num-seqs", str(args.max_num_seqs),
                         "--metrics-port", str(port), "--max-rank", "16",
                         *args.serve_args.split()]
                # its data directory (adapter store, server.log) stays in --out
                data = args.out / f"loraplex-t{target:g}-phase{len(self.phases)}"
                server = LocalServer(model=self.path if args.model == "bench" else args.model,
                                     serve_args=serve, data_dir=data,
                                     startup_timeout_s=600.0).__enter__()
                servers[target] = (server, port)
                grpc = GrpcTarget(server.address, self.adapters)
                warm = RunConfig(mode="closed", concurrency=8, progress=False)
                grpc.run(self.warmup, warm)
                grpc.upload_missing(self.trace, warm)  # every adapter, whichever wire runs first
                if target == 0:
                    systems += [(s, 0.0, wire) for s, wire in (("loraplex", "grpc"),
                                                               ("loraplex-http", "http"))
                                if s in wanted]
                    if "loraplex-http" in wanted:
                        OpenAITarget("loraplex-http", server.http_url).run(self.warmup, warm)
                else:
                    systems.append((f"loraplex-t{target:g}", target, "grpc"))
            for target, (server, _) in servers.items():
                info["idle_cpu"][f"t{target:g}"] = self.idle_cpu(server.pid)
            for _ in range(args.rounds):
                rnd = self.rounds_done
                for point in load_points(args):
                    k = rnd % len(systems)
                    for name, target, wire in systems[k:] + systems[:k]:
                        server, port = servers[target]
                        t: Target = (GrpcTarget(server.address, self.adapters) if wire == "grpc"
                                     else OpenAITarget(name, server.http_url))
                        self.measure(name, t, point, rnd, server.pid, port, target)
                self.rounds_done += 1
        finally:
            for server, _ in servers.values():
                server.stop()
        info["uptime_after"] = uptime()
        return info

    def vllm_phase(self) -> dict:
        args = self.args
        info: dict = {"system": "vllm", "uptime_before": uptime()}
        with VllmServer(Path(self.path), self.adapter_dirs, max_lora_rank=16,
                        dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=512, threads_bind=args.vllm_bind,
                        extra_args=args.vllm_args.split(),
                        log_path=args.out / f"vllm-serve-{len(self.phases)}.log") as server:
            info.update(startup_s=server.startup_s, cmd=server.cmd, env=server.vllm_env)
            target = OpenAITarget("vllm", server.base_url, base_model=server.model)
            target.run(self.warmup, RunConfig(mode="closed", concurrency=8, progress=False))
            info["idle_cpu"] = self.idle_cpu(server.pid)
            for rnd in range(args.vllm_rounds):
                for point in load_points(args):
                    self.measure("vllm", target, point, rnd, server.pid, None)
        info["uptime_after"] = uptime()
        return info


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    commit = git_commit()
    if commit.endswith("-dirty") and not args.allow_dirty:
        raise SystemExit(f"commit {commit}: uncommitted changes; commit them (numbers are "
                         "quoted from a committed tree) or pass --allow-dirty")
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    bench.trace.save(args.out / "trace.jsonl")
    t0 = time.monotonic()
    try:
        for phase in args.phases.split(","):
            if phase == "loraplex":
                bench.phases.append(bench.loraplex_phase())
            elif phase == "vllm":
                if "vllm" in args.systems.split(","):
                    bench.phases.append(bench.vllm_phase())
            else:
                raise SystemExit(f"--phases: {phase!r} is not loraplex or vllm")
            print(f"phase {phase} done, {time.monotonic() - t0:.0f} s so far; "
                  f"{bench.phases[-1]['uptime_after'] if bench.phases else ''}",
                  file=sys.stderr)
    finally:
        report = {"args": {k: str(v) if isinstance(v, Path) else v
                           for k, v in vars(args).items()},
                  "commit": commit, "machine": machine_info(1),
                  "vllm": peer_version() if "vllm" in args.phases else None,
                  "model": bench.path, "adapters_used": sorted(bench.adapter_dirs),
                  "phases": bench.phases, "runs": bench.runs,
                  "checks": checks(bench.runs),
                  "total_s": time.monotonic() - t0}
        (args.out / "serve_bench.json").write_text(json.dumps(report, indent=2))
    print_table(bench.runs)
    print(checks_table(bench.runs))
    print(f"wrote {args.out / 'serve_bench.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
