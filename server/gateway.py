"""The gateway: the public ``Generation`` and ``Adapters`` services in front of the workers.

A request's way through it (``GenerationService.generate_stream``):

1. Authenticate the API key (``auth.KeyRing``): the key names the tenant.
2. Bound every field that needs no tokenizer (prompt bytes, chat messages: count, roles and
   content bytes; max_tokens, stop strings, logprobs, ids): ``INVALID_ARGUMENT`` before
   anything is queued.
3. Resolve ``name[@version]`` to a digest through the adapter store, in the tenant's own
   namespace: another tenant's adapter is ``NOT_FOUND`` exactly like a missing one.
4. Admit it under the tenant's quota (``quota.Quotas``: requests in flight, tokens per
   minute), or refuse it ``RESOURCE_EXHAUSTED`` before any worker sees it. The slot is held
   until the stream ends, and the token charge is settled to the request's real usage.
5. Route (``router.route`` over the pool's snapshots) and proxy the worker's stream chunk by
   chunk. A worker that refuses (queue full, draining) or fails before the first token is
   sent is replaced by the next candidate; after it, the stream ends ``UNAVAILABLE``.
   Cancellation and the deadline reach the worker, which aborts the request.
6. SIGTERM (``Gateway.drain``): health NOT_SERVING, new requests ``UNAVAILABLE``, in-flight
   requests finish within the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace

import grpc
from prometheus_client import CollectorRegistry

from loraplex.adapter_store.errors import AdapterNotFound, AdapterStoreError
from loraplex.adapter_store.store import AdapterStore, parse_ref
from loraplex.server import convert
from loraplex.server.api import (
    ChatMessages,
    Completion,
    GenerateChunk,
    GenerateRequest,
    ServiceError,
    Timing,
    Usage,
    WorkerRequest,
)
from loraplex.server.auth import KeyRing
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.gateway_adapters import AdaptersService, UploadLimits
from loraplex.server.gateway_pool import WorkerPool
from loraplex.server.metrics import GatewayMetrics, MetricsServer, StreamTimer
from loraplex.server.params import check_messages
from loraplex.server.quota import (
    LocalQuotaBackend,
    QuotaBackend,
    Quotas,
    TenantLimits,
    Ticket,
)
from loraplex.server.startup import cannot_bind
from loraplex.server.tls import ServerTls
from loraplex.server.worker import format_address, grpc_server_options

logger = logging.getLogger(__name__)

MAX_STOP_TOKEN_IDS = 64
MAX_CHAT_MESSAGES = 512
MAX_REQUEST_ID_CHARS = 128
MAX_ADAPTER_REF_CHARS = 160
# Statuses after which the request may go to another worker (if no token was sent yet).
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# A stream that breaks after its first token: the worker is gone, whatever the code says.
BROKEN_STREAM = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                 grpc.StatusCode.UNKNOWN)


@dataclass(frozen=True)
class GatewayConfig:
    """One gateway (flags of ``loraplex gateway``).

    Attributes:
        host / port: where to listen (port 0: any free port).
        metrics_port: Prometheus ``/metrics`` port (None: none; 0: any free port).
        workers: ``HOST:PORT`` of each worker, or a DNS name resolving to many.
        load_factor: a worker takes a request only while its load stays within this factor
            of the mean (>= 1; see ``router.py``).
        status_interval_seconds: how often each worker's Status is polled (<= 0.25).
        dns_refresh_seconds: how often worker DNS names are re-resolved.
        drain_grace_seconds: how long in-flight requests may finish after SIGTERM.
        max_prompt_bytes / max_prompt_tokens / max_tokens: per-request bounds.
        max_upload_bytes / max_rank: bounds on uploaded adapters.
        allow_unauthenticated: serve without API keys on a non-loopback address.
        tenant_max_concurrency / tenant_tokens_per_minute: every tenant's quota unless its
            API key entries override it (0: unlimited; see ``quota.py``).
        quota_lease_seconds: how long a Redis-held concurrency slot outlives its gateway's
            last refresh (what a crashed gateway can leak, at most).
        tls: serve TLS with this certificate and key (None: plaintext; see ``tls.py``).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None
    workers: tuple[str, ...] = ()
    load_factor: float = 1.25
    status_interval_seconds: float = 0.2
    dns_refresh_seconds: float = 5.0
    drain_grace_seconds: float = 30.0
    max_prompt_bytes: int = 1 << 20
    max_prompt_tokens: int = 1 << 17
    max_tokens: int = 32768
    max_upload_bytes: int = 2 << 30
    max_rank: int = 64
    allow_unauthenticated: bool = False
    tenant_max_concurrency: int = 0
    tenant_tokens_per_minute: int = 0
    quota_lease_seconds: float = 15.0
    tls: ServerTls | None = None

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 65536:
                raise ValueError(f"{name}: must be in [0, 65535], got {value}")
        if not self.load_factor >= 1.0:
            raise ValueError(f"load_factor: must be >= 1, got {self.load_factor}")
        if not 0 < self.status_interval_seconds <= 0.25:
            raise ValueError("status_interval_seconds: must be in (0, 0.25]")
        if self.dns_refresh_seconds <= 0 or self.drain_grace_seconds < 0:
            raise ValueError("dns_refresh_seconds must be > 0, drain_grace_seconds >= 0")
        for name in ("max_prompt_bytes", "max_prompt_tokens", "max_tokens",
                     "max_upload_bytes", "max_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        for name in ("tenant_max_concurrency", "tenant_tokens_per_minute"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0 (0: unlimited)")
        if not self.quota_lease_seconds > 0:
            raise ValueError("quota_lease_seconds: must be > 0")

    @property
    def tenant_limits(self) -> TenantLimits:
        """Every tenant's quota before API key overrides."""
        return TenantLimits(self.tenant_max_concurrency, self.tenant_tokens_per_minute)


