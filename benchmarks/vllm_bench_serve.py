"""vLLM's own serving benchmark, ``vllm bench serve``, against ``loraplex serve``'s OpenAI API
and ``vllm serve`` (issue 21: a side-by-side win over vLLM in its own benchmark).

``serve_bench.py`` measures both servers with loraplex's load tester; this one hands the
measuring to vLLM's client (vLLM's ``benchmarks/serve.py`` from the peer venv, ``make
bench-peers``), run exactly the same way against each server: its random dataset (prompts of
``--input-len`` tokens +- ``--range-ratio``, ``--output-len`` new tokens, EOS ignored, greedy),
the same ``--seed`` (so the same prompts, Poisson arrival times and adapter of every request),
``--num-prompts`` per run at each of ``--rates`` (``inf``: all at once), every request naming
one of ``--num-adapters`` LoRA adapters drawn uniformly by the client (``--lora-modules``; ranks
8 and 16 alternating, on q, k, v, o; 0: the base model). The adapters are the same PEFT folders
for both: uploaded to loraplex over gRPC, given to vLLM as ``--lora-modules`` with
``--max-loras`` their number (nothing swaps during a run).

One server at a time, in ``--phases`` order (default ``loraplex,vllm,loraplex``: vLLM's phase
bracketed; ``loraplex-base`` and ``vllm-base`` are the same servers' base models, every
request naming the base model: issue 21's "64 adapters at the speed vLLM serves none" is
``loraplex`` against ``vllm-base``; ``loraplex-split`` and ``loraplex-split-base`` are
loraplex as deployed, a ``loraplex gateway`` process in front of a ``loraplex worker``
process (``--split-workers`` of them, the threads and the cache shared out), where
``loraplex`` is ``loraplex serve``, both in one), each warmed with one short
client run first; each run's server CPU seconds are read from its whole process tree (vLLM's
API server, engine core and worker; loraplex's gateway and worker). Every server computes on
``--threads`` threads (default one: loraplex's ``OMP_NUM_THREADS``, its worker's with the
split systems; vLLM's worker ``VLLM_CPU_OMP_THREADS_BIND=0``, no core reserved); the client
shares the machine alike for both. Both get ``--memory-gib`` of cache: loraplex's
unified pool holds the KV pages and the adapters in it, vLLM's KV cache only the KV (its LoRA
slots are memory of their own).

Reported per system and rate (medians over runs): output tokens/s, requests/s, TTFT, TPOT and
ITL p50 / p99, E2E latency p50, goodput under ``--slo-ttft-ms`` / ``--slo-tpot-ms``, and server
CPU seconds; then ours / theirs per rate for each of ``PAIRS`` that ran. The client's own
result files stay in ``--out``; ``vllm_bench_serve.json`` carries the commit (a dirty tree
refused unless ``--allow-dirty``).

Usage: ``python benchmarks/vllm_bench_serve.py --out bench-out/vbs`` (``make bench-vllm-client``)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from common import git_commit, machine_info, median  # noqa: E402
from stall_free import TARGETS, model_path  # noqa: E402
from vllm_peer import peer_python, peer_version, process_cpu_s, threads_bind  # noqa: E402
from vllm_serve import VLLM_CLI, VllmServer, cpu_delta  # noqa: E402

from loraplex.loadtest.adapters import ensure_adapter_dirs, upload_missing  # noqa: E402,I001
from loraplex.loadtest.local_server import LocalCluster, LocalServer  # noqa: E402
from loraplex.loadtest.trace import adapter_name  # noqa: E402
from loraplex.server import env  # noqa: E402
from loraplex.server.client import AsyncClient  # noqa: E402
from loraplex.server.engine.models.config import ModelConfig  # noqa: E402

SYSTEMS = ("loraplex", "vllm", "loraplex-base", "vllm-base", "loraplex-split",
           "loraplex-split-base")
# (ours, theirs) compared in the report, where both ran
PAIRS = (("loraplex", "vllm"), ("loraplex", "vllm-base"), ("loraplex-base", "vllm-base"),
         ("loraplex-split", "vllm-base"), ("loraplex-split-base", "vllm-base"),
         ("loraplex-split", "loraplex"), ("loraplex-split-base", "loraplex-base"))
# what the table shows of each run, from the client's result file (milliseconds but tok/s)
METRICS = ("output_throughput", "request_throughput", "p50_ttft_ms", "p99_ttft_ms",
           "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms", "p50_e2el_ms",
           "request_goodput")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2, bench, demo or a directory")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--num-adapters", type=int, default=64,
                   help="LoRA adapters the client draws from (0: base-model requests)")
    p.add_argument("--rates", default="1,2,inf", help="request rates, req/s (inf: all at once)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--range-ratio", type=float, default=0.5,
                   help="prompt lengths uniform in input-len x (1 +- this)")
    p.add_argument("--prefix-len", type=int, default=0,
                   help="a random prefix of this many tokens shared by every prompt, before its "
                        "input-len tokens (the client's --random-prefix-len)")
    p.add_argument("--prefix-caching", action="store_true",
                   help="both servers reuse the KV of shared prefixes (vLLM's default; off "
                        "otherwise, so that every prompt token is computed)")
    p.add_argument("--phases", default="loraplex,vllm,loraplex",
                   help="one server at a time, in this order (a system may come twice)")
    p.add_argument("--memory-gib", type=int, default=1,
                   help="both servers' cache memory: loraplex's pool (KV pages and adapters), "
                        "vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE; its LoRA slots apart)")
    p.add_argument("--min-prefill-chunk", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="both servers")
    p.add_argument("--max-num-seqs", type=int, default=256, help="both servers")
    p.add_argument("--serve-args", default="",
                   help="more `loraplex serve` flags (`loraplex worker` ones for the split "
                        "systems)")
    p.add_argument("--threads", type=int, default=1,
                   help="each server's compute threads: loraplex's OMP_NUM_THREADS, vLLM's "
                        "worker bound to cores 0..threads-1")
    p.add_argument("--split-workers", type=int, default=1,
                   help="the split systems' worker processes: the --threads and the "
                        "--memory-gib shared out among them (threads // workers each, at "
                        "least one)")
    p.add_argument("--vllm-args", default="", help="more `vllm serve` flags")
    p.add_argument("--slo-ttft-ms", type=float, default=5000.0, help="goodput: TTFT limit")
    p.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput: TPOT limit")
    p.add_argument("--run-timeout", type=float, default=900.0, help="per client run, seconds")
    p.add_argument("--allow-dirty", action="store_true",
                   help="report from a tree with uncommitted changes (the commit says -dirty)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out/vllm-bench-serve"))
    args = p.parse_args(argv)
    for phase in args.phases.split(","):
        if phase not in SYSTEMS:
            p.error(f"--phases: {phase!r} is not one of {', '.join(SYSTEMS)}")
    if args.num_adapters < 0 or args.num_prompts < 1 or args.threads < 1 \
            or args.split_workers < 1 or args.prefix_len < 0:
        p.error("--num-adapters and --prefix-len must be >= 0, --num-prompts, --threads and "
                "--split-workers >= 1")
    try:
        rates(args)
    except ValueError:
        p.error(f"--rates: numbers or inf, got {args.rates!r}")
    return args


def rates(args: argparse.Namespace) -> list[float]:
    return [float(r) for r in args.rates.split(",") if r]


def adapter_names(args: argparse.Namespace) -> list[str]:
    return [adapter_name(i) for i in range(args.num_adapters)]


def client_argv(args: argparse.Namespace, base_url: str, model: str, tokenizer: str,
                rate: float, result_dir: Path, filename: str, num_prompts: int | None = None,
                base: bool = False, run: int = 0) -> list[str]:
    """``vllm bench serve``'s command line for one run: the same for either server but for
    ``base_url`` and ``model`` (the name the server gives the base model); ``base``: no
    adapters, every request the base model's. With ``--prefix-caching`` the seed is
    ``--seed`` + ``run`` (each run of a server its own prompts and shared prefix, so that no
    run finds the previous one's prompts cached; the same runs for every server)."""
    seed = args.seed + run if args.prefix_caching else args.seed
    argv = [str(peer_python()), "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
            "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
            "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len),
            "--random-range-ratio", str(args.range_ratio),
            "--random-prefix-len", str(args.prefix_len),
            "--num-prompts", str(num_prompts or args.num_prompts),
            "--request-rate", "inf" if rate == float("inf") else f"{rate:g}",
            "--ignore-eos", "--temperature", "0", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--goodput", f"ttft:{args.slo_ttft_ms:g}", f"tpot:{args.slo_tpot_ms:g}",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", filename,
            "--disable-tqdm"]
    if args.num_adapters and not base:
        argv += ["--lora-modules", *adapter_names(args), "--lora-assignment", "random"]
    return argv


def run_client(argv: list[str], result: Path, log: Path, timeout_s: float) -> dict:
    """Run the client; its result file's contents (the per-request lists dropped).

    Raises:
        RuntimeError: the client failed or wrote no result (the end of its output says why).
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    result.unlink(missing_ok=True)
    with open(log, "w") as out:
        proc = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout_s)
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve exited {proc.returncode}: "
                           f"{log.read_text(errors='replace')[-3000:]}")
    data = {k: v for k, v in json.loads(result.read_text()).items() if not isinstance(v, list)}
    # the client re-tokenizes prompts through a server's /tokenize where that server counts a
    # prompt's tokens otherwise (vLLM serves /tokenize, loraplex does not): then the two
    # servers ran different prompts, and the report says so
    data["prompts_realigned"] = "re-aligning prompts" in log.read_text(errors="replace")
    return data


def summarize(runs: Sequence[Mapping]) -> dict[str, dict[str, dict[str, float | None]]]:
    """rate -> system -> the median of each metric over that system's runs, and of its server
    CPU seconds per output token (``cpu_s_per_token``)."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for run in runs:
        out.setdefault(run["rate"], {}).setdefault(run["system"], {})
    for rate, systems in out.items():
        for system in systems:
            mine = [r for r in runs if r["rate"] == rate and r["system"] == system]
            row: dict[str, float | None] = {"runs": float(len(mine))}
            for key in METRICS:
                values = [r["result"][key] for r in mine if r["result"].get(key) is not None]
                row[key] = median(values) if values else None
            per_token = [r["cpu_s"] / r["result"]["total_output_tokens"] for r in mine
                         if r["result"].get("total_output_tokens")]
            row["cpu_s_per_token"] = median(per_token) if per_token else None
            row["failed"] = float(sum(r["result"].get("failed", 0) for r in mine))
            row["prompts_realigned"] = float(any(r["result"].get("prompts_realigned")
                                                 for r in mine))
            systems[system] = row
    return out


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y else None


def ratios(summary: Mapping[str, Mapping[str, Mapping[str, float | None]]]
           ) -> dict[str, dict[str, float | None]]:
    """"<rate> <ours>/<theirs>" -> output tok/s by the wall clock and per server CPU second,
    and TTFT p50 and ITL p99 (lower is better for those two), for each of ``PAIRS`` that
    ran at that rate."""
    out = {}
    for rate, systems in summary.items():
        for ours, theirs in PAIRS:
            a, b = systems.get(ours), systems.get(theirs)
            if a and b:
                out[f"{rate} {ours}/{theirs}"] = _pair(a, b)
    return out


def _pair(a: Mapping[str, float | None], b: Mapping[str, float | None]
          ) -> dict[str, float | None]:
    return {"tok_s": _ratio(a["output_throughput"], b["output_throughput"]),
            "tok_per_cpu_s": _ratio(b["cpu_s_per_token"], a["cpu_s_per_token"]),
            "ttft_p50": _ratio(a["p50_ttft_ms"], b["p50_ttft_ms"]),
            "itl_p99": _ratio(a["p99_itl_ms"], b["p99_itl_ms"])}


def _f(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def table(summary: Mapping[str, Mapping[str, Mapping[str, float | None]]]) -> str:
    lines = [f"{'rate':>5} {'system':<13} {'runs':>4} {'tok/s':>7} {'req/s':>6} "
             f"{'TTFT p50/p99 ms':>16} {'TPOT p50/p99':>14} {'ITL p50/p99':>13} "
             f"{'E2E p50':>8} {'goodput':>7} {'CPU ms/tok':>10}"]
    for rate, systems in summary.items():
        for system, r in systems.items():
            lines.append(
                f"{rate:>5} {system:<13} {_f(r['runs'], '.0f'):>4} "
                f"{_f(r['output_throughput']):>7} {_f(r['request_throughput'], '.2f'):>6} "
                f"{_f(r['p50_ttft_ms'], '.0f') + '/' + _f(r['p99_ttft_ms'], '.0f'):>16} "
                f"{_f(r['p50_tpot_ms'], '.0f') + '/' + _f(r['p99_tpot_ms'], '.0f'):>14} "
                f"{_f(r['p50_itl_ms'], '.0f') + '/' + _f(r['p99_itl_ms'], '.0f'):>13} "
                f"{_f(r['p50_e2el_ms'], '.0f'):>8} {_f(r['request_goodput'], '.2f'):>7} "
                f"{_f(None if r['cpu_s_per_token'] is None else 1000 * r['cpu_s_per_token']):>10}")
    realigned = sorted({f"{s} at {rate}" for rate, systems in summary.items()
                        for s, r in systems.items() if r.get("prompts_realigned")})
    if realigned:
        lines.append("WARNING: the client re-aligned the prompts of " + ", ".join(realigned)
                     + ": not the same trace")
    for key, q in ratios(summary).items():
        rate, pair = key.split(" ", 1)
        lines.append(f"rate {rate}: {pair.replace('/', ' / ')}: tok/s {_f(q['tok_s'], '.2f')}x, "
                     f"per CPU s "
                     f"{_f(q['tok_per_cpu_s'], '.2f')}x, TTFT p50 {_f(q['ttft_p50'], '.2f')}x, "
                     f"ITL p99 {_f(q['itl_p99'], '.2f')}x")
    return "\n".join(lines)


class Bench:
    """The adapters, the tokenizer and every run of one invocation."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.path = model_path(args.model)
        config = ModelConfig.from_pretrained(self.path)
        root = env.cache_dir() / "loadtest" / f"adapters-serve-bench-{Path(self.path).name}"
        self.adapter_dirs: dict[str, Path] = {}
        for i, name in enumerate(adapter_names(args)):  # serve_bench's: ranks 8 / 16
            self.adapter_dirs.update(ensure_adapter_dirs(
                root, [name], config, rank=8 if i % 2 == 0 else 16, targets=TARGETS, seed=i))
        self.runs: list[dict] = []
        self.phases: list[dict] = []

    def measure(self, system: str, base_url: str, model: str, pids: Sequence[int],
                phase: int) -> None:
        args = self.args
        for i, rate in enumerate(rates(args)):
            name = f"{system}-rate{rate:g}-p{phase}"
            cpu0, t0 = processes_cpu_s(pids), time.monotonic()
            result = run_client(client_argv(args, base_url, model, self.path, rate, args.out,
                                            f"{name}.json", base=system.endswith("-base"),
                                            run=1 + i),
                                args.out / f"{name}.json", args.out / f"{name}.log",
                                args.run_timeout)
            cpu = cpu_delta(cpu0, processes_cpu_s(pids))
            self.runs.append({"system": system, "rate": f"{rate:g}", "phase": phase,
                              "wall_s": time.monotonic() - t0, "cpu_s": sum(cpu.values()),
                              "cpu_by_process": cpu, "load_after": os.getloadavg()[0],
                              "result": result})
            print(f"  {name}: {result['output_throughput']:.1f} tok/s, "
                  f"{result.get('failed', 0)} failed", file=sys.stderr)

    def warm(self, system: str, base_url: str, model: str, phase: int) -> None:
        """One short run at once (8 requests): compiles, caches and first-step costs."""
        name = f"warmup-p{phase}"
        run_client(client_argv(self.args, base_url, model, self.path, float("inf"),
                               self.args.out, f"{name}.json", num_prompts=8,
                               base=system.endswith("-base")),
                   self.args.out / f"{name}.json", self.args.out / f"{name}.log",
                   self.args.run_timeout)

    def loraplex_phase(self, system: str, phase: int) -> dict:
        args = self.args
        split = system.startswith("loraplex-split")
        workers = args.split_workers if split else 1
        threads = max(1, args.threads // workers)
        serve = [*([] if args.prefix_caching else ["--no-enable-prefix-caching"]),
                 "--min-prefill-chunk", str(args.min_prefill_chunk),
                 "--pool-memory-bytes", str((args.memory_gib << 30) // workers),
                 "--dtype", args.dtype,
                 "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                 "--max-num-seqs", str(args.max_num_seqs), "--max-rank", "16",
                 *args.serve_args.split()]
        model_arg = self.path if args.model == "bench" else args.model
        common = {"data_dir": args.out / f"loraplex-phase{phase}",
                  "env": {"OMP_NUM_THREADS": str(threads)}, "startup_timeout_s": 600.0}
        gateway = ["--max-rank", "16"]
        server = (LocalCluster(model_arg, worker_args=serve, gateway_args=gateway,
                               workers=workers, **common)
                  if split else LocalServer(model_arg, serve_args=serve, **common))
        with server:
            if not system.endswith("-base"):
                asyncio.run(self._upload(server.address))
            base_url = server.http_url.removesuffix("/v1")
            model = base_model(server.http_url)
            self.warm(system, base_url, model, phase)
            self.measure(system, base_url, model, server.pids, phase)
        return {"system": system, "serve_args": serve, "threads": threads,
                **({"gateway_args": gateway, "workers": workers} if split else {})}

    async def _upload(self, address: str) -> None:
        client = AsyncClient(address)
        try:
            await upload_missing({}, client, {"default": list(self.adapter_dirs)},
                                 self.adapter_dirs)
        finally:
            await client.close()

    def vllm_phase(self, system: str, phase: int) -> dict:
        args = self.args
        adapters = {} if system == "vllm-base" else self.adapter_dirs  # base: no --enable-lora
        with VllmServer(Path(self.path), adapters, max_lora_rank=16,
                        dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=max(512, 2 * (args.prefix_len + args.input_len
                                                    + args.output_len)),
                        prefix_caching=args.prefix_caching,
                        threads_bind=threads_bind(args.threads), kvcache_gib=args.memory_gib,
                        extra_args=args.vllm_args.split(),
                        log_path=args.out / f"vllm-serve-{phase}.log") as server:
            base_url = server.base_url.removesuffix("/v1")
            self.warm(system, base_url, server.model, phase)
            self.measure(system, base_url, server.model, [server.pid], phase)
            return {"system": system, "startup_s": server.startup_s, "cmd": server.cmd,
                    "env": server.vllm_env}


def processes_cpu_s(pids: Sequence[int]) -> dict[str, float]:
    """``process_cpu_s`` of each of ``pids``' trees, in one mapping."""
    out: dict[str, float] = {}
    for pid in pids:
        out.update(process_cpu_s(pid))
    return out


def base_model(http_url: str) -> str:
    """The base model's name as the server lists it (its first model)."""
    from loraplex.loadtest.openai_http import base_model_name  # the openai package: dev extra

    return asyncio.run(base_model_name(http_url, None))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        peer_python()
    except FileNotFoundError as e:
        raise SystemExit(f"vLLM's client runs from the peer venv: {e}") from None
    commit = git_commit()
    if commit.endswith("-dirty") and not args.allow_dirty:
        raise SystemExit(f"commit {commit}: uncommitted changes; commit them (numbers are "
                         "quoted from a committed tree) or pass --allow-dirty")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    t0 = time.monotonic()
    try:
        for i, phase in enumerate(args.phases.split(",")):
            info = (bench.loraplex_phase(phase, i) if phase.startswith("loraplex")
                    else bench.vllm_phase(phase, i))
            bench.phases.append(info)
            print(f"phase {i} ({phase}) done, {time.monotonic() - t0:.0f} s so far",
                  file=sys.stderr)
    finally:
        summary = summarize(bench.runs)
        report = {"args": {k: str(v) if isinstance(v, Path) else v
                           for k, v in vars(args).items()},
                  "commit": commit, "machine": machine_info(args.threads), "vllm": peer_version(),
                  "model": bench.path, "adapters": sorted(bench.adapter_dirs),
                  "phases": bench.phases, "runs": bench.runs, "summary": summary,
                  "ratios": ratios(summary), "total_s": time.monotonic() - t0}
        (args.out / "vllm_bench_serve.json").write_text(json.dumps(report, indent=2))
    print(table(summary))
    print(f"wrote {args.out / 'vllm_bench_serve.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
