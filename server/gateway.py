"""The gateway: the public ``Generation`` (``gateway_generation.GenerationService``, where a
request's way through the gateway is told) and ``Adapters`` (``gateway_adapters``) services in
front of the workers, their health, the HTTP API, the worker pool and the adapter store's
announcements (``Gateway``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry

from loraplex.adapter_store.errors import AdapterStoreError
from loraplex.adapter_store.store import AdapterStore
from loraplex.server.auth import KeyRing
from loraplex.server.config import GatewayConfig
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.gateway_adapters import AdaptersService, UploadLimits
from loraplex.server.gateway_generation import GenerationService
from loraplex.server.gateway_pool import WorkerPool
from loraplex.server.metrics import GatewayMetrics, MetricsServer
from loraplex.server.quota import LocalQuotaBackend, QuotaBackend, Quotas
from loraplex.server.startup import cannot_bind
from loraplex.server.wire import services
from loraplex.server.worker import GrpcHost, format_address, grpc_server_options

if TYPE_CHECKING:
    from loraplex.server.http.server import HttpServer

logger = logging.getLogger(__name__)

# The base model's ``model`` name on the HTTP API when the commands give none.
DEFAULT_SERVED_NAME = "base"


class Gateway(GrpcHost):
    """A gateway's servers: ``Generation`` + ``Adapters`` + health + reflection over gRPC,
    the OpenAI-compatible HTTP API (``server/http/``, unless ``http_port`` is -1), the worker
    pool, and ``/metrics``.

    Args:
        config: the gateway's settings.
        store: the adapter store (names -> digests; uploads).
        base_config: the base model uploaded adapters must fit.
        keys: API keys (a keyless ``KeyRing()`` serves everyone as tenant ``default``); their
            entries may override tenants' quotas.
        registry: where metrics go (a fresh registry when None).
        quota_backend: where tenant quotas are counted (``quota.open_quota_backend``: Redis
            when the store is Redis); None counts in this process.
    """

    def __init__(self, config: GatewayConfig, store: AdapterStore, base_config: ModelConfig,
                 keys: KeyRing, registry: CollectorRegistry | None = None,
                 quota_backend: QuotaBackend | None = None) -> None:
        if not config.workers:
            raise ValueError("workers: at least one HOST:PORT is needed")
        check_exposure(config, keys)
        self.config = config
        self.keys = keys
        self.store = store
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry)
        self.pool = WorkerPool(config.workers, self.metrics, config.status_interval,
                               config.dns_refresh, config.load_factor,
                               on_change=self._workers_changed)
        self.quotas = Quotas(config.tenant_limits, keys.tenant_limits,
                             quota_backend or LocalQuotaBackend(), self._quota_refused)
        self.generation = GenerationService(config, keys, store, self.pool, self.metrics,
                                            self.quotas)
        limits = UploadLimits(max_bytes=config.max_upload_bytes, max_rank=config.max_rank)
        self.adapters = AdaptersService(store, keys, base_config, limits, self.metrics,
                                        on_stored=self.pool.warm)
        self.port = config.port
        self._server: grpc.aio.Server | None = None
        self._health: services.HealthReporter | None = None
        self._metrics_server: MetricsServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop_watch: Callable[[], None] | None = None  # the store's watch, once started
        self.http: HttpServer | None = None
        if config.http_port >= 0:
            from loraplex.server.http.app import OpenAIApp
            from loraplex.server.http.server import HttpServer

            api = OpenAIApp(self.generation, config.served_model_name or DEFAULT_SERVED_NAME,
                            config.http_timeout_seconds, config.chat_default_max_tokens,
                            ready=self._ready)
            self.http = HttpServer(api.app, config.host, config.http_port, config.tls)

    @property
    def address(self) -> str:
        return format_address(self.config.host, self.port)

    @property
    def http_url(self) -> str | None:
        """The HTTP API's base URL (``http[s]://host:port``; None: off)."""
        return self.http.url if self.http is not None else None

    def _ready(self) -> bool:
        return self.pool.num_healthy > 0 and not self.generation.draining

    def _quota_refused(self, tenant: str, limit: str) -> None:
        self.metrics.quota_refusals.labels(tenant=tenant, limit=limit).inc()

    async def start(self, wait_for_workers: float = 0.0) -> None:
        """Bind, connect to the workers and start serving (on the running asyncio loop).

        Args:
            wait_for_workers: seconds to wait for a first healthy worker before returning.
        """
        if self.keys.keyless:
            logger.warning("NO API KEYS: every caller is tenant 'default' with no "
                           "authentication. Give --api-keys FILE before exposing this gateway.")
        server = grpc.aio.server(options=grpc_server_options())
        address = format_address(self.config.host, self.config.port)
        try:
            if self.config.tls is not None:
                self.port = server.add_secure_port(address, self.config.tls.credentials())
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:  # grpc's "Failed to bind": taken since check_port_free ran
            raise cannot_bind(self.config.host, self.config.port, "--port") from None
        if self.port == 0:
            raise OSError(f"gateway: cannot listen on {self.address}")
        names = [services.add_generation_service(server, self.generation),
                 services.add_adapters_service(server, self.adapters)]
        self._health = services.add_health_and_reflection(server, names)
        await self._health.set_serving(False)
        await self.quotas.backend.start()
        await self.pool.start()
        await self._watch_store()
        await server.start()
        self._server = server
        if self.http is not None:
            await self.http.start()
        if self.config.metrics_port is not None:
            self._metrics_server = MetricsServer(self.registry, self.config.host,
                                                 self.config.metrics_port)
        if wait_for_workers > 0:
            await self.pool.wait_healthy(wait_for_workers)
        await self._update_health()
        logger.info("gateway listening on %s (%d workers, %d healthy)", self.address,
                    len(self.pool.snapshots()), self.pool.num_healthy)

    async def _watch_store(self) -> None:
        """Warm each adapter put into the store by anyone (``loraplex adapters push --store
        redis://...``, another gateway) as an upload here is warmed; a store that announces
        nothing (``fs:``) leaves those adapters to load at their first request."""
        loop = asyncio.get_running_loop()

        def stored(digest: str) -> None:  # on the store's watch thread
            with contextlib.suppress(RuntimeError):  # the loop closed: the gateway stopped
                loop.call_soon_threadsafe(self.pool.warm_announced, digest)

        try:  # off the loop: subscribing waits for the store's reply
            self._stop_watch = await asyncio.to_thread(self.store.watch_stored, stored)
        except AdapterStoreError as e:
            logger.warning("not watching the adapter store for pushed adapters (%s); they "
                           "load at their first request", e)

    def _workers_changed(self) -> None:
        task = asyncio.get_running_loop().create_task(self._update_health())
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    async def _update_health(self) -> None:
        if self._health is not None and not self.generation.draining:
            await self._health.set_serving(self.pool.num_healthy > 0)

    async def drain(self, grace_seconds: float | None = None) -> None:
        """SIGTERM: NOT_SERVING, refuse new requests, let in-flight ones finish within the
        grace period, then stop (whatever is left is cancelled)."""
        grace = self.config.drain_grace if grace_seconds is None else grace_seconds
        logger.info("gateway draining (grace %.1f s, %d in flight)", grace,
                    self.generation.num_active)
        self.generation.draining = True
        if self._health is not None:
            await self._health.shutdown()
        if not await self.generation.drain(grace):
            logger.warning("drain: %d requests still in flight after %.1f s; stopping",
                           self.generation.num_active, grace)
        await self.stop()

    async def stop(self) -> None:
        """Stop at once: open calls (HTTP first, then gRPC) are cancelled."""
        if self.http is not None:
            await self.http.stop()
        await super().stop()

    async def _release(self) -> None:
        if self._stop_watch is not None:
            stop, self._stop_watch = self._stop_watch, None
            await asyncio.to_thread(stop)  # joins the watch thread
        await self.pool.close()
        await self.quotas.backend.close()


def check_exposure(config: GatewayConfig, keys: KeyRing) -> None:
    """Refuse to serve a non-loopback address without API keys (unless told to).

    Raises:
        ValueError: naming the flags that fix it.
    """
    host = config.host
    loopback = host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")
    if keys.keyless and not config.allow_unauthenticated and not loopback:
        raise ValueError(f"host: refusing to serve {host} without API keys; give --api-keys "
                         "FILE (or --api-key-hashes), or --allow-unauthenticated")
