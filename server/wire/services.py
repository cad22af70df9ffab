"""The servicers of the three loraplex services, standard health checking and reflection.

Each ``add_*_service`` serves one service from an implementation that speaks only dataclasses
(``GenerationImpl``, ``AdaptersImpl``, ``WorkerImpl``) and raises ``ServiceError`` for a
status; the messages are converted in ``messages.py``.

Every status a handler returns on purpose carries the trailer ``loraplex-origin`` (``request``:
the request's own error; ``server``: the server refuses any work now). A status without it did
not come from a loraplex handler (a refused or reset connection, a killed process): the
gateway takes only those, and the ``server`` ones, as a sign that a worker is gone.

Requests are parsed leniently: a message protobuf cannot parse (invalid UTF-8 in a string
field) becomes a ``Malformed`` value instead of an exception inside gRPC (which would answer
UNKNOWN and log a traceback per request); the servicer then answers INVALID_ARGUMENT naming
the field, after authentication, so an unauthenticated caller learns nothing of the schema.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, NamedTuple, Protocol

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loraplex.adapter_store.store import AdapterVersion
from loraplex.server.api import (
    ORIGIN_REQUEST,
    AdapterQuery,
    Completion,
    GenerateChunk,
    GenerateRequest,
    ServiceError,
    TokenizeRequest,
    TokenizeResult,
    UploadPart,
    WorkerRequest,
    WorkerStatus,
)
from loraplex.server.quote import cap_message
from loraplex.server.wire.messages import (
    ORIGIN_KEY,
    adapter_to_pb,
    chunk_to_pb,
    completion_to_pb,
    generate_request_from_pb,
    prefetch_request_from_pb,
    prefetch_response_to_pb,
    tokenize_request_from_pb,
    tokenize_result_to_pb,
    upload_part_from_pb,
    worker_request_from_pb,
    worker_status_to_pb,
)
from loraplex.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

logger = logging.getLogger(__name__)


class GenerationImpl(Protocol):
    def authenticate(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's tenant; raises ``ServiceError`` (UNAUTHENTICATED)."""

    def refused(self, tenant: str, error: ServiceError) -> None:
        """Count a request refused before it reached ``generate`` (bad key, bad message)."""

    async def generate(self, request: GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> Completion: ...

    def generate_stream(self, request: GenerateRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncGenerator[GenerateChunk, None]: ...


class WorkerImpl(Protocol):
    def generate(self, request: WorkerRequest, context: grpc.aio.ServicerContext
                 ) -> AsyncGenerator[GenerateChunk, None]: ...

    def status(self) -> WorkerStatus: ...

    def tokenize(self, request: TokenizeRequest) -> TokenizeResult: ...

    def prefetch(self, digests: tuple[str, ...]) -> int: ...


class AdaptersImpl(Protocol):
    def authenticate(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's tenant; raises ``ServiceError`` (UNAUTHENTICATED)."""

    async def upload(self, parts: AsyncIterator[UploadPart],
                     context: grpc.aio.ServicerContext) -> AdapterVersion: ...

    async def list_adapters(self, query: AdapterQuery, context: grpc.aio.ServicerContext
                            ) -> list[AdapterVersion]: ...

    async def get_adapter(self, query: AdapterQuery, context: grpc.aio.ServicerContext
                          ) -> AdapterVersion: ...

    async def delete_adapter(self, query: AdapterQuery, context: grpc.aio.ServicerContext
                             ) -> list[AdapterVersion]: ...


@asynccontextmanager
async def _status_on_error(context: grpc.aio.ServicerContext, method: str
                           ) -> AsyncIterator[None]:
    """End the call with the status a ``ServiceError`` names; anything else is a bug
    (``INTERNAL``, logged)."""
    try:
        yield
    except ServiceError as exc:
        await context.abort(exc.code, cap_message(exc.message),
                            trailing_metadata=((ORIGIN_KEY, exc.origin or ORIGIN_REQUEST),))
    except grpc.aio.AbortError:
        raise
    except Exception:
        logger.exception("%s failed", method)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}",
                            trailing_metadata=((ORIGIN_KEY, ORIGIN_REQUEST),))


class Malformed(NamedTuple):
    """A request message protobuf could not parse, in place of the message."""

    message_type: str
    field: str | None  # the dotted path of the string field that is not UTF-8, when found

    def error(self) -> ServiceError:
        where = f"{self.message_type}.{self.field}" if self.field else self.message_type
        what = "is not valid UTF-8" if self.field else "is not a valid protobuf message"
        return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {what}")


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]  # IndexError past the end: the caller's sign of a truncated message
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


