"""Stall-free decoding: ``loraplex serve`` with the inter-token latency target off and at two
targets, side by side on one trace, over gRPC with the load tester.

The trace (issue 22): 8 adapters of rank 8 and 16 on q, k, v, o; ``--num-requests`` requests
of 64-192 prompt tokens and 48 new tokens (EOS ignored), adapters drawn uniformly, driven in
a closed loop at each ``--concurrency``. One server per target runs for the whole benchmark
(its own adapter store, the adapters uploaded once, one warm-up run), and the measured runs
interleave: every round runs each concurrency on every server in turn, the order rotating,
so that a change in the machine's load hits every configuration alike. Reported per run:
output throughput, TTFT p50 / p99, ITL p50 / p99 (client side, streamed), the share of ITL
gaps over each target, and from the server's /metrics the share of engine steps over its
target and its cost model's predicted against measured step time.

Models: ``bench`` (the random 1024x8 Llama of ``common.BENCH_HF_CONFIG``), ``demo``, a
directory, or any name ``loraplex serve --model`` resolves (``smollm2`` once it is built in).

Usage: ``python benchmarks/stall_free.py --targets 0,150,250 --out bench-out/stall-free``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import BENCH_HF_CONFIG, build_model, machine_info  # noqa: E402

from loraplex.loadtest.adapters import ensure_adapter_dirs  # noqa: E402,I001
from loraplex.loadtest.local_server import LocalServer, free_port  # noqa: E402
from loraplex.loadtest.report import build_report  # noqa: E402
from loraplex.loadtest.runner import RunConfig  # noqa: E402
from loraplex.loadtest.targets import AdapterSet, GrpcTarget  # noqa: E402
from loraplex.loadtest.trace import TraceConfig, adapter_name, generate_trace  # noqa: E402
from loraplex.server import env  # noqa: E402
from loraplex.server.engine.engine import resolve_model_path  # noqa: E402
from loraplex.server.engine.models.config import ModelConfig  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
METRICS = ("loraplex_worker_steps_total", "loraplex_worker_steps_over_target_total",
           "loraplex_worker_step_seconds_total", "loraplex_worker_step_predicted_seconds_total")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench", help="bench, demo, smollm2 or a directory")
    p.add_argument("--targets", default="0,150,250", help="target_itl_ms per server (0: off)")
    p.add_argument("--concurrency", default="8,32", help="closed-loop clients, per run")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-len", default="uniform:64:192")
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every run")
    p.add_argument("--num-pages", type=int, default=768)
    p.add_argument("--min-prefill-chunk", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--serve-args", default="", help="more `loraplex serve` flags, for all")
    p.add_argument("--max-duration", type=float, default=240.0, help="per run, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out/stall-free"))
    return p.parse_args(argv)


def model_path(name: str) -> str:
    if name == "bench":
        return str(build_model(env.cache_dir() / "bench", BENCH_HF_CONFIG))
    return resolve_model_path(name)


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    samples = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return {k: samples.get(k, 0.0) for k in METRICS}


def itl_share_over(log, threshold_s: float) -> float | None:
    gaps = [g for r in log.measured if r.ok for g in r.itls]
    return sum(g > threshold_s for g in gaps) / len(gaps) if gaps else None


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    targets = [float(t) for t in args.targets.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    path = model_path(args.model)
    config = ModelConfig.from_pretrained(path)
    trace_config = TraceConfig(
        num_requests=args.num_requests, rate=float("inf"), adapters="uniform", num_adapters=8,
        prompt_len=args.prompt_len, output_len=f"fixed:{args.output_len}",
        vocab_size=min(config.vocab_size, 32000), seed=args.seed)
    trace = generate_trace(trace_config)
    trace.save(args.out / "trace.jsonl")
    warmup = generate_trace(replace(trace_config, seed=args.seed + 1))  # other prompts
    root = env.cache_dir() / "loadtest" / f"adapters-stall-free-{Path(path).name}"
    for i in range(8):  # ranks 8 and 16, alternating; written once, then reused
        ensure_adapter_dirs(root, [adapter_name(i)], config, rank=8 if i % 2 == 0 else 16,
                            targets=TARGETS, seed=i)
    adapters = AdapterSet(root, model=path)
    servers: dict[float, tuple[LocalServer, int]] = {}
    results: list[dict] = []
    try:
        for target in targets:  # every server up before any measured run
            port = free_port()
            # no prefix caching: the interleaved rounds repeat the trace, and cached prompts
            # would turn later rounds into decode-only runs
            serve = ["--no-enable-prefix-caching", "--target-itl-ms", str(target),
                     "--min-prefill-chunk",
                     str(args.min_prefill_chunk), "--num-pages", str(args.num_pages),
                     "--device", args.device, "--dtype", args.dtype, "--metrics-port",
                     str(port), "--max-rank", "16", *args.serve_args.split()]
            server = LocalServer(model=path if args.model == "bench" else args.model,
                                 serve_args=serve, startup_timeout_s=600.0).__enter__()
            servers[target] = (server, port)
            GrpcTarget(server.address, adapters).run(warmup, RunConfig(  # uploads, warms up
                mode="closed", concurrency=8, max_requests=8, progress=False))
        for rnd in range(args.rounds):
            for concurrency in concurrencies:
                order = targets[rnd % len(targets):] + targets[:rnd % len(targets)]
                for target in order:
                    server, port = servers[target]
                    run = RunConfig(mode="closed", concurrency=concurrency, progress=False,
                                    max_duration_s=args.max_duration,
                                    drain_timeout_s=args.max_duration)
                    before, start = scrape(port), time.monotonic()
                    log = GrpcTarget(server.address, adapters).run(trace, run)  # uploads none twice
                    wall = time.monotonic() - start
                    after = scrape(port)
                    d = {k: after[k] - before[k] for k in METRICS}
                    name = f"t{target:g}-c{concurrency}-r{rnd}"
                    log.save(args.out / f"{name}.jsonl")
                    s = build_report(log)["summary"]
                    steps = d["loraplex_worker_steps_total"]
                    results.append({
                        "target_itl_ms": target, "concurrency": concurrency, "round": rnd,
                        "wall_s": wall, "output_tokens_per_s": s["output_tokens_per_s"],
                        "ttft_s": s["ttft_s"], "itl_s": s["itl_s"],
                        "num_errors": s["num_errors"], "num_steps": steps,
                        "steps_over_target": (d["loraplex_worker_steps_over_target_total"]
                                              / steps if steps and target else None),
                        "itl_over": {f"{t:g}": itl_share_over(log, t / 1000)
                                     for t in targets if t},
                        "mean_step_s": (d["loraplex_worker_step_seconds_total"] / steps
                                        if steps else None),
                        "predicted_over_measured": (
                            d["loraplex_worker_step_predicted_seconds_total"]
                            / d["loraplex_worker_step_seconds_total"]
                            if d["loraplex_worker_step_seconds_total"] else None)})
                    print(f"done {name}: {wall:.0f} s", file=sys.stderr)
    finally:
        for server, _ in servers.values():
            server.stop()
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "machine": machine_info(int(os.environ.get("OMP_NUM_THREADS", "0") or 0)),
              "load_average": os.getloadavg(), "model": path, "runs": results}
    print_table(results, targets)
    (args.out / "stall_free.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out / 'stall_free.json'}", file=sys.stderr)


def print_table(results: list[dict], targets: list[float]) -> None:
    on = [t for t in targets if t]
    print(f"\n{'target':>7} {'conc':>5} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8} {'ITL max':>8} {'p99/p50':>8} {'steps>T':>8} "
          + " ".join(f"{'ITL>' + format(t, 'g'):>8}" for t in on)
          + f" {'step ms':>8} {'pred/meas':>9} {'err':>4}")
    for r in results:
        itl = r["itl_s"]
        ratio = itl["p99"] / itl["p50"] if itl["p50"] else None
        print(f"{r['target_itl_ms'] or 'off':>7} {r['concurrency']:>5} "
              f"{r['output_tokens_per_s']:>7.1f} {_ms(r['ttft_s']['p50']):>9} "
              f"{_ms(r['ttft_s']['p99']):>9} {_ms(itl['p50']):>8} {_ms(itl['p99']):>8} "
              f"{_ms(itl['max']):>8} "
              f"{'-' if ratio is None else f'{ratio:.2f}':>8} "
              f"{_pct(r['steps_over_target']):>8} "
              + " ".join(f"{_pct(r['itl_over'][format(t, 'g')]):>8}" for t in on)
              + f" {_ms(r['mean_step_s']):>8} "
              f"{'-' if r['predicted_over_measured'] is None else format(r['predicted_over_measured'], '.2f'):>9} "  # noqa: E501
              f"{r['num_errors']:>4}")
    base = {(r["concurrency"], r["round"]): r for r in results if not r["target_itl_ms"]}
    print("\nratios to the target-off run of the same concurrency and round:")
    print(f"{'target':>7} {'conc':>5} {'tok/s':>7} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8}")
    for r in results:
        b = base.get((r["concurrency"], r["round"]))
        if not r["target_itl_ms"] or b is None:
            continue

        def ratio(a: float | None, c: float | None) -> str:
            return "-" if not a or not c else f"{a / c:.2f}"

        print(f"{r['target_itl_ms']:>7g} {r['concurrency']:>5} "
              f"{ratio(r['output_tokens_per_s'], b['output_tokens_per_s']):>7} "
              f"{ratio(r['ttft_s']['p50'], b['ttft_s']['p50']):>9} "
              f"{ratio(r['itl_s']['p50'], b['itl_s']['p50']):>8} "
              f"{ratio(r['itl_s']['p99'], b['itl_s']['p99']):>8}")


if __name__ == "__main__":
    main()
