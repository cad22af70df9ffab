"""The server commands' main coroutines: ``serve`` (gateway and one worker in one process),
``gateway`` and ``worker``. Each starts its servers, installs the signal handlers (SIGTERM /
SIGINT drain, a second one stops at once; SIGHUP re-reads API keys) and runs until stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from loraplex.server.settings import from_args

if TYPE_CHECKING:
    from loraplex.server.auth import KeyRing
    from loraplex.server.config import EngineConfig, GatewayConfig, WorkerConfig
    from loraplex.server.engine.engine import Engine

logger = logging.getLogger(__name__)

EXAMPLE_PROMPT = "Once upon a time"
# The exit status of a process whose engine thread died (any non-zero status makes Kubernetes
# restart the container; this one says why in `kubectl describe pod`).
EXIT_ENGINE_FAILED = 3


class _Fatal:
    """The command layer's ``on_fatal``: remembers the engine failure and stops the servers,
    so that the command returns ``EXIT_ENGINE_FAILED``."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.stop: Callable[[], Coroutine[Any, Any, None]] | None = None
        self._tasks: list[asyncio.Task[None]] = []  # held: the loop keeps only weak references

    def __call__(self, error: str) -> None:
        logger.critical("%s: stopping the servers; exit status %d", error, EXIT_ENGINE_FAILED)
        self.error = error
        if self.stop is not None:
            self._tasks.append(asyncio.get_running_loop().create_task(self.stop()))

    @property
    def exit_code(self) -> int:
        return EXIT_ENGINE_FAILED if self.error is not None else 0


async def _build_engine(engine_config: EngineConfig, store: object) -> Engine:
    """The worker's engine, built so that only its own thread keeps an OpenMP team
    (``engine/cpu_threads.py``): this loop's thread and its executor's run their torch ops on
    one thread, and the model loads on every core on a thread that ends with the load."""
    from loraplex.server.engine import cpu_threads
    from loraplex.server.worker import build_engine

    cpu_threads.confine()
    loop = asyncio.get_running_loop()
    loop.set_default_executor(cpu_threads.confined_executor(None, "loraplex-io"))
    return await asyncio.to_thread(cpu_threads.run_on_own_thread,
                                   lambda: build_engine(engine_config, store))


def _store_spec(args: argparse.Namespace) -> str:
    from loraplex.adapter_store.cli import default_store
    from loraplex.server.config import StoreConfig

    return from_args(StoreConfig, args).store or default_store()


