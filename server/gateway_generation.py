"""The gateway's ``Generation`` service (``Gateway`` in ``gateway.py`` hosts it beside
``Adapters``).

A request's way through it (``GenerationService.generate_stream``, the one path below the
edge for both wires: the gRPC servicer in ``wire/services.py`` and the OpenAI HTTP API in
``server/http/`` each turn their message into a ``GenerateRequest`` and call it with their
call's ``CallContext``):

1. Authenticate the API key (``auth.KeyRing``): the key names the tenant.
2. Bound every field that needs no tokenizer (prompt bytes, chat messages: count, roles and
   content bytes; max_tokens, stop strings, logprobs, ids): ``INVALID_ARGUMENT`` before
   anything is queued. Tools become a tool-call constraint (``gateway_tools``).
3. Resolve ``name[@version]`` to a digest through the adapter store, in the tenant's own
   namespace: another tenant's adapter is ``NOT_FOUND`` exactly like a missing one.
4. Admit it under the tenant's quota (``quota.Quotas``: requests in flight, tokens per
   minute), or refuse it ``RESOURCE_EXHAUSTED`` before any worker sees it. The slot is held
   until the stream ends, and the token charge is settled to the request's real usage.
5. Route (``router.route`` over the pool's snapshots) and proxy the worker's stream chunk by
   chunk. A worker that refuses (queue full, draining) or fails before the first token is
   sent is replaced by the next candidate; after it, the stream ends ``UNAVAILABLE``.
   Cancellation and the deadline reach the worker, which aborts the request. A worker is
   taken out of routing only when the call failed at the transport (a status without the
   ``loraplex-origin`` trailer) or the worker refused all work (``server``); a request's own
   error (``request``: its adapter cannot be loaded, sampling failed) goes back to the
   client and the worker keeps serving everyone else.
6. SIGTERM (``Gateway.drain``): health NOT_SERVING, new requests ``UNAVAILABLE``, in-flight
   requests finish within the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import grpc

from loraplex.adapter_store.errors import AdapterNotFound, AdapterStoreError
from loraplex.adapter_store.store import AdapterStore, AdapterVersion, parse_ref
from loraplex.server.api import (
    ORIGIN_REQUEST,
    ORIGIN_SERVER,
    Completion,
    GenerateChunk,
    GenerateRequest,
    ServiceError,
    Timing,
    TokenizeRequest,
    TokenizeResult,
    Usage,
    WorkerRequest,
)
from loraplex.server.auth import KeyRing
from loraplex.server.config import GatewayConfig
from loraplex.server.gateway_bounds import check_bounds, check_tokenize_bounds
from loraplex.server.gateway_pool import WorkerPool
from loraplex.server.gateway_tools import ToolCallOutputs, constrain
from loraplex.server.metrics import GatewayMetrics, StreamTimer
from loraplex.server.quota import Quotas, Ticket
from loraplex.server.quote import quote

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

# A full worker queue suggests this wait before a retry (RESOURCE_EXHAUSTED, HTTP 429).
QUEUE_FULL_RETRY_AFTER_SECONDS = 1.0
# Statuses after which the request may go to another worker (if no token was sent yet).
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# A stream that breaks after its first token with one of these, not as the request's own
# error: the worker is gone.
BROKEN_STREAM = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                 grpc.StatusCode.UNKNOWN)


class CallContext(Protocol):
    """What the service needs of a call, whichever wire it came on (a
    ``grpc.aio.ServicerContext`` is one; the HTTP API makes its own)."""

    def invocation_metadata(self) -> Iterable[tuple[str, str | bytes]] | None:
        """The call's headers (``authorization`` among them), names in lower case."""

    def time_remaining(self) -> float | None:
        """Seconds to the call's deadline (None: no deadline)."""


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

    def authenticate(self, context: CallContext) -> str:
        """The caller's tenant (checked before the request's fields are looked at).

        Raises:
            ServiceError: UNAUTHENTICATED.
        """
        return self.keys.authenticate(context.invocation_metadata()).tenant

    def refused(self, tenant: str, error: ServiceError) -> None:
        """Count a request refused before ``generate_stream`` (a bad key or message)."""
        StreamTimer(self.metrics).finish(tenant, error.code.name, _cause(error))

    async def generate(self, request: GenerateRequest, context: CallContext) -> Completion:
        """The whole completion (the stream gathered; all n sequences in ``sequences``)."""
        result = Completion(request_id=request.request_id)
        async with contextlib.aclosing(self.generate_stream(request, context)) as chunks:
            async for chunk in chunks:
                result.request_id = chunk.request_id
                result.gather(chunk)
        return result

    async def generate_stream(self, request: GenerateRequest, context: CallContext
                              ) -> AsyncGenerator[GenerateChunk, None]:
        """Authenticate, bound, resolve, admit, route and proxy one request.

        Raises:
            ServiceError: the request's status (before or after its first chunk).
        """
        timer = StreamTimer(self.metrics)
        tenant, code, cause = "unauthenticated", "CANCELLED", "cancelled"
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
                                   "the gateway is shutting down; retry", cause="draining")
            request, tools = constrain(request)  # tool calling: a constraint, then the calls
            outputs = ToolCallOutputs(tools) if tools is not None else None
            check_bounds(request, self.config)
            record = await self.resolve(tenant, request.adapter)
            ticket = await self.quotas.admit(tenant, request)
            worker_request = WorkerRequest(
                request_id=uuid.uuid4().hex, tenant=tenant, prompt=request.prompt,
                params=request.params, adapter_digest=record.digest if record else None,
                adapter_name=f"{tenant}/{record.name}@{record.version}" if record else "")
            request_id = request.request_id or worker_request.request_id
            proxied = self._proxy(worker_request, request.adapter, context, timer)
            async with contextlib.aclosing(proxied) as chunks:
                async for chunk in chunks:
                    chunk.request_id = request_id
                    if outputs is not None:
                        outputs.update(chunk)
                    num_streamed += len(chunk.token_ids)
                    usage = chunk.usage or usage
                    yield chunk
            code = "OK"
        except ServiceError as exc:
            code, cause = exc.code.name, _cause(exc)
            raise
        finally:
            remaining = context.time_remaining()
            if code == "CANCELLED" and remaining is not None and remaining <= 0:
                code, cause = "DEADLINE_EXCEEDED", "deadline"
            timer.finish(tenant, code, cause)
            try:
                if ticket is not None:
                    await self.quotas.release(ticket, usage, num_streamed)
            finally:
                self.num_active -= 1
                if self.num_active == 0:
                    self._idle.set()

    async def tokenize(self, request: TokenizeRequest, context: CallContext) -> TokenizeResult:
        """A prompt's token ids, or token ids' text (the OpenAI API's ``/tokenize`` and
        ``/detokenize``): authenticated and bounded as a generation request's prompt, then
        answered by the least loaded healthy worker (the tokenizer lives with the model),
        another tried where one cannot serve.

        Raises:
            ServiceError: UNAUTHENTICATED, INVALID_ARGUMENT naming the field (here or from the
                worker), UNAVAILABLE (draining, or no worker could answer).
        """
        self.authenticate(context)
        if self.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               "the gateway is shutting down; retry", cause="draining")
        check_tokenize_bounds(request, self.config)
        last_error: ServiceError | None = None
        for snap in sorted((s for s in self.pool.snapshots() if s.healthy),
                           key=lambda s: s.load):
            try:
                return await self.pool.handle(snap.address).stub.tokenize(
                    request, timeout=context.time_remaining())
            except ServiceError as exc:
                lost = _lost_reason(exc)
                if exc.code != grpc.StatusCode.UNAVAILABLE or not lost:
                    raise _request_error(exc, "") from None
                self.pool.mark_unhealthy(snap.address, lost)
                last_error = ServiceError(exc.code, exc.message, cause="worker_lost")
        raise last_error or ServiceError(grpc.StatusCode.UNAVAILABLE, "no worker is available",
                                         cause="no_worker")

    async def resolve(self, tenant: str, ref: str) -> AdapterVersion | None:
        """``name[@version]`` -> its record in ``tenant``'s namespace (None: the base model).

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
            raise ServiceError(grpc.StatusCode.NOT_FOUND,
                               f"adapter {quote(ref)} not found") from None
        except AdapterStoreError as exc:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"adapter store: {exc}",
                               cause="store") from None
        return record

    async def _proxy(self, request: WorkerRequest, ref: str, context: CallContext,
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
                                       "every worker's queue is full; retry later",
                                       cause="overloaded",
                                       retry_after_seconds=QUEUE_FULL_RETRY_AFTER_SECONDS)
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no worker is available",
                                   cause="no_worker")
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
                        if chunk.timing is not None:  # the stream's last chunk
                            queued = chunk.timing.queue_seconds if chunk.timing else 0.0
                            chunk = replace(chunk, timing=Timing(
                                queued, timer.ttft, time.monotonic() - timer.start))
                        yield chunk
                return
            except ServiceError as exc:
                lost = _lost_reason(exc)
                if sent:
                    if exc.code in BROKEN_STREAM and lost:
                        self.pool.mark_unhealthy(address, lost)
                        raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                                           f"the worker failed mid-stream: {exc.message}",
                                           cause="worker_lost") from None
                    raise _request_error(exc, ref) from None
                if exc.code not in RETRYABLE:
                    raise _request_error(exc, ref) from None
                if exc.code == grpc.StatusCode.UNAVAILABLE and lost:
                    self.pool.mark_unhealthy(address, lost)
                logger.info("request %s: worker %s refused (%s); trying another",
                            request.request_id, address, exc.code.name)
                self.metrics.retries.labels(reason=exc.code.name.lower()).inc()
                busy = exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                last_error = ServiceError(exc.code, exc.message, cause="worker_lost" if lost
                                          else "overloaded" if busy else "worker_unavailable")

    async def drain(self, grace_seconds: float) -> bool:
        """Refuse new requests; wait up to ``grace_seconds`` for in-flight ones. Returns
        whether they all finished."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace_seconds)
        except asyncio.TimeoutError:
            return False
        return True