def check_bounds(request: GenerateRequest, config: GatewayConfig) -> None:
    """Refuse a request whose fields are out of bounds (what needs no tokenizer; the engine's
    ``SamplingParams`` already bounds stop strings and logprobs).

    Raises:
        ServiceError: INVALID_ARGUMENT naming the field.
    """
    def bad(message: str) -> ServiceError:
        return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)

    prompt = request.prompt
    if isinstance(prompt, ChatMessages):
        try:
            check_messages(prompt, MAX_CHAT_MESSAGES, config.max_prompt_bytes)
        except ValueError as exc:
            raise bad(str(exc)) from None
    elif isinstance(prompt, str):
        size = len(prompt.encode("utf-8", "surrogatepass"))
        if size == 0:
            raise bad("prompt: must not be empty")
        if size > config.max_prompt_bytes:
            raise bad(f"prompt: {size} bytes, over the limit of {config.max_prompt_bytes}")
    else:
        if not prompt:
            raise bad("prompt: must not be empty")
        if len(prompt) > config.max_prompt_tokens:
            raise bad(f"prompt: {len(prompt)} token ids, over the limit of "
                      f"{config.max_prompt_tokens}")
    params = request.params
    if params.max_tokens > config.max_tokens:
        raise bad(f"max_tokens: {params.max_tokens}, over the limit of {config.max_tokens}")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}")
    if len(request.request_id) > MAX_REQUEST_ID_CHARS or not request.request_id.isprintable():
        raise bad(f"request_id: at most {MAX_REQUEST_ID_CHARS} printable characters")
    if len(request.adapter) > MAX_ADAPTER_REF_CHARS:
        raise bad(f"adapter: at most {MAX_ADAPTER_REF_CHARS} characters")


