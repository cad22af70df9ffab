"""The ``loraplex`` command."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from loraplex.server.config import EngineConfig, SchedulerConfig

DEMO_PROMPTS = [
    "The quick brown fox",
    "Multi-tenant LoRA serving means",
    "Once upon a time",
    "def fibonacci(n):",
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags that map one-to-one onto ``EngineConfig`` / ``SchedulerConfig``."""
    d, s = EngineConfig(), SchedulerConfig()
    parser.add_argument("--model", default=d.model,
                        help="HF model directory, a .gguf file, 'smollm2' (a real 135M model) "
                             "or 'demo' (tiny, random)")
    parser.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--kernels", default=d.kernels, choices=["auto", "torch", "triton"])
    parser.add_argument("--num-pages", type=int, default=d.num_pages)
    parser.add_argument("--pool-memory-bytes", type=int, default=d.pool_memory_bytes)
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--max-rank", type=int, default=d.max_rank)
    parser.add_argument("--page-size", type=int, default=s.page_size)
    parser.add_argument("--max-num-seqs", type=int, default=s.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=s.max_num_batched_tokens)
    parser.add_argument("--long-prefill-token-threshold", type=int,
                        default=s.long_prefill_token_threshold)
    parser.add_argument("--max-adapters-per-step", type=int, default=s.max_adapters_per_step)
    parser.add_argument("--scheduling", default=s.scheduling, choices=["fcfs", "vtc"])
    parser.add_argument("--vtc-input-weight", type=float, default=s.vtc_input_weight)
    parser.add_argument("--vtc-output-weight", type=float, default=s.vtc_output_weight)
    parser.add_argument("--tenant-weights", default="",
                        help="tenant=weight pairs, comma-separated (vtc)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=d.enable_prefix_caching)
    parser.add_argument("--share-prefix-across-tenants", action=argparse.BooleanOptionalAction,
                        default=d.share_prefix_across_tenants)
    parser.add_argument("--host-cache-bytes", type=int, default=d.host_cache_bytes)
    parser.add_argument("--seed", type=int, default=d.seed)


def parse_tenant_weights(text: str) -> tuple[tuple[str, float], ...]:
    """``"a=2,b=0.5"`` -> ``(("a", 2.0), ("b", 0.5))``; ``ValueError`` names a bad pair."""
    pairs = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        tenant, sep, weight = item.partition("=")
        try:
            value = float(weight)
        except ValueError:
            value = float("nan")
        if not sep or not tenant or not value > 0:
            raise ValueError(f"tenant_weights: {item!r} is not tenant=positive-number")
        pairs.append((tenant, value))
    return tuple(pairs)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    sched = SchedulerConfig(page_size=args.page_size, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            long_prefill_token_threshold=args.long_prefill_token_threshold,
                            max_adapters_per_step=args.max_adapters_per_step,
                            scheduling=args.scheduling,
                            vtc_input_weight=args.vtc_input_weight,
                            vtc_output_weight=args.vtc_output_weight,
                            tenant_weights=parse_tenant_weights(args.tenant_weights))
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                        kernels=args.kernels, num_pages=args.num_pages,
                        pool_memory_bytes=args.pool_memory_bytes,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        max_model_len=args.max_model_len, max_rank=args.max_rank,
                        host_cache_bytes=args.host_cache_bytes,
                        enable_prefix_caching=args.enable_prefix_caching,
                        share_prefix_across_tenants=args.share_prefix_across_tenants,
                        seed=args.seed, scheduler=sched)


def _run(args: argparse.Namespace) -> int:
    from loraplex.server.engine.llm import LLM
    from loraplex.server.engine.request import SamplingParams

    llm = LLM(engine=None, **_engine_kwargs(engine_config_from_args(args)))
    prompts = args.prompt or DEMO_PROMPTS
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, res in zip(prompts, results):
        print(f"{prompt!r} -> {res.token_ids[:12]}{'...' if len(res.token_ids) > 12 else ''} "
              f"{res.text[:60]!r}")
    num_tokens = sum(len(r.token_ids) for r in results)
    print(f"{len(results)} requests, {num_tokens} tokens in {elapsed:.2f} s: "
          f"{num_tokens / elapsed:.1f} output tokens/s")
    return 0


def _engine_kwargs(config: EngineConfig) -> dict:
    from dataclasses import fields

    kwargs = {f.name: getattr(config, f.name) for f in fields(config) if f.name != "scheduler"}
    kwargs.update({f.name: getattr(config.scheduler, f.name) for f in fields(config.scheduler)})
    return kwargs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="offline: generate from a few prompts and print tokens/s")
    add_engine_args(run)
    run.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    run.add_argument("--max-tokens", type=int, default=32)
    run.add_argument("--temperature", type=float, default=0.0)
    run.set_defaults(func=_run)
    from loraplex.adapter_store.cli import register as register_adapters
    from loraplex.loadtest.cli import register as register_bench
    from loraplex.server.commands import register as register_service

    register_adapters(sub)
    register_service(sub)
    register_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"loraplex {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
