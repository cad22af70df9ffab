"""The server commands' main coroutines: ``serve`` (gateway and one worker in one process),
``gateway`` and ``worker``. Each starts its servers, installs the signal handlers (SIGTERM /
SIGINT drain, a second one stops at once; SIGHUP re-reads API keys) and runs until stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplex.server.auth import KeyRing
    from loraplex.server.gateway import GatewayConfig

logger = logging.getLogger(__name__)

EXAMPLE_PROMPT = "Once upon a time"


def _metrics_port(args: argparse.Namespace) -> int | None:
    return None if args.metrics_port < 0 else args.metrics_port


def _store_spec(args: argparse.Namespace) -> str:
    from loraplex.adapter_store.cli import default_store

    return args.store or default_store()


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


def _key_ring(args: argparse.Namespace) -> KeyRing:
    from loraplex.server.auth import KeyRing

    return KeyRing(path=args.api_keys, text=args.api_key_hashes)


def _gateway_config(args: argparse.Namespace, workers: tuple[str, ...], max_rank: int,
                    metrics_port: int | None) -> GatewayConfig:
    from loraplex.server.gateway import GatewayConfig
    from loraplex.server.tls import server_tls

    return GatewayConfig(
        host=args.host, port=args.port, metrics_port=metrics_port, workers=workers,
        load_factor=getattr(args, "load_factor", 1.25),
        status_interval_seconds=getattr(args, "status_interval", 0.2),
        dns_refresh_seconds=getattr(args, "dns_refresh", 5.0),
        drain_grace_seconds=args.drain_grace, max_prompt_bytes=args.max_prompt_bytes,
        max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens_limit,
        max_upload_bytes=args.max_upload_bytes, max_rank=max_rank,
        allow_unauthenticated=args.allow_unauthenticated,
        tenant_max_concurrency=args.tenant_max_concurrency,
        tenant_tokens_per_minute=args.tenant_tokens_per_minute,
        quota_lease_seconds=args.quota_lease_seconds,
        tls=server_tls(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file))


async def serve(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry

    from loraplex.adapter_store.store import open_store
    from loraplex.server.cli import engine_config_from_args
    from loraplex.server.engine.engine import resolve_model_path
    from loraplex.server.engine.models.config import ModelConfig
    from loraplex.server.gateway import Gateway, check_exposure
    from loraplex.server.metrics import MetricsServer
    from loraplex.server.quota import open_quota_backend
    from loraplex.server.worker import WorkerConfig, WorkerServer, build_engine

    engine_config = engine_config_from_args(args)
    keys = _key_ring(args)
    early = _gateway_config(args, ("-",), engine_config.max_rank, None)
    check_exposure(early, keys)
    if early.tls is not None:
        early.tls.credentials()  # bad TLS files fail now, not after the engine is built
    base = ModelConfig.from_pretrained(resolve_model_path(engine_config.model))
    spec = _store_spec(args)
    store = open_store(spec, base)
    engine = await asyncio.to_thread(build_engine, engine_config, store)
    registry = CollectorRegistry()
    worker = WorkerServer(engine, WorkerConfig(host="127.0.0.1", port=0,
                                               max_queue=args.max_queue,
                                               drain_grace_seconds=args.drain_grace,
                                               worker_id="local"), registry)
    await worker.start()
    # One /metrics server for the gateway and the worker together (one registry).
    config = _gateway_config(args, (worker.address,), engine_config.max_rank, None)
    gateway = Gateway(config, store, base, keys, registry,
                      open_quota_backend(spec, config.quota_lease_seconds))
    await gateway.start(wait_for_workers=10.0)
    metrics = None
    if _metrics_port(args) is not None:
        metrics = MetricsServer(registry, args.host, _metrics_port(args) or 0)

    async def drain() -> None:
        await asyncio.gather(gateway.drain(), worker.drain())

    async def stop() -> None:
        await gateway.stop()
        await worker.stop()

    _on_signals(drain, stop, keys.reload)
    _print_ready(gateway.address, engine_config.model, spec, keys.keyless,
                 metrics.port if metrics else None, args.host, config.tls is not None)
    try:
        await gateway.wait()
        await worker.wait()
    finally:
        await stop()
        if metrics is not None:
            metrics.close()
        store.close()
    return 0


def _print_ready(address: str, model: str, store: str, keyless: bool, metrics_port: int | None,
                 host: str, tls: bool = False) -> None:
    scheme = "TLS" if tls else "plaintext"
    lines = [f"loraplex serving {model} on {address} ({scheme}, adapter store "
             f"{redact(store)})"]
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
        f"  grpcurl {'' if tls else '-plaintext '}"
        f"-d '{{\"text\": \"{EXAMPLE_PROMPT}\"}}' {address} "
        "loraplex.v1.Generation/GenerateStream",
    ]
    print("\n".join(lines), flush=True)


async def gateway(args: argparse.Namespace) -> int:
    from loraplex.adapter_store.cli import base_model_config
    from loraplex.adapter_store.store import open_store
    from loraplex.server.gateway import Gateway
    from loraplex.server.quota import open_quota_backend

    workers = tuple(w.strip() for w in args.workers.split(",") if w.strip())
    if not workers:
        raise ValueError("--workers: give HOST:PORT,... (or LORAPLEX_WORKERS)")
    keys = _key_ring(args)
    base = base_model_config(args.model)
    spec = _store_spec(args)
    store = open_store(spec, base)
    config = _gateway_config(args, workers, args.max_rank, _metrics_port(args))
    gateway = Gateway(config, store, base, keys,
                      quota_backend=open_quota_backend(spec, config.quota_lease_seconds))
    await gateway.start(wait_for_workers=5.0)
    _on_signals(gateway.drain, gateway.stop, keys.reload)
    print(f"loraplex gateway listening on {gateway.address} ("
          f"{'TLS' if config.tls else 'plaintext'}, {len(workers)} worker targets, "
          f"adapter store {redact(spec)})", flush=True)
    try:
        await gateway.wait()
    finally:
        await gateway.stop()
        store.close()
    return 0


async def worker(args: argparse.Namespace) -> int:
    from loraplex.adapter_store.store import open_store
    from loraplex.server.cli import engine_config_from_args
    from loraplex.server.engine.engine import resolve_model_path
    from loraplex.server.engine.models.config import ModelConfig
    from loraplex.server.worker import WorkerConfig, WorkerServer, build_engine

    engine_config = engine_config_from_args(args)
    config = WorkerConfig(host=args.host, port=args.port, metrics_port=_metrics_port(args),
                          max_queue=args.max_queue, drain_grace_seconds=args.drain_grace,
                          worker_id=args.worker_id)
    base = ModelConfig.from_pretrained(resolve_model_path(engine_config.model))
    store = open_store(_store_spec(args), base)
    engine = await asyncio.to_thread(build_engine, engine_config, store)
    worker = WorkerServer(engine, config)
    await worker.start()
    _on_signals(worker.drain, worker.stop)
    print(f"loraplex worker listening on {worker.address}", flush=True)
    try:
        await worker.wait()
    finally:
        await worker.stop()
        store.close()
    return 0


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
