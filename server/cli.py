"""The ``loraplex`` command."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from loraplex.server.config import EngineConfig
from loraplex.server.settings import add_flags, apply_env, check_env, from_args

DEMO_PROMPTS = [
    "The quick brown fox",
    "Multi-tenant LoRA serving means",
    "Once upon a time",
    "def fibonacci(n):",
]


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` the flags of ``add_flags(parser, EngineConfig)`` ask for."""
    config: EngineConfig = from_args(EngineConfig, args)
    return config


def _run(args: argparse.Namespace) -> int:
    from loraplex.server.engine.llm import LLM
    from loraplex.server.engine.request import SamplingParams

    check_env(args)
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
    add_flags(run, EngineConfig)
    apply_env(run)
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
    from loraplex.server.startup import StartupError

    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"loraplex {args.command}: {exc}", file=sys.stderr)
        return 2
    except StartupError as exc:
        print(f"loraplex {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