def _on_signals(drain: Callable[[], Coroutine[Any, Any, None]],
                stop: Callable[[], Coroutine[Any, Any, None]],
                reload_keys: Callable[[], None] | None = None) -> None:
    """SIGTERM / SIGINT drain (a second one stops at once); SIGHUP re-reads the API keys."""
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []  # held: the loop keeps only weak references

    def on_stop(signame: str) -> None:
        if tasks:
            logger.warning("%s again: stopping now", signame)
            tasks.append(loop.create_task(stop()))
            return
        logger.warning("%s: draining", signame)
        tasks.append(loop.create_task(drain()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop, sig.name)
    if reload_keys is not None:
        loop.add_signal_handler(signal.SIGHUP, reload_keys)


def _key_ring(config: GatewayConfig) -> KeyRing:
    from loraplex.server.auth import KeyRing
    from loraplex.server.startup import check_key_file

    check_key_file(config.api_keys)
    return KeyRing(path=config.api_keys, text=config.api_key_hashes)


def _check_ports(config: GatewayConfig | WorkerConfig) -> None:
    """A taken ``--port``, ``--metrics-port`` or ``--http-port`` fails now, before the model
    is loaded."""
    from loraplex.server.startup import check_port_free

    check_port_free(config.host, config.port, "--port")
    check_port_free(config.host, config.metrics_port, "--metrics-port")
    http_port = getattr(config, "http_port", -1)
    if http_port > 0:
        check_port_free(config.host, http_port, "--http-port")


def served_model_name(model: str) -> str:
    """The base model's default HTTP ``model`` name: its folder's (or file's) name, or the
    built-in model's (``demo``, ``smollm2``)."""
    from pathlib import Path

    path = Path(model.rstrip("/"))
    return (path.stem if path.suffix == ".gguf" else path.name) or model


def _gateway_config(args: argparse.Namespace, **overrides: Any) -> GatewayConfig:
    import dataclasses

    from loraplex.server.config import GatewayConfig

    config: GatewayConfig = from_args(GatewayConfig, args, **overrides)
    if not config.served_model_name:
        config = dataclasses.replace(config, served_model_name=served_model_name(config.model))
    return config


async def serve(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry

    from loraplex.adapter_store.store import open_store
    from loraplex.server.cli import engine_config_from_args
    from loraplex.server.config import WorkerConfig
    from loraplex.server.engine.engine import resolve_model_path
    from loraplex.server.engine.models.config import ModelConfig
    from loraplex.server.gateway import Gateway, check_exposure
    from loraplex.server.metrics import MetricsServer
    from loraplex.server.quota import open_quota_backend
    from loraplex.server.worker import WorkerServer

    engine_config = engine_config_from_args(args)
    early = _gateway_config(args, workers=("-",))
    keys = _key_ring(early)
    _check_ports(early)
    check_exposure(early, keys)
    if early.tls is not None:
        early.tls.credentials()  # bad TLS files fail now, not after the engine is built
    base = ModelConfig.from_pretrained(resolve_model_path(engine_config.model))
    spec = _store_spec(args)
    store = open_store(spec, base)
    engine = await _build_engine(engine_config, store)
    registry = CollectorRegistry()
    # SERVE_WORKER_EXCLUDES: where the in-process worker listens is serve's choice.
    worker_config = from_args(WorkerConfig, args, host="127.0.0.1", port=0, metrics_port=None,
                              worker_id="local")
    fatal = _Fatal()
    worker = WorkerServer(engine, worker_config, registry, on_fatal=fatal)
    await worker.start()
    # One /metrics server for the gateway and the worker together (one registry).
    config = _gateway_config(args, workers=(worker.address,), metrics_port=None)
    gateway = Gateway(config, store, base, keys, registry,
                      open_quota_backend(spec, config.quota_lease_seconds))
    await gateway.start(wait_for_workers=10.0)
    metrics = None
    if early.metrics_port is not None:
        metrics = MetricsServer(registry, config.host, early.metrics_port)

    async def drain() -> None:
        await asyncio.gather(gateway.drain(), worker.drain())

    async def stop() -> None:
        await gateway.stop()
        await worker.stop()

    fatal.stop = stop
    _on_signals(drain, stop, keys.reload)
    chat = engine.tokenizer is not None and engine.tokenizer.has_chat_template
    _print_ready(gateway.address, engine_config.model, spec, keys.keyless,
                 metrics.port if metrics else None, config.host, config.tls is not None,
                 gateway.http_url, config.served_model_name, chat)
    try:
        await gateway.wait()
        await worker.wait()
    finally:
        await stop()
        if metrics is not None:
            metrics.close()
        store.close()
    return fatal.exit_code


def _print_ready(address: str, model: str, store: str, keyless: bool, metrics_port: int | None,
                 host: str, tls: bool = False, http_url: str | None = None,
                 served_name: str = "", chat: bool = False) -> None:
    scheme = "TLS" if tls else "plaintext"
    lines = [f"loraplex serving {model} on {address} ({scheme}, adapter store "
             f"{redact(store)})"]
    if http_url is not None:
        lines.append(f"OpenAI HTTP API: {http_url}/v1 (model {served_name!r} or an adapter's "
                     "name)")
    if metrics_port is not None:
        lines.append(f"metrics: http://{host}:{metrics_port}/metrics")
    if keyless:
        lines.append("NO API KEYS: every caller is tenant 'default' (pass --api-keys FILE to "
                     "require keys)")
    key = "" if keyless else " --api-key $LORAPLEX_API_KEY"
    if tls:  # a self-signed certificate: --tls-ca-file CERT instead of --tls
        key += " --tls"
    lines += [
        "try:",
        f"  loraplex generate --server {address}{key} \"{EXAMPLE_PROMPT}\"",
        f"  loraplex demo-adapter --model {model} /tmp/demo-lora",
        f"  loraplex adapters push --server {address}{key} --name demo /tmp/demo-lora",
        f"  loraplex generate --server {address}{key} --adapter demo \"{EXAMPLE_PROMPT}\"",
        *([f"  loraplex generate --server {address}{key} --chat \"What is LoRA?\""]
          if chat else []),
        f"  grpcurl {'' if tls else '-plaintext '}"
        f"-d '{{\"text\": \"{EXAMPLE_PROMPT}\"}}' {address} "
        "loraplex.v1.Generation/GenerateStream",
    ]
    if http_url is not None:
        auth = "" if keyless else " -H \"Authorization: Bearer $LORAPLEX_API_KEY\""
        body = json.dumps({"model": served_name, "prompt": EXAMPLE_PROMPT, "max_tokens": 16})
        lines.append(f"  curl {http_url}/v1/completions{auth} -H 'Content-Type: "
                     f"application/json' -d '{body}'")
    print("\n".join(lines), flush=True)


async def gateway(args: argparse.Namespace) -> int:
    from loraplex.adapter_store.cli import base_model_config
    from loraplex.adapter_store.store import open_store
    from loraplex.server.gateway import Gateway
    from loraplex.server.quota import open_quota_backend

    config = _gateway_config(args)
    if not config.workers:
        raise ValueError("--workers: give HOST:PORT,... (or LORAPLEX_WORKERS)")
    keys = _key_ring(config)
    _check_ports(config)
    base = base_model_config(config.model)
    spec = _store_spec(args)
    store = open_store(spec, base)
    gateway = Gateway(config, store, base, keys,
                      quota_backend=open_quota_backend(spec, config.quota_lease_seconds))
    await gateway.start(wait_for_workers=5.0)
    _on_signals(gateway.drain, gateway.stop, keys.reload)
    print(f"loraplex gateway listening on {gateway.address} ("
          f"{'TLS' if config.tls else 'plaintext'}, {len(config.workers)} worker targets, "
          f"adapter store {redact(spec)})", flush=True)
    if gateway.http_url is not None:
        print(f"OpenAI HTTP API: {gateway.http_url}/v1 (model {config.served_model_name!r})",
              flush=True)
    try:
        await gateway.wait()
    finally:
        await gateway.stop()
        store.close()
    return 0


async def worker(args: argparse.Namespace) -> int:
    from loraplex.adapter_store.store import open_store
    from loraplex.server.cli import engine_config_from_args
    from loraplex.server.config import WorkerConfig
    from loraplex.server.engine.engine import resolve_model_path
    from loraplex.server.engine.models.config import ModelConfig
    from loraplex.server.worker import WorkerServer

    engine_config = engine_config_from_args(args)
    config = from_args(WorkerConfig, args)
    _check_ports(config)
    base = ModelConfig.from_pretrained(resolve_model_path(engine_config.model))
    store = open_store(_store_spec(args), base)
    engine = await _build_engine(engine_config, store)
    fatal = _Fatal()
    worker = WorkerServer(engine, config, on_fatal=fatal)
    fatal.stop = worker.stop
    await worker.start()
    _on_signals(worker.drain, worker.stop)
    print(f"loraplex worker listening on {worker.address}", flush=True)
    try:
        await worker.wait()
    finally:
        await worker.stop()
        store.close()
    return fatal.exit_code


def redact(spec: str) -> str:
    """A store spec fit for logs: a URL's password replaced by ``***``."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(spec)
    if parts.password is None:
        return spec
    user = f"{parts.username}:" if parts.username else ":"
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}***@{host}"))
