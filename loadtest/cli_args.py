"""The load tester's flags, and what they build: a trace, a run configuration, an SLO, the
systems under test. ``cli.py`` holds the commands."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from loraplex.loadtest.report import SLO
from loraplex.loadtest.runner import RunConfig
from loraplex.loadtest.scenarios import SCENARIOS, scenario_trace
from loraplex.loadtest.targets import (
    SYSTEMS,
    AdapterSet,
    BaselineTarget,
    EngineTarget,
    GrpcTarget,
    OpenAITarget,
    Target,
)
from loraplex.loadtest.trace import Trace, TraceConfig, generate_trace
from loraplex.server import env

DEFAULT_ADDRESS = "127.0.0.1:50051"


def _pairs(text: str, what: str) -> tuple[tuple[str, str], ...]:
    out = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{what}: {item!r} is not NAME=VALUE")
        out.append((key, value))
    return tuple(out)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """Flags that describe a trace (generated, a scenario, or read from a file)."""
    d = TraceConfig()
    g = p.add_argument_group("trace")
    g.add_argument("--trace", type=Path, default=None,
                   help="a trace JSONL to replay (then --rate rescales its arrivals)")
    g.add_argument("--scenario", choices=SCENARIOS, default=None,
                   help="a named trace (loadtest/scenarios.py); of the trace flags only "
                        "--num-requests, --rate and --seed apply to it")
    g.add_argument("--num-requests", type=int, default=None,
                   help=f"requests in the trace (default {d.num_requests})")
    g.add_argument("--rate", type=float, default=None,
                   help=f"mean arrival rate, requests/s; 'inf' sends all at once "
                        f"(default {d.rate:g})")
    g.add_argument("--burstiness", type=float, default=d.burstiness,
                   help="Gamma shape of inter-arrival gaps: 1 Poisson, < 1 burstier")
    g.add_argument("--adapters", default=d.adapters,
                   help="popularity: zipf:A | uniform | identical | distinct | skewed:F")
    g.add_argument("--num-adapters", type=int, default=d.num_adapters,
                   help="adapters to draw from (0: base model only)")
    g.add_argument("--base-fraction", type=float, default=d.base_fraction,
                   help="fraction of requests for the base model")
    g.add_argument("--prompt-len", default=d.prompt_len,
                   help="fixed:N | uniform:LO:HI | normal:MEAN:STD | lognormal:MEDIAN:SIGMA | "
                        "exponential:MEAN")
    g.add_argument("--output-len", default=d.output_len, help="as --prompt-len")
    g.add_argument("--max-prompt-len", type=int, default=d.max_prompt_len)
    g.add_argument("--max-output-len", type=int, default=d.max_output_len)
    g.add_argument("--prompts-file", default=None,
                   help="JSONL rows {prompt | prompt_len, output_len?}, or one prompt a line")
    g.add_argument("--tenants", default="default=1",
                   help="TENANT=WEIGHT,... each request's tenant drawn by weight")
    g.add_argument("--prefix-len", type=int, default=0, help="shared system-prompt tokens")
    g.add_argument("--num-prefixes", type=int, default=1)
    g.add_argument("--vocab-size", type=int, default=d.vocab_size,
                   help="random prompt token ids are < this")
    g.add_argument("--seed", type=int, default=0)


def trace_config(args: argparse.Namespace) -> TraceConfig:
    """The ``TraceConfig`` the trace flags describe (``ValueError`` names a bad one)."""
    d = TraceConfig()
    tenants = tuple((t, float(w)) for t, w in _pairs(args.tenants, "tenants"))
    return TraceConfig(
        num_requests=args.num_requests or d.num_requests,
        rate=args.rate if args.rate is not None else d.rate, burstiness=args.burstiness,
        adapters=args.adapters, num_adapters=args.num_adapters,
        base_fraction=args.base_fraction, prompt_len=args.prompt_len,
        output_len=args.output_len, max_prompt_len=args.max_prompt_len,
        max_output_len=args.max_output_len, prompts_file=args.prompts_file, tenants=tenants,
        prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
        vocab_size=args.vocab_size, seed=args.seed)


def load_trace(args: argparse.Namespace) -> Trace:
    """The trace to run: ``--trace`` file, ``--scenario``, or generated from the flags."""
    if args.trace is not None:
        return Trace.load(args.trace)
    if args.scenario is not None:
        return scenario_trace(args.scenario, args.num_requests, args.rate, args.seed)
    return generate_trace(trace_config(args))


def add_run_args(p: argparse.ArgumentParser) -> None:
    """Flags of how to drive a trace and what counts as good."""
    d = RunConfig()
    g = p.add_argument_group("run")
    g.add_argument("--mode", choices=["open", "closed"], default=d.mode,
                   help="open: send at arrival times; closed: --concurrency in flight")
    g.add_argument("--concurrency", type=int, default=d.concurrency)
    g.add_argument("--max-requests", type=int, default=None, help="send at most this many")
    g.add_argument("--max-duration", type=float, default=d.max_duration_s,
                   help="seconds: stop sending after this")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                   help="seconds to wait for requests in flight, then cancel them")
    g.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                   help="each request's deadline in seconds")
    g.add_argument("--warmup", type=int, default=0,
                   help="the first N requests are warm-up, reported apart")
    g.add_argument("--api-key", default=None, help="key for tenants without --tenant-keys "
                   "(env LORAPLEX_API_KEY)")
    g.add_argument("--tenant-keys", default="", help="TENANT=KEY,... one API key per tenant")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    s = p.add_argument_group("SLO (goodput)")
    s.add_argument("--slo-ttft-ms", type=float, default=None)
    s.add_argument("--slo-itl-ms", type=float, default=None,
                   help="limit on each request's mean inter-token latency")
    s.add_argument("--slo-e2e-ms", type=float, default=None)


def run_config(args: argparse.Namespace, trace_file: bool) -> RunConfig:
    """The ``RunConfig`` of the run flags; ``--rate`` rescales only a trace read from a
    file (a generated trace already has it)."""
    return RunConfig(
        mode=args.mode, rate=args.rate if trace_file else None,
        concurrency=args.concurrency, max_requests=args.max_requests,
        max_duration_s=args.max_duration, drain_timeout_s=args.drain_timeout,
        request_timeout_s=args.request_timeout, warmup_requests=args.warmup,
        api_keys=_pairs(args.tenant_keys, "tenant-keys"), default_api_key=args.api_key,
        progress=not args.no_progress)


def slo(args: argparse.Namespace) -> SLO:
    def s(ms: float | None) -> float | None:
        return None if ms is None else ms / 1000.0

    return SLO(s(args.slo_ttft_ms), s(args.slo_itl_ms), s(args.slo_e2e_ms))


def add_system_args(p: argparse.ArgumentParser) -> None:
    """Flags of the systems under test: where loraplex is, the engine and baseline knobs."""
    g = p.add_argument_group("systems")
    g.add_argument("--systems", "--system", dest="systems", default="loraplex",
                   help=f"comma-separated, of {', '.join(SYSTEMS)}: loraplex is a gateway at "
                        "--address (or --serve); loraplex-engine an engine in this process; "
                        "transformers-* the peft baseline in this process (same trace)")
    g.add_argument("--address", default=env.get("SERVER", DEFAULT_ADDRESS),
                   help="the gateway's HOST:PORT (env LORAPLEX_SERVER)")
    g.add_argument("--http-url", default=None,
                   help="loraplex-http: the gateway's OpenAI API base URL (default "
                        "http://HOST:8000/v1 with --address's host; --serve sets it)")
    g.add_argument("--openai-url", default="http://127.0.0.1:8000/v1",
                   help="openai: any OpenAI-compatible server's base URL (vllm serve, ...)")
    g.add_argument("--openai-model", default=None,
                   help="loraplex-http, openai: the base model's name in 'model' (default: "
                        "the server's first listed model)")
    g.add_argument("--serve", action="store_true",
                   help="start 'loraplex serve --model MODEL' on a free loopback port for the "
                        "run (own temporary adapter store) instead of using --address")
    g.add_argument("--serve-args", default="",
                   help="more 'loraplex serve' flags for --serve, e.g. '--scheduling vtc'")
    g.add_argument("--model", default="demo",
                   help="base model: a directory, a .gguf file, 'smollm2' or 'demo' (adapter "
                        "shapes, engine, baseline)")
    g.add_argument("--adapters-dir", type=Path, default=None,
                   help="random adapters are written here (default: under LORAPLEX_CACHE_DIR)")
    g.add_argument("--adapter-rank", type=int, default=8)
    g.add_argument("--no-upload", action="store_true",
                   help="do not upload the trace's missing adapters to the gateway")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="engine and baseline dtype")
    g.add_argument("--device", default="cpu", help="engine and baseline device")
    g.add_argument("--scheduling", default="fcfs", choices=["fcfs", "vtc"], help="engine")
    g.add_argument("--tenant-weights", default="", help="engine, vtc: TENANT=WEIGHT,...")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="engine")
    g.add_argument("--max-num-seqs", type=int, default=256, help="engine")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="engine")
    g.add_argument("--num-pages", type=int, default=None, help="engine")
    g.add_argument("--max-batch-size", type=int, default=16, help="baseline")
    g.add_argument("--batch-window-ms", type=float, default=50.0, help="baseline")
    g.add_argument("--max-loaded-adapters", type=int, default=64, help="baseline")


def adapter_set(args: argparse.Namespace) -> AdapterSet:
    model_key = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(args.model).name) or "model"
    root = args.adapters_dir or (env.cache_dir() / "loadtest"
                                 / f"adapters-{model_key}-r{args.adapter_rank}")
    return AdapterSet(root=root, model=args.model, rank=args.adapter_rank)


def make_target(args: argparse.Namespace, system: str, adapters: AdapterSet) -> Target:
    """The system named ``system`` configured from the flags."""
    if system == "loraplex":
        return GrpcTarget(args.address, adapters, upload=not args.no_upload)
    if system == "loraplex-http":
        url = args.http_url or f"http://{args.address.rsplit(':', 1)[0]}:8000/v1"
        uploader = GrpcTarget(args.address, adapters, upload=not args.no_upload)
        return OpenAITarget(system, url, args.openai_model, uploader)
    if system == "openai":
        return OpenAITarget(system, args.openai_url, args.openai_model)
    if system == "loraplex-engine":
        from loraplex.server.config import EngineConfig, SchedulerConfig, parse_tenant_weights

        sched = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens,
                                scheduling=args.scheduling,
                                tenant_weights=parse_tenant_weights(args.tenant_weights))
        config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                              num_pages=args.num_pages, scheduler=sched,
                              enable_prefix_caching=args.enable_prefix_caching)
        return EngineTarget(config, adapters)
    if system.startswith("transformers-"):
        return BaselineTarget(args.model, adapters, system.split("-", 1)[1],
                              args.max_batch_size, args.batch_window_ms / 1000.0,
                              args.max_loaded_adapters, args.dtype, args.device)
    raise ValueError(f"system: {system!r} is not one of {SYSTEMS}")


def systems(args: argparse.Namespace) -> list[str]:
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in names if s not in SYSTEMS]
    if not names or bad:
        raise ValueError(f"systems: {bad or 'none'} not in {SYSTEMS}")
    return names


def parse_rates(text: str) -> list[float]:
    rates = _floats(text)
    if not rates or any(not r > 0 or math.isinf(r) for r in rates):
        raise ValueError(f"rates: need positive finite numbers, got {text!r}")
    return rates
