"""``loraplex serve | gateway | worker | generate | demo-adapter``, and ``--server`` for
``loraplex adapters push``.

Every flag of ``serve``, ``gateway`` and ``worker`` is a field of a config dataclass
(``server/config.py``) and also reads its default from ``LORAPLEX_<FIELD>``:
``--max-num-seqs`` <-> ``LORAPLEX_MAX_NUM_SEQS``; a flag on the command line wins.
docs/service.md has the table (generated: ``scripts/flag_table.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loraplex.server import env
from loraplex.server.settings import add_flags, apply_env, check_env, set_flag_default
from loraplex.server.style_adapter import TARGET_MODULES, StyleTraining

DEFAULT_SERVER = "127.0.0.1:50051"


# ``serve`` runs one gateway over one in-process worker: no routing settings, and the worker
# listens where serve puts it (its --host, --port and --metrics-port are the gateway's).
SERVE_GATEWAY_EXCLUDES = ("workers", "load_factor", "status_interval", "dns_refresh")
SERVE_WORKER_EXCLUDES = ("host", "port", "metrics_port", "worker_id")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the service commands to the ``loraplex`` parser. The server commands' flags come
    from the config dataclasses' fields (``settings.add_flags``)."""
    from loraplex.server.config import EngineConfig, GatewayConfig, StoreConfig, WorkerConfig

    serve = subparsers.add_parser(
        "serve", help="gateway and one worker in one process (demo model by default)",
        description="Serve the public API on --host:--port with one in-process worker.")
    # The engine's first: its --model and --max-rank are also the gateway's.
    add_flags(serve, EngineConfig)
    add_flags(serve, GatewayConfig, exclude=SERVE_GATEWAY_EXCLUDES)
    add_flags(serve, StoreConfig)
    add_flags(serve, WorkerConfig, exclude=SERVE_WORKER_EXCLUDES)
    # Metrics on any free port by default (printed at start): a second `serve` on one host
    # must not die on a fixed one. gateway and worker keep fixed ports for scrapers.
    set_flag_default(serve, "metrics_port", 0)
    serve.set_defaults(func=_run_async("serve"))
    apply_env(serve)

    gateway = subparsers.add_parser(
        "gateway", help="the public API in front of workers",
        description="Route the public API to workers with adapter affinity.")
    add_flags(gateway, GatewayConfig)
    add_flags(gateway, StoreConfig)
    gateway.set_defaults(func=_run_async("gateway"))
    apply_env(gateway)

    worker = subparsers.add_parser(
        "worker", help="one engine behind the internal Worker API",
        description="Serve the internal Worker API for gateways.")
    add_flags(worker, WorkerConfig)
    add_flags(worker, StoreConfig)
    add_flags(worker, EngineConfig)
    worker.set_defaults(func=_run_async("worker"))
    apply_env(worker)

    generate = subparsers.add_parser(
        "generate", help="stream a completion from a server to the terminal")
    generate.add_argument("prompt", nargs="?", default=None,
                          help="the text to complete (or give --chat)")
    generate.add_argument("--chat", default=None, metavar="MESSAGE",
                          help="send MESSAGE as the user's turn of a chat: the model's chat "
                               "template renders it and the reply ends at its end of turn")
    generate.add_argument("--system", default=None, metavar="TEXT",
                          help="with --chat: a system message before it")
    generate.add_argument("--server", default=env.get("SERVER", DEFAULT_SERVER),
                          help="the gateway's HOST:PORT (env LORAPLEX_SERVER)")
    generate.add_argument("--adapter", default="", help="NAME or NAME@VERSION (default: base)")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--min-tokens", type=int, default=0)
    generate.add_argument("--min-p", type=float, default=0.0)
    generate.add_argument("--presence-penalty", type=float, default=0.0)
    generate.add_argument("--frequency-penalty", type=float, default=0.0)
    generate.add_argument("--repetition-penalty", type=float, default=1.0)
    generate.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN=BIAS",
                          help="add BIAS to token id TOKEN's logit (repeatable)")
    generate.add_argument("--stop", action="append", default=[], help="a stop string "
                          "(repeatable)")
    constraint = generate.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", default=None, metavar="SCHEMA|@FILE",
                            help="constrain the output to this JSON schema")
    constraint.add_argument("--json-object", action="store_true",
                            help="constrain the output to a JSON object")
    constraint.add_argument("--regex", default=None, help="constrain the output to a match")
    constraint.add_argument("--choice", action="append", default=None, metavar="TEXT",
                            help="the output is one of these (repeat)")
    constraint.add_argument("--grammar", default=None, metavar="EBNF|@FILE",
                            help="constrain the output to an EBNF grammar (rule root)")
    generate.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    generate.add_argument("--api-key", default=None, help="(env LORAPLEX_API_KEY)")
    add_client_tls_args(generate)
    generate.set_defaults(func=_generate)

    demo = subparsers.add_parser(
        "demo-adapter", help="write a PEFT LoRA adapter for a base model: trained to answer "
        "like a pirate for a real model (smollm2, a .gguf), random for the demo model",
        description="For --model smollm2 or a .gguf file: fine-tune a LoRA (peft, CPU, about "
        "a minute or two) on built-in questions answered like a pirate, so its effect shows in "
        "the text. For --model demo or a folder: random weights (--train to train on a "
        "folder with a chat template).")
    demo.add_argument("dir", help="the directory to create")
    demo.add_argument("--model", default="demo",
                      help="a directory with config.json, a .gguf file, 'smollm2' or 'demo'")
    demo.add_argument("--train", action=argparse.BooleanOptionalAction, default=None,
                      help="train the pirate-style adapter (default: for smollm2 and .gguf "
                           "models) or write random weights (--no-train)")
    demo.add_argument("--steps", type=int, default=StyleTraining.steps,
                      help="training steps, one question/answer pair each")
    demo.add_argument("--rank", type=int, default=8)
    demo.add_argument("--targets", default=None, help="comma-separated modules (default "
                      "q_proj,v_proj random; q_proj,k_proj,v_proj,o_proj trained)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo_adapter)


# -- flags ----------------------------------------------------------------------------------------
def add_client_tls_args(parser: argparse.ArgumentParser) -> None:
    """TLS flags of the commands that call a gateway (each also read from the environment
    by ``Client``)."""
    parser.add_argument("--tls", action="store_true", default=None,
                        help="connect with TLS, checking the server against the system's "
                             "roots (env LORAPLEX_TLS=1)")
    parser.add_argument("--tls-ca-file", default=None, metavar="PEM",
                        help="connect with TLS, checking the server against this CA "
                             "(env LORAPLEX_TLS_CA_FILE)")
    parser.add_argument("--client-cert-file", default=None, metavar="PEM",
                        help="a client certificate for a gateway that requires one "
                             "(env LORAPLEX_CLIENT_CERT_FILE)")
    parser.add_argument("--client-key-file", default=None, metavar="PEM",
                        help="its private key (env LORAPLEX_CLIENT_KEY_FILE)")


def client_tls(args: argparse.Namespace) -> dict[str, Any]:
    """``Client`` keyword arguments from ``add_client_tls_args``' flags."""
    return {"tls": args.tls, "tls_ca_file": args.tls_ca_file,
            "client_cert_file": args.client_cert_file, "client_key_file": args.client_key_file}


def _run_async(command: str) -> Callable[[argparse.Namespace], int]:
    """The ``func`` of a server command: ``launch.<command>(args)`` on a fresh event loop."""
    def run(args: argparse.Namespace) -> int:
        check_env(args)
        from loraplex.server import launch

        return asyncio.run(getattr(launch, command)(args))
    return run


# -- clients --------------------------------------------------------------------------------------
def _logit_bias(items: list[str]) -> dict[int, float]:
    bias = {}
    for item in items:
        token, sep, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias: expected TOKEN=BIAS, got {item!r}") from None
        if not sep:
            raise ValueError(f"--logit-bias: expected TOKEN=BIAS, got {item!r}")
    return bias


def _structured(args: argparse.Namespace) -> Any:
    """The constraint the generate flags ask for (None: free text). Raises ``ValueError``."""
    from loraplex.server.params import StructuredOutput

    def text(value: str) -> str:
        return Path(value[1:]).read_text(encoding="utf-8") if value.startswith("@") else value

    if args.json_schema is not None:
        return StructuredOutput("json_schema", text(args.json_schema))
    if args.json_object:
        return StructuredOutput("json_object")
    if args.regex is not None:
        return StructuredOutput("regex", args.regex)
    if args.choice is not None:
        return StructuredOutput("choice", choices=tuple(args.choice))
    if args.grammar is not None:
        return StructuredOutput("grammar", text(args.grammar))
    return None


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from loraplex.server.client import Client, ServiceError

    if (args.prompt is None) == (args.chat is None):
        raise ValueError("give a PROMPT to complete or --chat MESSAGE (one of them)")
    if args.system is not None and args.chat is None:
        raise ValueError("--system: only with --chat")
    prompt: dict[str, Any] = {"prompt": args.prompt}
    if args.chat is not None:
        turns = [] if args.system is None else [{"role": "system", "content": args.system}]
        prompt = {"messages": [*turns, {"role": "user", "content": args.chat}]}
    try:
        structured = _structured(args)
        client = Client(args.server, api_key=args.api_key, timeout=args.timeout,
                        **client_tls(args))
    except (OSError, ValueError) as exc:
        print(f"loraplex generate: {exc}", file=sys.stderr)
        return 1
    with client:
        try:
            last = None
            bias = _logit_bias(args.logit_bias)
            for chunk in client.generate_stream(
                    adapter=args.adapter, max_tokens=args.max_tokens,
                    temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    seed=args.seed, stop=tuple(args.stop), min_tokens=args.min_tokens,
                    min_p=args.min_p, presence_penalty=args.presence_penalty,
                    frequency_penalty=args.frequency_penalty,
                    repetition_penalty=args.repetition_penalty, logit_bias=bias,
                    structured=structured, **prompt):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
        except ServiceError as exc:
            hint = ""
            if exc.code == grpc.StatusCode.UNAUTHENTICATED and not client.has_api_key:
                hint = " (this server needs an API key: pass --api-key KEY or set " \
                       "LORAPLEX_API_KEY)"
            print(f"\nloraplex generate: {exc.code.name}: {exc.message}{hint}",
                  file=sys.stderr)
            return 1
        except ValueError as exc:  # a parameter out of bounds, refused before sending
            print(f"loraplex generate: {exc}", file=sys.stderr)
            return 1
    print()
    if last is not None and last.usage is not None and last.timing is not None:
        print(f"[{last.finish_reason}: {last.usage.prompt_tokens} prompt + "
              f"{last.usage.completion_tokens} completion tokens, TTFT "
              f"{last.timing.ttft_seconds * 1000:.0f} ms, total "
              f"{last.timing.total_seconds:.2f} s]", file=sys.stderr)
    return 0


def write_demo_adapter(path: str | Path, model: str = "demo", rank: int = 8,
                       targets: tuple[str, ...] = ("q_proj", "v_proj"), seed: int = 0,
                       std: float = 0.1) -> Path:
    """Write a random PEFT LoRA adapter (``adapter_config.json`` +
    ``adapter_model.safetensors``) that fits the base model ``model``.

    Raises:
        ValueError: an unknown target module, or ``path`` exists and is not empty.
    """
    import torch
    from safetensors.torch import save_file

    from loraplex.adapter_store.cli import base_model_config
    from loraplex.adapter_store.format import peft_key

    base = base_model_config(model)
    shapes = base.module_shapes()
    for module in targets:
        if module not in shapes:
            raise ValueError(f"targets: {module!r} is not one of {sorted(shapes)}")
    out = Path(path)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out}: exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base.num_layers):
        for module in targets:
            d_in, d_out = shapes[module]
            tensors[peft_key(layer, module, "A")] = torch.randn(rank, d_in, generator=gen) * std
            tensors[peft_key(layer, module, "B")] = torch.randn(d_out, rank, generator=gen) * std
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
              "base_model_name_or_path": model}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _demo_adapter(args: argparse.Namespace) -> int:
    train = args.train
    if train is None:
        train = args.model == "smollm2" or args.model.lower().endswith(".gguf")
    default = ",".join(TARGET_MODULES) if train else "q_proj,v_proj"
    targets = tuple(t.strip() for t in (args.targets or default).split(",") if t.strip())
    if train:
        out = _train_demo_adapter(args, targets)
    else:
        out = write_demo_adapter(args.dir, args.model, args.rank, targets, args.seed)
    print(f"wrote a {'trained' if train else 'random'} rank-{args.rank} LoRA adapter "
          f"({', '.join(targets)}) for {args.model} to {out}")
    return 0


