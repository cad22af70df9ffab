"""Client stubs: the generated gRPC stubs, taking and returning the service's dataclasses.

Every RPC is one row of a table (``_Public`` for the gateway's services, ``WorkerStub`` for
the worker's): which generated stub and method it calls and its two conversions. The blocking
and the asyncio stubs are the same table over another kind of channel; a row's descriptor
makes the method of the kind its stub is (``Blocking`` or ``NonBlocking``), so no method is
written twice. Every call raises ``ServiceError`` for a non-OK status (with the
``loraplex-origin`` trailer's value, if any); closing a stream's iterator cancels the call.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar, overload

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraplex.adapter_store.store import AdapterVersion
from loraplex.server.api import (
    AdapterQuery,
    ServiceError,
    UploadPart,
)
from loraplex.server.wire.messages import (
    ORIGIN_KEY,
    adapter_from_pb,
    chunk_from_pb,
    completion_from_pb,
    generate_request_to_pb,
    prefetch_request_to_pb,
    prefetch_response_from_pb,
    tokenize_request_to_pb,
    tokenize_result_from_pb,
    upload_part_to_pb,
    worker_request_to_pb,
    worker_status_from_pb,
)
from loraplex.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
    generation_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

Metadata = list[tuple[str, str]]
Req = TypeVar("Req")
Resp = TypeVar("Resp")
Req_contra = TypeVar("Req_contra", contravariant=True)
Out_co = TypeVar("Out_co", covariant=True)

# The generated stub class behind each name a row uses.
_GENERATED: dict[str, Callable[[Any], Any]] = {
    "generation": generation_pb2_grpc.GenerationStub,
    "adapters": adapters_pb2_grpc.AdaptersStub,
    "health": health_pb2_grpc.HealthStub,
    "worker": worker_pb2_grpc.WorkerStub,
}
_HEALTH_NAMES = {health_pb2.HealthCheckResponse.SERVING: "SERVING",
                 health_pb2.HealthCheckResponse.NOT_SERVING: "NOT_SERVING",
                 health_pb2.HealthCheckResponse.SERVICE_UNKNOWN: "SERVICE_UNKNOWN"}


def _error(exc: grpc.RpcError) -> ServiceError:
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    trailer = exc.trailing_metadata() if callable(getattr(exc, "trailing_metadata", None)) \
        else None
    origin = next((str(v) for k, v in trailer or () if k == ORIGIN_KEY), None)
    return ServiceError(code, details or "", origin=origin)


class Call(Protocol[Req_contra, Out_co]):
    """A stub method: the request dataclass in, the response (or its awaitable, or an
    iterator of chunks) out."""

    def __call__(self, request: Req_contra, metadata: Metadata | None = None,
                 timeout: float | None = None) -> Out_co: ...


class _Stubs:
    """The generated stubs of one channel, made on first use; ``BLOCKING`` says which kind of
    channel (``grpc.Channel`` or ``grpc.aio.Channel``) it is."""

    BLOCKING = True

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel) -> None:
        self._channel = channel
        self._generated: dict[str, Any] = {}

    def _rpc(self, service: str, method: str) -> Any:
        if service not in self._generated:
            self._generated[service] = _GENERATED[service](self._channel)
        return getattr(self._generated[service], method)


class Blocking(_Stubs):
    """Stubs over a blocking ``grpc.Channel``: methods return their results."""


class NonBlocking(_Stubs):
    """Stubs over a ``grpc.aio`` channel: methods are coroutines / async iterators."""

    BLOCKING = False


class _Row(Generic[Req, Resp]):
    """One RPC of a table: the generated stub and method, the request's conversion to
    protobuf, the response's from it, and whether the call carries the caller's metadata."""

    def __init__(self, service: str, method: str, to_pb: Callable[[Req], Any],
                 from_pb: Callable[[Any], Resp], *, metadata: bool = True) -> None:
        self.service, self.method = service, method
        self.to_pb, self.from_pb = to_pb, from_pb
        self.metadata = metadata

    def _args(self, metadata: Metadata | None) -> Metadata | None:
        return metadata if self.metadata else None


class Unary(_Row[Req, Resp]):
    """A unary RPC row; on a ``Blocking`` stub its method returns the response dataclass, on a
    ``NonBlocking`` one an awaitable of it."""

    @overload
    def __get__(self, stubs: None, owner: Any = None) -> Unary[Req, Resp]: ...

    @overload
    def __get__(self, stubs: Blocking, owner: Any = None) -> Call[Req, Resp]: ...

    @overload
    def __get__(self, stubs: NonBlocking, owner: Any = None) -> Call[Req, Awaitable[Resp]]: ...

    def __get__(self, stubs: _Stubs | None, owner: Any = None) -> Any:
        if stubs is None:
            return self
        row = self

        def call(request: Req, metadata: Metadata | None = None,
                 timeout: float | None = None) -> Resp:
            try:
                reply = stubs._rpc(row.service, row.method)(
                    row.to_pb(request), metadata=row._args(metadata), timeout=timeout)
                return row.from_pb(reply)
            except grpc.RpcError as exc:
                raise _error(exc) from None

        async def acall(request: Req, metadata: Metadata | None = None,
                        timeout: float | None = None) -> Resp:
            try:
                reply = await stubs._rpc(row.service, row.method)(
                    row.to_pb(request), metadata=row._args(metadata), timeout=timeout)
                return row.from_pb(reply)
            except grpc.RpcError as exc:
                raise _error(exc) from None

        return call if stubs.BLOCKING else acall


class Stream(_Row[Req, Resp]):
    """A server-streaming RPC row; its method returns an iterator (``Blocking``) or an async
    iterator (``NonBlocking``) of the converted messages. The call starts at the first
    ``next``; closing the iterator (or cancelling its task) cancels it."""

    @overload
    def __get__(self, stubs: None, owner: Any = None) -> Stream[Req, Resp]: ...

    @overload
    def __get__(self, stubs: Blocking, owner: Any = None
                ) -> Call[Req, Generator[Resp, None, None]]: ...

    @overload
    def __get__(self, stubs: NonBlocking, owner: Any = None
                ) -> Call[Req, AsyncGenerator[Resp, None]]: ...

    def __get__(self, stubs: _Stubs | None, owner: Any = None) -> Any:
        if stubs is None:
            return self
        row = self

        def stream(request: Req, metadata: Metadata | None = None,
                   timeout: float | None = None) -> Generator[Resp, None, None]:
            call = stubs._rpc(row.service, row.method)(
                row.to_pb(request), metadata=row._args(metadata), timeout=timeout)
            try:
                for m in call:
                    yield row.from_pb(m)
            except grpc.RpcError as exc:
                raise _error(exc) from None
            finally:
                call.cancel()

        async def astream(request: Req, metadata: Metadata | None = None,
                          timeout: float | None = None) -> AsyncGenerator[Resp, None]:
            call = stubs._rpc(row.service, row.method)(
                row.to_pb(request), metadata=row._args(metadata), timeout=timeout)
            try:
                async for m in call:
                    yield row.from_pb(m)
            except grpc.RpcError as exc:
                raise _error(exc) from None
            finally:
                call.cancel()

        return stream if stubs.BLOCKING else astream


def _health_request(service: str) -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=service)


def _health_name(m: health_pb2.HealthCheckResponse) -> str:
    return _HEALTH_NAMES.get(m.status, "UNKNOWN")


class HealthCall(Protocol[Out_co]):
    """``health(service="", timeout=None)``: the status of a service ("" the server's)."""

    def __call__(self, service: str = "", timeout: float | None = None) -> Out_co: ...


class Health(Unary[str, str]):
    """The standard ``Health.Check`` row: the service name defaults to the server's ("") and
    the call carries no metadata."""

    def __init__(self) -> None:
        super().__init__("health", "Check", _health_request, _health_name, metadata=False)

    @overload  # type: ignore[override]
    def __get__(self, stubs: None, owner: Any = None) -> Health: ...

    @overload
    def __get__(self, stubs: Blocking, owner: Any = None) -> HealthCall[str]: ...

    @overload
    def __get__(self, stubs: NonBlocking, owner: Any = None) -> HealthCall[Awaitable[str]]: ...

    def __get__(self, stubs: _Stubs | None, owner: Any = None) -> Any:
        if stubs is None:
            return self
        call: Any = Unary.__get__(self, stubs, owner)  # type: ignore[call-overload]

        def check(service: str = "", timeout: float | None = None) -> Any:
            return call(service, None, timeout)

        return check


def _upload_request(parts: Iterable[UploadPart]) -> Iterator[adapters_pb2.UploadRequest]:
    return (upload_part_to_pb(p) for p in parts)


def _listed(m: adapters_pb2.ListAdaptersResponse) -> list[AdapterVersion]:
    return [adapter_from_pb(v) for v in m.adapters]


def _deleted(m: adapters_pb2.DeleteAdapterResponse) -> list[AdapterVersion]:
    return [adapter_from_pb(v) for v in m.deleted]


def _list_request(q: AdapterQuery) -> adapters_pb2.ListAdaptersRequest:
    return adapters_pb2.ListAdaptersRequest(name=q.ref, tenant=q.tenant)


def _get_request(q: AdapterQuery) -> adapters_pb2.GetAdapterRequest:
    return adapters_pb2.GetAdapterRequest(adapter=q.ref, tenant=q.tenant)


def _delete_request(q: AdapterQuery) -> adapters_pb2.DeleteAdapterRequest:
    return adapters_pb2.DeleteAdapterRequest(adapter=q.ref, tenant=q.tenant)


def _status_request(_: None) -> worker_pb2.StatusRequest:
    return worker_pb2.StatusRequest()


class _Public:
    """The table of the public services (``Generation``, ``Adapters``, ``Health``)."""

    generate = Unary("generation", "Generate", generate_request_to_pb, completion_from_pb)
    generate_stream = Stream("generation", "GenerateStream", generate_request_to_pb,
                             chunk_from_pb)
    upload = Unary("adapters", "Upload", _upload_request, adapter_from_pb)
    list_adapters = Unary("adapters", "List", _list_request, _listed)
    get_adapter = Unary("adapters", "Get", _get_request, adapter_from_pb)
    delete_adapter = Unary("adapters", "Delete", _delete_request, _deleted)
    # ``SERVING`` / ``NOT_SERVING`` / ``SERVICE_UNKNOWN`` (standard health checking)
    health = Health()


class ClientStub(_Public, Blocking):
    """The public services over a blocking channel."""


class AsyncClientStub(_Public, NonBlocking):
    """The public services over a ``grpc.aio`` channel."""


class WorkerStub(NonBlocking):
    """The internal ``Worker`` service over a ``grpc.aio`` channel (the gateway's side)."""

    generate = Stream("worker", "Generate", worker_request_to_pb, chunk_from_pb, metadata=False)
    status = Unary("worker", "Status", _status_request, worker_status_from_pb, metadata=False)
    tokenize = Unary("worker", "Tokenize", tokenize_request_to_pb, tokenize_result_from_pb,
                     metadata=False)
    prefetch = Unary("worker", "Prefetch", prefetch_request_to_pb, prefetch_response_from_pb,
                     metadata=False)