def _bad_utf8_field(desc: Descriptor, data: bytes, depth: int = 0) -> str | None:
    """The dotted path of the first string field of ``data`` (a serialized ``desc``) whose
    bytes are not UTF-8, walking the wire format; None if there is none or the bytes are not
    protobuf at all."""
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                size, pos = _varint(data, pos)
                value, pos = data[pos:pos + size], pos + size
                field = desc.fields_by_number.get(number)
                if field is None:
                    continue
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        value.decode("utf-8")
                    except UnicodeDecodeError:
                        return field.name
                elif field.type == FieldDescriptor.TYPE_MESSAGE and depth < 16:
                    inner = _bad_utf8_field(field.message_type, value, depth + 1)
                    if inner is not None:
                        return f"{field.name}.{inner}"
            else:
                return None
    except IndexError:
        return None
    return None


def _lenient(message_class: Any) -> Callable[[bytes], Any]:
    """A request deserializer that returns ``Malformed`` instead of raising."""
    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError:
            desc = message_class.DESCRIPTOR
            return Malformed(desc.name, _bad_utf8_field(desc, data))
    return parse


_HANDLER_KINDS = {(False, False): grpc.unary_unary_rpc_method_handler,
                  (False, True): grpc.unary_stream_rpc_method_handler,
                  (True, False): grpc.stream_unary_rpc_method_handler,
                  (True, True): grpc.stream_stream_rpc_method_handler}


def _add_service(server: grpc.aio.Server, servicer: Any, service: ServiceDescriptor) -> str:
    """What the generated ``add_*Servicer_to_server`` does, with lenient request parsing."""
    pb_modules = (adapters_pb2, generation_pb2, worker_pb2)
    handlers = {}
    for method in service.methods:
        request_class = _message_class(method.input_type, pb_modules)
        response_class = _message_class(method.output_type, pb_modules)
        kind = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(getattr(servicer, method.name),
                                     request_deserializer=_lenient(request_class),
                                     response_serializer=response_class.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))
    return str(service.full_name)


def _message_class(desc: Descriptor, modules: tuple[Any, ...]) -> Any:
    for module in modules:
        if module.DESCRIPTOR is desc.file:
            return getattr(module, desc.name)
    raise LookupError(f"no generated class for {desc.full_name}")


def _convert(fn: Callable[[Any], Any], message: Any) -> Any:
    """``fn(message)``; ``ServiceError`` INVALID_ARGUMENT for a malformed or invalid one."""
    if isinstance(message, Malformed):
        raise message.error()
    try:
        return fn(message)
    except ValueError as exc:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


async def _write_stream(context: grpc.aio.ServicerContext,
                        chunks: AsyncGenerator[GenerateChunk, None]) -> None:
    # Written with context.write (not yielded) so that a cancelled call raises CancelledError
    # here and the implementation's generator is closed at once (its finally aborts the work).
    try:
        async for chunk in chunks:
            await context.write(chunk_to_pb(chunk))
    finally:
        await chunks.aclose()


