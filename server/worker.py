"""A worker: one engine behind the internal ``Worker`` gRPC service.

1. ``Worker.Generate`` admits a request: refused with ``UNAVAILABLE`` while draining,
   ``RESOURCE_EXHAUSTED`` when ``max_queue`` requests already wait, ``INVALID_ARGUMENT`` when the
   engine refuses it (a prompt that does not fit the context) — all before it is queued.
2. The engine thread (``EngineLoop``) runs it; each step's tokens stream back as chunks. A
   request that fails ends with its own status: ``FAILED_PRECONDITION`` naming the adapter
   when its adapter cannot be loaded or placed here, ``INVALID_ARGUMENT`` naming
   ``structured.<kind>`` when its structured-output constraint does not compile, compiles too
   slowly or cannot be satisfied, ``INTERNAL`` when sampling or the model step failed for it.
   These are the request's errors (trailer ``loraplex-origin: request``): the gateway keeps
   routing to this worker. Only refusals of all work (draining, a failed
   engine) say ``loraplex-origin: server``.
3. A cancelled call (client gone, deadline passed) raises ``CancelledError`` in the handler;
   closing the stream aborts the request, whose pages return within one step.
4. SIGTERM (``drain``): health turns NOT_SERVING, new requests get ``UNAVAILABLE``, running
   ones finish within the grace period and are aborted (``UNAVAILABLE``) after it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncGenerator, Callable

import grpc
from prometheus_client import CollectorRegistry

from loraplex.adapter_store.store import check_digest
from loraplex.server.api import (
    FINISH_REASONS,
    MAX_MESSAGE_BYTES,
    ORIGIN_SERVER,
    GenerateChunk,
    ServiceError,
    Timing,
    TokenizeRequest,
    TokenizeResult,
    Usage,
    WorkerRequest,
    WorkerStatus,
)
from loraplex.server.config import EngineConfig, WorkerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.request import Request, RequestOutput
from loraplex.server.engine.stats import EngineStats
from loraplex.server.engine.tokenizer import prompt_token_ids, token_text
from loraplex.server.engine_loop import EngineLoop
from loraplex.server.launch import served_model_name
from loraplex.server.metrics import MetricsServer, StreamTimer, WorkerMetrics
from loraplex.server.router_metrics import RouterSnapshot, register_router_metrics, router_snapshot
from loraplex.server.startup import cannot_bind
from loraplex.server.wire import services

logger = logging.getLogger(__name__)

MAX_PREFETCH = 256  # digests in one Prefetch call
MAX_IDLE_LABELS = 4096  # adapter labels kept for the idle list between scrapes


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def grpc_server_options() -> list[tuple[str, int]]:
    # so_reuseport=0: a second server on a taken port must fail, not silently share it.
    return [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


class WorkerService:
    """The ``Worker`` service's implementation (dataclasses in, dataclasses out)."""

    def __init__(self, engine_loop: EngineLoop, config: WorkerConfig, worker_id: str,
                 metrics: WorkerMetrics) -> None:
        self._engine = engine_loop
        self.config = config
        self.worker_id = worker_id
        self.metrics = metrics
        self.draining = False
        self._active: dict[str, Request] = {}
        self._adapter_labels: dict[str, str] = {}  # request id -> its adapter's metrics label
        # digest -> (label, monotonic time) of its latest request
        self._idle_labels: dict[str, tuple[str, float]] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_active(self) -> int:
        return len(self._active)

    def queue_depth(self) -> int:
        """Requests admitted here that are not running (the engine's stats lag by <= 50 ms)."""
        return max(len(self._active) - self._engine.stats.num_running, 0)

    def status(self) -> WorkerStatus:
        s = self._engine.stats
        return WorkerStatus(
            worker_id=self.worker_id, serving=self.serving, queue_depth=self.queue_depth(),
            num_running=s.num_running, max_queue=self.config.max_queue,
            num_pages=s.pages.num_pages, num_free_pages=s.pages.num_free,
            num_kv_pages=s.pages.num_kv, num_adapter_pages=s.pages.num_adapter,
            resident_adapters=tuple(s.resident_adapters), host_adapters=tuple(s.host_adapters),
            max_model_len=self._engine.engine.max_model_len)

    def router_snapshot(self, model_name: str, max_lora: int) -> RouterSnapshot:
        """The router metrics' view (called on the metrics thread: it reads copies)."""
        stats = self._engine.stats
        active = list(self._active.items())
        labels = dict(self._adapter_labels)
        keep = set(stats.resident_adapters) | {r.adapter_digest for _, r in active}
        # Forget the labels of evicted adapters, not of those the lagging stats have yet to
        # show (a rebind: the loop's writes never race it).
        recent = time.monotonic() - 5.0
        self._idle_labels = {d: (n, t) for d, (n, t) in list(self._idle_labels.items())
                             if d in keep or t > recent}
        return router_snapshot(
            model_name, stats,
            ((req, labels.get(rid, req.adapter_digest or "")) for rid, req in active),
            {d: n for d, (n, _) in self._idle_labels.items()}, max_lora)

    @property
    def serving(self) -> bool:
        return not self.draining and self._engine.error is None

    def _not_serving(self) -> ServiceError:
        """UNAVAILABLE with the ``server`` origin: the gateway takes this worker out of routing
        and tries another."""
        reason = self._engine.error or "the worker is draining"
        return ServiceError(grpc.StatusCode.UNAVAILABLE, f"{reason}; retry on another worker",
                            origin=ORIGIN_SERVER)

    def tokenize(self, request: TokenizeRequest) -> TokenizeResult:
        """A prompt's token ids as ``generate`` makes them, or token ids' text (``/tokenize``
        and ``/detokenize``): on the calling (asyncio) thread, with its own tokenizer, as
        ``generate`` encodes its prompts. Raises ``ServiceError``: INVALID_ARGUMENT naming the
        field, UNAVAILABLE (server) when not serving."""
        if not self.serving:
            raise self._not_serving()
        engine = self._engine.engine
        try:
            if isinstance(request.prompt, tuple):
                text = token_text(engine.tokenizer, engine.model_config.vocab_size,
                                  request.prompt)
                return TokenizeResult(request.prompt, text, engine.max_model_len)
            ids = prompt_token_ids(engine.tokenizer, request.prompt, request.add_special_tokens)
        except ValueError as exc:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        strs = (tuple(engine.tokenizer.token_strs(ids))  # a prompt encoded has a tokenizer
                if request.return_token_strs and engine.tokenizer is not None else ())
        return TokenizeResult(tuple(ids), "", engine.max_model_len, strs)

    def prefetch(self, digests: tuple[str, ...]) -> int:
        """Start host-cache loads of adapters ahead of their first request (``Prefetch``): how
        many started. Raises ``ServiceError``: INVALID_ARGUMENT for a malformed digest, more
        than ``MAX_PREFETCH`` or a worker without adapters, UNAVAILABLE (server) when not
        serving."""
        if not self.serving:
            raise self._not_serving()
        adapters = self._engine.engine.adapters
        if adapters is None:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               "prefetch: this worker serves no adapters")
        if len(digests) > MAX_PREFETCH:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"digests: {len(digests)}, more than {MAX_PREFETCH}")
        try:
            checked = [check_digest(d) for d in digests]
        except ValueError as exc:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"digests: {exc}") from None
        # a digest named twice starts once: the first's load may already have failed (an
        # unknown digest fails at once) by the time a second would be looked at
        return sum(adapters.warm(d) for d in dict.fromkeys(checked))

    async def generate(self, request: WorkerRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncGenerator[GenerateChunk, None]:
        """Admit ``request`` and stream its chunks. Raises ``ServiceError`` (see the module
        docstring for the codes)."""
        timer = StreamTimer(self.metrics)
        if not self.serving:
            timer.finish(request.tenant, "UNAVAILABLE", "unavailable")
            raise self._not_serving()
        if self.queue_depth() >= self.config.max_queue:
            timer.finish(request.tenant, "RESOURCE_EXHAUSTED", "overloaded")
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"worker queue is full ({self.config.max_queue} requests wait)")
        try:
            req, queue = self._engine.submit(request)
        except ValueError as exc:
            timer.finish(request.tenant, "INVALID_ARGUMENT", "invalid")
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        rid = request.request_id
        self._active[rid] = req
        if request.adapter_digest and self.config.router_metrics:
            label = request.adapter_digest
            if self.config.metrics_adapter_names and request.adapter_name:
                label = request.adapter_name
            self._adapter_labels[rid] = label
            if len(self._idle_labels) > MAX_IDLE_LABELS:  # nobody scrapes (and prunes)
                self._idle_labels = {}
            self._idle_labels[request.adapter_digest] = (label, time.monotonic())
        self._idle.clear()
        code, cause, finished = "CANCELLED", "cancelled", False
        num_left = request.params.n  # sequences still running: the stream ends after all
        num_output_tokens = num_draft_tokens = num_accepted_draft_tokens = 0
        try:
            while True:
                out = await queue.get()
                timer.tokens(len(out.new_token_ids))
                if not out.finished:
                    yield GenerateChunk(rid, list(out.new_token_ids), out.new_text,
                                        list(out.logprobs),
                                        prompt_logprobs=list(out.prompt_logprobs),
                                        index=out.index)
                    continue
                num_left -= 1
                num_output_tokens += out.num_output_tokens
                num_draft_tokens += out.num_draft_tokens
                num_accepted_draft_tokens += out.num_accepted_draft_tokens
                # One sequence failing fails the request: the finally block aborts the rest.
                finished = num_left == 0
                failure = request_failure(out)
                if failure is not None and self._engine.error is not None:
                    # The engine thread ended: every request fails, none by its own fault.
                    failure = ServiceError(grpc.StatusCode.UNAVAILABLE,
                                           f"{self._engine.error}; retry on another worker",
                                           origin=ORIGIN_SERVER, cause="engine")
                if failure is not None:
                    code, cause = failure.code.name, failure.cause
                    raise failure
                if num_left:
                    yield GenerateChunk(rid, list(out.new_token_ids), out.new_text,
                                        list(out.logprobs), out.finish_reason,
                                        prompt_logprobs=list(out.prompt_logprobs),
                                        index=out.index)
                    continue
                code, cause = "OK", ""
                yield self._last_chunk(req, out, timer, Usage(
                    out.num_prompt_tokens, num_output_tokens, req.num_cached_tokens,
                    num_draft_tokens, num_accepted_draft_tokens))
                return
        finally:
            del self._active[rid]
            self._adapter_labels.pop(rid, None)
            self._engine.release(rid)
            if not finished:
                self._engine.abort(rid)
            timer.finish(request.tenant, code, cause)
            if not self._active:
                self._idle.set()

    def _last_chunk(self, req: Request, out: RequestOutput, timer: StreamTimer,
                    usage: Usage) -> GenerateChunk:
        """The stream's last chunk: ``out``'s tokens, ``usage`` (the prompt and its cache
        hits once, since sequence 0 computed it; every sequence's output and drafts) and the
        timing."""
        queue_seconds = 0.0
        if req.first_scheduled_time is not None:
            queue_seconds = req.first_scheduled_time - req.arrival_time
            self.metrics.queue_time.observe(queue_seconds)
        timing = Timing(queue_seconds, timer.ttft, time.monotonic() - timer.start)
        return GenerateChunk(req.request_id, list(out.new_token_ids), out.new_text,
                             list(out.logprobs), out.finish_reason, usage, timing,
                             list(out.prompt_logprobs), out.index)

    async def drain(self, grace_seconds: float) -> None:
        """Refuse new requests, let running ones finish for ``grace_seconds``, then abort the
        rest (their streams end ``UNAVAILABLE``)."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace_seconds)
            return
        except asyncio.TimeoutError:
            pass
        logger.warning("drain: %d requests still running after %.1f s; aborting them",
                       len(self._active), grace_seconds)
        for rid in list(self._active):
            self._engine.abort(rid)
        try:
            await asyncio.wait_for(self._idle.wait(), 5.0)
        except asyncio.TimeoutError:
            logger.error("drain: %d requests did not end after abort", len(self._active))


def request_failure(out: RequestOutput) -> ServiceError | None:
    """The status a finished request ends with (None: it finished normally), its ``cause``
    labelling the failure metrics: ``aborted`` (the worker shuts down), ``adapter`` (its
    adapter could not be loaded or placed), ``numerics`` (sampling failed for its logits),
    ``internal`` (anything else, such as a failed model step)."""
    if out.finish_reason in FINISH_REASONS:
        return None
    if out.finish_reason == "abort":
        return ServiceError(grpc.StatusCode.UNAVAILABLE,
                            out.error or "request aborted: the worker is shutting down",
                            origin=ORIGIN_SERVER, cause="aborted")
    error = out.error or "the engine failed"
    if error.startswith("adapter"):
        # The adapter's blob is damaged or unreadable, or it can never fit beside the
        # request's KV: the request's error, not the worker's. A store outage lands here too;
        # the gateway reads the same store and would see it first (UNAVAILABLE there).
        return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, error, cause="adapter")
    if error.startswith("structured"):
        # The request's grammar does not compile, compiles too slowly, or can never be met.
        return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, error, cause="grammar")
    if error.startswith("sampling"):
        return ServiceError(grpc.StatusCode.INTERNAL, error, cause="numerics")
    return ServiceError(grpc.StatusCode.INTERNAL, error, cause="internal")


class GrpcHost:
    """What a gateway and a worker process share: a gRPC server and a ``/metrics`` endpoint,
    stopped in that order, with what the subclass owns released in between (``_release``)."""

    _server: grpc.aio.Server | None
    _metrics_server: MetricsServer | None

    @property
    def metrics_port(self) -> int | None:
        return self._metrics_server.port if self._metrics_server else None

    async def _release(self) -> None:
        """What the subclass frees once no call is open (its engine, its connections)."""

    async def stop(self) -> None:
        """Stop at once: open calls are cancelled."""
        if self._server is not None:
            await self._server.stop(grace=1.0)
            self._server = None
        await self._release()
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None

    async def wait(self) -> None:
        """Until the server stops."""
        if self._server is not None:
            await self._server.wait_for_termination()


class WorkerServer(GrpcHost):
    """A worker process's servers: the engine thread, ``Worker`` + health + reflection over
    gRPC, and ``/metrics``.

    If the engine thread ends by an exception, every request fails ``UNAVAILABLE``, health
    (the server's, every service's and ``loraplex.liveness``) turns NOT_SERVING for good and
    ``on_fatal(reason)`` is called on the server's loop: the command layer stops the servers
    and exits non-zero so that Kubernetes restarts the pod; a library user decides itself.

    Args:
        engine: the engine to serve (built by :func:`build_engine`).
        config: the server's settings.
        registry: where metrics go (a fresh registry when None).
        on_fatal: called with the reason once the engine thread has died.
    """

    def __init__(self, engine: Engine, config: WorkerConfig,
                 registry: CollectorRegistry | None = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.on_fatal = on_fatal
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self.port = config.port
        self._server: grpc.aio.Server | None = None
        self._loop: EngineLoop | None = None
        self._metrics_server: MetricsServer | None = None
        self.service: WorkerService | None = None
        self._health: services.HealthReporter | None = None
        self._fatal_task: asyncio.Task[None] | None = None  # held: the loop keeps weak refs

    @property
    def address(self) -> str:
        return format_address(self.config.host, self.port)

    async def start(self) -> None:
        """Bind and start serving (on the running asyncio loop)."""
        self._loop = EngineLoop(self.engine, asyncio.get_running_loop(),
                                on_fatal=self._engine_failed)
        server = grpc.aio.server(options=grpc_server_options())
        try:
            self.port = server.add_insecure_port(format_address(self.config.host,
                                                                self.config.port))
        except RuntimeError:  # grpc's "Failed to bind": the port is taken
            raise cannot_bind(self.config.host, self.config.port, "--port") from None
        if self.port == 0:
            raise OSError(f"worker: cannot listen on {self.address}")
        worker_id = self.config.worker_id or f"{socket.gethostname()}:{self.port}"
        metrics = WorkerMetrics(self.registry, self._snapshot)
        self.service = WorkerService(self._loop, self.config, worker_id, metrics)
        if self.config.router_metrics:
            register_router_metrics(self.registry, self._router_snapshot)
        name = services.add_worker_service(server, self.service)
        self._health = services.add_health_and_reflection(server, [name])
        await self._health.set_serving(True)  # the engine is loaded before the port opens
        self._loop.start()
        await server.start()
        self._server = server
        if self.config.metrics_port is not None:
            self._metrics_server = MetricsServer(self.registry, self.config.host,
                                                 self.config.metrics_port)
        logger.info("worker %s listening on %s", worker_id, self.address)

    def _engine_failed(self, error: str) -> None:
        # On the server's loop, right after every stream was failed: health first, then the
        # owner's callback (which may stop this server).
        async def fail() -> None:
            if self._health is not None:
                await self._health.fail()
            logger.error("worker %s: %s; NOT_SERVING", self.address, error)
            if self.on_fatal is not None:
                self.on_fatal(error)

        self._fatal_task = asyncio.get_running_loop().create_task(fail())

    def _router_snapshot(self) -> RouterSnapshot | None:
        if self.service is None:
            return None
        sched = self.engine.config.scheduler
        return self.service.router_snapshot(
            served_model_name(self.engine.config.model),
            sched.max_adapters_per_step or sched.max_num_seqs)

    def _snapshot(self) -> tuple[EngineStats, int] | None:
        if self._loop is None or self.service is None:
            return None
        return self._loop.stats, self.service.queue_depth()

    async def drain(self, grace_seconds: float | None = None) -> None:
        """SIGTERM: NOT_SERVING, refuse new work, finish or abort the running, then stop."""
        if self._health is None or self.service is None:
            return
        grace = self.config.drain_grace if grace_seconds is None else grace_seconds
        logger.info("worker draining (grace %.1f s)", grace)
        await self._health.shutdown()
        await self.service.drain(grace)
        await self.stop()

    async def _release(self) -> None:
        if self._loop is not None:
            self._loop.stop()
            self.engine.close()  # the engine thread has ended: its ranks may stop


def build_engine(config: EngineConfig, adapter_source: object | None = None) -> Engine:
    """The worker's engine, reading adapters by digest from ``adapter_source`` (the adapter
    store's ``AdapterSource``)."""
    return Engine(config, adapter_source=adapter_source)