def _train_demo_adapter(args: argparse.Namespace, targets: tuple[str, ...]) -> Path:
    import logging

    from transformers.utils import logging as hf_logging

    from loraplex.server.engine.models.builtin import resolve_model_path
    from loraplex.server.style_adapter import train_style_adapter

    if args.model == "demo":
        raise ValueError("--train: the demo model has random weights; train on smollm2")
    training = StyleTraining(steps=args.steps, rank=args.rank, seed=args.seed, targets=targets)
    logging.getLogger("loraplex.server.style_adapter").setLevel(logging.INFO)  # progress
    hf_logging.disable_progress_bar()  # the steps are the progress; not a weight-loading bar
    print(f"training a rank-{args.rank} pirate-style LoRA adapter for {args.model} "
          f"({args.steps} steps on the CPU)...", file=sys.stderr, flush=True)
    return train_style_adapter(resolve_model_path(args.model), args.dir, training,
                               base_name=args.model)


def push_remote(args: argparse.Namespace) -> int:
    """``loraplex adapters push --server HOST:PORT``: upload through the gateway's ``Upload``
    instead of writing the store directly."""
    import getpass

    from loraplex.adapter_store.store import DEFAULT_TENANT
    from loraplex.server.client import Client, ServiceError

    uploader = args.uploader
    if uploader is None:
        try:
            uploader = getpass.getuser()
        except (OSError, KeyError):
            uploader = "unknown"
    # --tenant's default means "the key's own tenant"; naming another needs an admin key.
    tenant = "" if args.tenant == DEFAULT_TENANT else args.tenant
    try:
        with Client(args.server, api_key=args.api_key, **client_tls(args)) as client:
            record = client.upload_adapter(args.dir, args.name, tenant=tenant,
                                           uploader=uploader)
    except (ServiceError, ValueError) as exc:
        print(f"loraplex adapters push: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"tenant": record.tenant, "name": record.name,
                          "version": record.version, **record.to_record()}))
    else:
        print(f"pushed {record.tenant}/{record.ref} sha256:{record.digest} "
              f"(rank {record.rank}, {','.join(record.target_modules)}, {record.dtype}, "
              f"{record.nbytes} bytes) via {args.server}")
    return 0