class _GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, impl: GenerationImpl) -> None:
        self._impl = impl

    def _admit(self, request: Any, context: grpc.aio.ServicerContext) -> GenerateRequest:
        # The key first: a caller without one learns nothing about the request's schema.
        tenant = "unauthenticated"
        try:
            tenant = self._impl.authenticate(context)
            return _convert(generate_request_from_pb, request)  # type: ignore[no-any-return]
        except ServiceError as exc:
            self._impl.refused(tenant, exc)
            raise

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _status_on_error(context, "Generate"):
            req = self._admit(request, context)
            return completion_to_pb(await self._impl.generate(req, context))

    async def GenerateStream(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        async with _status_on_error(context, "GenerateStream"):
            req = self._admit(request, context)
            await _write_stream(context, self._impl.generate_stream(req, context))


class _WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, impl: WorkerImpl) -> None:
        self._impl = impl

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        async with _status_on_error(context, "Worker.Generate"):
            req = _convert(worker_request_from_pb, request)
            await _write_stream(context, self._impl.generate(req, context))

    async def Status(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _status_on_error(context, "Worker.Status"):
            return worker_status_to_pb(self._impl.status())

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _status_on_error(context, "Worker.Tokenize"):
            req = _convert(tokenize_request_from_pb, request)
            return tokenize_result_to_pb(self._impl.tokenize(req))

    async def Prefetch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _status_on_error(context, "Worker.Prefetch"):
            digests = _convert(prefetch_request_from_pb, request)
            return prefetch_response_to_pb(self._impl.prefetch(digests))


async def _upload_parts(messages: AsyncIterator[Any]) -> AsyncIterator[UploadPart]:
    async for m in messages:
        yield _convert(upload_part_from_pb, m)


class _AdaptersServicer(adapters_pb2_grpc.AdaptersServicer):
    def __init__(self, impl: AdaptersImpl) -> None:
        self._impl = impl

    async def Upload(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _status_on_error(context, "Adapters.Upload"):
            return adapter_to_pb(await self._impl.upload(_upload_parts(request_iterator),
                                                         context))

    def _checked(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            self._impl.authenticate(context)  # the key first, as for Generate
            raise request.error()
        return request

    async def List(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _status_on_error(context, "Adapters.List"):
            request = self._checked(request, context)
            found = await self._impl.list_adapters(AdapterQuery(request.name, request.tenant),
                                                   context)
            return adapters_pb2.ListAdaptersResponse(adapters=[adapter_to_pb(v) for v in found])

    async def Get(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _status_on_error(context, "Adapters.Get"):
            request = self._checked(request, context)
            return adapter_to_pb(await self._impl.get_adapter(
                AdapterQuery(request.adapter, request.tenant), context))

    async def Delete(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _status_on_error(context, "Adapters.Delete"):
            request = self._checked(request, context)
            deleted = await self._impl.delete_adapter(
                AdapterQuery(request.adapter, request.tenant), context)
            return adapters_pb2.DeleteAdapterResponse(deleted=[adapter_to_pb(v) for v in deleted])


def add_adapters_service(server: grpc.aio.Server, impl: AdaptersImpl) -> str:
    """Serve ``loraplex.v1.Adapters`` from ``impl``; returns the full service name."""
    return _add_service(server, _AdaptersServicer(impl),
                        adapters_pb2.DESCRIPTOR.services_by_name["Adapters"])


def add_generation_service(server: grpc.aio.Server, impl: GenerationImpl) -> str:
    """Serve ``loraplex.v1.Generation`` from ``impl``; returns the full service name."""
    return _add_service(server, _GenerationServicer(impl),
                        generation_pb2.DESCRIPTOR.services_by_name["Generation"])


def add_worker_service(server: grpc.aio.Server, impl: WorkerImpl) -> str:
    """Serve ``loraplex.v1.Worker`` from ``impl``; returns the full service name."""
    return _add_service(server, _WorkerServicer(impl),
                        worker_pb2.DESCRIPTOR.services_by_name["Worker"])


LIVENESS_SERVICE = "loraplex.liveness"


class HealthReporter:
    """The standard ``grpc.health.v1.Health`` service of one server. The empty service name
    reports the server's overall state; each named service follows it. ``loraplex.liveness``
    answers SERVING for as long as the server's event loop answers at all, draining or not,
    so a liveness probe never kills a pod that is busy or draining; only ``fail`` (a broken
    server) turns it NOT_SERVING."""

    def __init__(self, server: grpc.aio.Server, service_names: list[str]) -> None:
        self._servicer = health.aio.HealthServicer()
        self._names = ["", *service_names]
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        self.serving = True
        self._liveness_set = False

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        self.serving = serving
        if not self._liveness_set:
            await self._servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
            self._liveness_set = True
        for name in self._names:
            await self._servicer.set(name, status)

    async def shutdown(self) -> None:
        """NOT_SERVING for good (a draining server never comes back); liveness stays."""
        await self.set_serving(False)

    async def fail(self) -> None:
        """NOT_SERVING for good, liveness included: the server is broken (its engine thread
        died), so a liveness probe restarts it even if its process were to stay up."""
        await self.set_serving(False)
        await self._servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._liveness_set = True


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]
                              ) -> HealthReporter:
    """Standard health checking and server reflection, so that generic tools (grpcurl,
    grpc_health_probe, Kubernetes gRPC probes) work against every loraplex server."""
    reporter = HealthReporter(server, service_names)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection([*service_names, health_name, reflection.SERVICE_NAME],
                                        server)
    return reporter