_CAUSES = {"UNAUTHENTICATED": "auth", "PERMISSION_DENIED": "auth",
           "INVALID_ARGUMENT": "invalid", "NOT_FOUND": "not_found",
           "RESOURCE_EXHAUSTED": "quota", "FAILED_PRECONDITION": "adapter"}


def _lost_reason(exc: ServiceError) -> str | None:
    """Why a worker's status says it is gone (``transport``: no loraplex trailer, the call
    failed below gRPC; ``not_serving``: it refuses all work), or None: the request's own."""
    return {None: "transport", ORIGIN_SERVER: "not_serving"}.get(exc.origin)


def _cause(exc: ServiceError) -> str:
    """The failure metrics' label for ``exc``: its own cause, else one read off its code."""
    return exc.cause or _CAUSES.get(exc.code.name, exc.code.name.lower())


def _request_error(exc: ServiceError, ref: str) -> ServiceError:
    """A worker's status for this request, as the client gets it (its adapter named: the
    worker knows only the digest)."""
    message = exc.message
    if exc.code == grpc.StatusCode.FAILED_PRECONDITION and ref:
        message = f"adapter {quote(ref)}: {message}"
    cause = {"INVALID_ARGUMENT": "worker_invalid", "INTERNAL": "worker_internal"}.get(
        exc.code.name, "")
    return ServiceError(exc.code, message, origin=ORIGIN_REQUEST, cause=exc.cause or cause)