class GenerationService:
    """The ``Generation`` service's implementation (see the module docstring)."""

    def __init__(self, config: GatewayConfig, keys: KeyRing, store: AdapterStore,
                 pool: WorkerPool, metrics: GatewayMetrics, quotas: Quotas) -> None:
        self.config = config
        self.keys = keys
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self.quotas = quotas
        self.draining = False
        self.num_active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def generate(self, request: GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> Completion:
        """The whole completion (the stream, gathered)."""
        result = Completion(request_id=request.request_id)
        async with contextlib.aclosing(self.generate_stream(request, context)) as chunks:
            async for chunk in chunks:
                result.request_id = chunk.request_id
                result.add(chunk)
        return result

    async def generate_stream(self, request: GenerateRequest,
                              context: grpc.aio.ServicerContext
                              ) -> AsyncGenerator[GenerateChunk, None]:
        """Authenticate, bound, resolve, admit, route and proxy one request."""
        timer = StreamTimer(self.metrics)
        tenant, code = "unauthenticated", "CANCELLED"
        ticket: Ticket | None = None
        usage: Usage | None = None
        num_streamed = 0
        self.num_active += 1
        self._idle.clear()
        try:
            identity = self.keys.authenticate(context.invocation_metadata())
            tenant = identity.tenant
            if self.draining:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                                   "the gateway is shutting down; retry")
            check_bounds(request, self.config)
            digest = await self.resolve(tenant, request.adapter)
            ticket = await self.quotas.admit(tenant, request)
            worker_request = WorkerRequest(
                request_id=uuid.uuid4().hex, tenant=tenant, prompt=request.prompt,
                params=request.params, adapter_digest=digest)
            request_id = request.request_id or worker_request.request_id
            async with contextlib.aclosing(self._proxy(worker_request, context, timer)) as chunks:
                async for chunk in chunks:
                    chunk.request_id = request_id
                    num_streamed += len(chunk.token_ids)
                    usage = chunk.usage or usage
                    yield chunk
            code = "OK"
        except ServiceError as exc:
            code = exc.code.name
            raise
        finally:
            remaining = context.time_remaining()
            if code == "CANCELLED" and remaining is not None and remaining <= 0:
                code = "DEADLINE_EXCEEDED"
            timer.finish(tenant, code)
            try:
                if ticket is not None:
                    await self.quotas.release(ticket, usage, num_streamed)
            finally:
                self.num_active -= 1
                if self.num_active == 0:
                    self._idle.set()

    async def resolve(self, tenant: str, ref: str) -> str | None:
        """``name[@version]`` -> digest in ``tenant``'s namespace (None: the base model).

        Raises:
            ServiceError: NOT_FOUND (the same for another tenant's adapter and a missing one),
                INVALID_ARGUMENT for a malformed reference, UNAVAILABLE if the store fails.
        """
        if not ref:
            return None
        try:
            parse_ref(ref)
        except ValueError as exc:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"adapter: {exc}") from None
        try:
            record = await asyncio.to_thread(self.store.resolve, tenant, ref)
        except AdapterNotFound:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"adapter {ref!r} not found") from None
        except AdapterStoreError as exc:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"adapter store: {exc}") from None
        return record.digest

    async def _proxy(self, request: WorkerRequest, context: grpc.aio.ServicerContext,
                     timer: StreamTimer) -> AsyncGenerator[GenerateChunk, None]:
        tried: set[str] = set()
        last_error: ServiceError | None = None
        while True:
            choice = self.pool.route(request.adapter_digest, frozenset(tried))
            if not choice.addresses:
                if last_error is not None:
                    raise last_error
                if choice.decision == "full":
                    raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       "every worker's queue is full; retry later")
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no worker is available")
            address = choice.addresses[0]
            tried.add(address)
            self.metrics.router_decisions.labels(decision=choice.decision).inc()
            sent = False
            stream = self.pool.handle(address).generate(request, context.time_remaining())
            try:
                async with contextlib.aclosing(stream):
                    async for chunk in stream:
                        sent = True
                        timer.tokens(len(chunk.token_ids))
                        if chunk.finished:
                            queued = chunk.timing.queue_seconds if chunk.timing else 0.0
                            chunk = replace(chunk, timing=Timing(
                                queued, timer.ttft, time.monotonic() - timer.start))
                        yield chunk
                return
            except ServiceError as exc:
                if sent:
                    if exc.code in BROKEN_STREAM:
                        self.pool.mark_unhealthy(address)
                        raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                                           f"the worker failed mid-stream: {exc.message}"
                                           ) from None
                    raise
                if exc.code not in RETRYABLE:
                    raise
                if exc.code == grpc.StatusCode.UNAVAILABLE:
                    self.pool.mark_unhealthy(address)
                logger.info("request %s: worker %s refused (%s); trying another",
                            request.request_id, address, exc.code.name)
                self.metrics.retries.labels(reason=exc.code.name.lower()).inc()
                last_error = exc

    async def drain(self, grace_seconds: float) -> bool:
        """Refuse new requests; wait up to ``grace_seconds`` for in-flight ones. Returns
        whether they all finished."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace_seconds)
        except asyncio.TimeoutError:
            return False
        return True


class Gateway:
    """A gateway's servers: ``Generation`` + ``Adapters`` + health + reflection over gRPC,
    the worker pool, and ``/metrics``.

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
        self.pool = WorkerPool(config.workers, self.metrics, config.status_interval_seconds,
                               config.dns_refresh_seconds, config.load_factor,
                               on_change=self._workers_changed)
        self.quotas = Quotas(config.tenant_limits, keys.tenant_limits,
                             quota_backend or LocalQuotaBackend(), self._quota_refused)
        self.generation = GenerationService(config, keys, store, self.pool, self.metrics,
                                            self.quotas)
        limits = UploadLimits(max_bytes=config.max_upload_bytes, max_rank=config.max_rank)
        self.adapters = AdaptersService(store, keys, base_config, limits, self.metrics)
        self.port = config.port
        self._server: grpc.aio.Server | None = None
        self._health: convert.HealthReporter | None = None
        self._metrics_server: MetricsServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return format_address(self.config.host, self.port)

    @property
    def metrics_port(self) -> int | None:
        return self._metrics_server.port if self._metrics_server else None

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
        names = [convert.add_generation_service(server, self.generation),
                 convert.add_adapters_service(server, self.adapters)]
        self._health = convert.add_health_and_reflection(server, names)
        await self._health.set_serving(False)
        await self.quotas.backend.start()
        await self.pool.start()
        await server.start()
        self._server = server
        if self.config.metrics_port is not None:
            self._metrics_server = MetricsServer(self.registry, self.config.host,
                                                 self.config.metrics_port)
        if wait_for_workers > 0:
            await self.pool.wait_healthy(wait_for_workers)
        await self._update_health()
        logger.info("gateway listening on %s (%d workers, %d healthy)", self.address,
                    len(self.pool.snapshots()), self.pool.num_healthy)

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
        grace = self.config.drain_grace_seconds if grace_seconds is None else grace_seconds
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
        """Stop at once: open calls are cancelled."""
        if self._server is not None:
            await self._server.stop(grace=1.0)
            self._server = None
        await self.pool.close()
        await self.quotas.backend.close()
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None

    async def wait(self) -> None:
        """Until the server stops."""
        if self._server is not None:
            await self._server.wait_for_termination()


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
