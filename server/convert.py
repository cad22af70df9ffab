"""Protobuf <-> dataclasses: the only module that touches the generated ``*_pb2`` code.

Three kinds of things live here, all at the wire's edge (design.md §3):

* message conversions (``*_from_pb`` / ``*_to_pb``); a malformed message raises
  ``ValueError`` naming the field;
* servicer glue (``add_*_service``): the generated servicer classes, each forwarding to an
  implementation that speaks only dataclasses and raises ``ServiceError`` for a status;
* client stubs (``*Stub``): the generated stubs, taking and returning dataclasses and raising
  ``ServiceError`` for a non-OK status.

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
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import fields
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
    ChatMessage,
    ChatMessages,
    Completion,
    FileHeader,
    GenerateChunk,
    GenerateRequest,
    Prompt,
    ServiceError,
    Timing,
    UploadMetadata,
    UploadPart,
    Usage,
    WorkerRequest,
    WorkerStatus,
)
from loraplex.server.params import SamplingParams, StructuredOutput, TokenLogprob
from loraplex.server.quote import cap_message
from loraplex.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

logger = logging.getLogger(__name__)

_FINISH_TO_PB = {"stop": generation_pb2.FINISH_REASON_STOP,
                 "length": generation_pb2.FINISH_REASON_LENGTH}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}
_DEFAULT_PARAMS = SamplingParams()
ORIGIN_KEY = "loraplex-origin"


# -- messages -----------------------------------------------------------------------------------
def sampling_params_from_pb(m: generation_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the engine's defaults. Raises ``ValueError``."""
    return SamplingParams(
        max_tokens=m.max_tokens if m.HasField("max_tokens") else _DEFAULT_PARAMS.max_tokens,
        temperature=m.temperature, top_k=m.top_k,
        top_p=m.top_p if m.HasField("top_p") else _DEFAULT_PARAMS.top_p,
        seed=m.seed if m.HasField("seed") else None,
        stop_token_ids=tuple(m.stop_token_ids), stop=tuple(m.stop), ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        min_tokens=m.min_tokens, presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        repetition_penalty=(m.repetition_penalty if m.HasField("repetition_penalty")
                            else _DEFAULT_PARAMS.repetition_penalty),
        logit_bias=tuple(sorted(m.logit_bias.items())), min_p=m.min_p,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        n=m.n if m.HasField("n") else _DEFAULT_PARAMS.n,
        structured=structured_from_pb(m.structured) if m.HasField("structured") else None)


def structured_from_pb(m: generation_pb2.StructuredOutput) -> StructuredOutput:
    """Raises ``ValueError`` for an empty constraint or one over the bounds."""
    which = m.WhichOneof("constraint")
    if which is None:
        raise ValueError("structured: set one of json_schema, json_object, regex, choice or "
                         "grammar")
    if which == "json_object":
        if not m.json_object:
            raise ValueError("structured.json_object: must be true when set")
        return StructuredOutput("json_object")
    if which == "choice":
        return StructuredOutput("choice", choices=tuple(m.choice.choices))
    return StructuredOutput(which, getattr(m, which))


def structured_to_pb(s: StructuredOutput) -> generation_pb2.StructuredOutput:
    if s.kind == "json_object":
        return generation_pb2.StructuredOutput(json_object=True)
    if s.kind == "choice":
        return generation_pb2.StructuredOutput(
            choice=generation_pb2.Choices(choices=list(s.choices)))
    return generation_pb2.StructuredOutput(**{s.kind: s.value})


def sampling_params_to_pb(p: SamplingParams) -> generation_pb2.SamplingParams:
    m = generation_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        stop_token_ids=list(p.stop_token_ids), stop=list(p.stop), ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, logit_bias=dict(p.logit_bias), min_p=p.min_p)
    if p.repetition_penalty != _DEFAULT_PARAMS.repetition_penalty:
        m.repetition_penalty = p.repetition_penalty
    if p.seed is not None:
        m.seed = p.seed
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        m.prompt_logprobs = p.prompt_logprobs
    if p.n != _DEFAULT_PARAMS.n:
        m.n = p.n
    if p.structured is not None:
        m.structured.CopyFrom(structured_to_pb(p.structured))
    return m


def _prompt_from_pb(m: Any) -> Prompt:
    which = m.WhichOneof("prompt")
    if which == "text":
        return str(m.text)
    if which == "token_ids":
        return tuple(m.token_ids.ids)
    if which == "messages":
        return ChatMessages(tuple(ChatMessage(c.role, c.content) for c in m.messages.messages))
    raise ValueError("prompt: set one of text, token_ids or messages")


def _set_prompt(m: Any, prompt: Prompt | list[int]) -> None:
    if isinstance(prompt, str):
        m.text = prompt
    elif isinstance(prompt, ChatMessages):
        # CopyFrom, not extend: an empty conversation must still set the oneof member.
        m.messages.CopyFrom(generation_pb2.ChatMessages(messages=[
            generation_pb2.ChatMessage(role=c.role, content=c.content)
            for c in prompt.messages]))
    else:
        m.token_ids.ids.extend(prompt)


def generate_request_from_pb(m: generation_pb2.GenerateRequest) -> GenerateRequest:
    return GenerateRequest(prompt=_prompt_from_pb(m), params=sampling_params_from_pb(m.params),
                           adapter=m.adapter, request_id=m.request_id)


def generate_request_to_pb(r: GenerateRequest) -> generation_pb2.GenerateRequest:
    m = generation_pb2.GenerateRequest(adapter=r.adapter, request_id=r.request_id,
                                       params=sampling_params_to_pb(r.params))
    _set_prompt(m, r.prompt)
    return m


def worker_request_from_pb(m: worker_pb2.WorkerGenerateRequest) -> WorkerRequest:
    return WorkerRequest(request_id=m.request_id, tenant=m.tenant, prompt=_prompt_from_pb(m),
                         params=sampling_params_from_pb(m.params),
                         adapter_digest=m.adapter_digest or None,
                         adapter_name=m.adapter_name)


def worker_request_to_pb(r: WorkerRequest) -> worker_pb2.WorkerGenerateRequest:
    m = worker_pb2.WorkerGenerateRequest(request_id=r.request_id, tenant=r.tenant,
                                         adapter_digest=r.adapter_digest or "",
                                         adapter_name=r.adapter_name,
                                         params=sampling_params_to_pb(r.params))
    _set_prompt(m, r.prompt)
    return m


def _logprobs_to_pb(lps: list[TokenLogprob]) -> list[generation_pb2.TokenLogprob]:
    return [generation_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[generation_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
        for lp in lps]


def _logprobs_from_pb(ms: Any) -> list[TokenLogprob]:
    return [TokenLogprob(m.token_id, m.logprob, tuple((t.token_id, t.logprob) for t in m.top))
            for m in ms]


def _finish_from_pb(value: int) -> str | None:
    return _FINISH_FROM_PB.get(value)


def chunk_to_pb(c: GenerateChunk) -> generation_pb2.GenerateChunk:
    m = generation_pb2.GenerateChunk(request_id=c.request_id, token_ids=c.token_ids, text=c.text,
                                     logprobs=_logprobs_to_pb(c.logprobs),
                                     prompt_logprobs=_logprobs_to_pb(c.prompt_logprobs),
                                     index=c.index)
    if c.finish_reason is not None:
        m.finish_reason = _FINISH_TO_PB[c.finish_reason]
    if c.usage is not None:
        m.usage.CopyFrom(_usage_to_pb(c.usage))
    if c.timing is not None:
        m.timing.CopyFrom(_timing_to_pb(c.timing))
    return m


def chunk_from_pb(m: generation_pb2.GenerateChunk) -> GenerateChunk:
    return GenerateChunk(
        request_id=m.request_id, token_ids=list(m.token_ids), text=m.text,
        logprobs=_logprobs_from_pb(m.logprobs), finish_reason=_finish_from_pb(m.finish_reason),
        prompt_logprobs=_logprobs_from_pb(m.prompt_logprobs), index=m.index,
        usage=_usage_from_pb(m.usage) if m.HasField("usage") else None,
        timing=_timing_from_pb(m.timing) if m.HasField("timing") else None)


def completion_to_pb(c: Completion) -> generation_pb2.GenerateResponse:
    m = generation_pb2.GenerateResponse(
        request_id=c.request_id, token_ids=c.token_ids, text=c.text,
        logprobs=_logprobs_to_pb(c.logprobs), usage=_usage_to_pb(c.usage),
        timing=_timing_to_pb(c.timing), prompt_logprobs=_logprobs_to_pb(c.prompt_logprobs))
    if c.finish_reason is not None:
        m.finish_reason = _FINISH_TO_PB[c.finish_reason]
    return m


def completion_from_pb(m: generation_pb2.GenerateResponse) -> Completion:
    return Completion(request_id=m.request_id, token_ids=list(m.token_ids), text=m.text,
                      logprobs=_logprobs_from_pb(m.logprobs),
                      prompt_logprobs=_logprobs_from_pb(m.prompt_logprobs),
                      finish_reason=_finish_from_pb(m.finish_reason),
                      usage=_usage_from_pb(m.usage), timing=_timing_from_pb(m.timing))


def _copy_to_pb(pb_class: Any, obj: Any) -> Any:
    """A message from a dataclass whose fields the message has by the same names."""
    return pb_class(**{f.name: list(v) if isinstance(v := getattr(obj, f.name), tuple) else v
                       for f in fields(obj)})


def _copy_from_pb(cls: Any, m: Any) -> Any:
    """A dataclass from a message with the same field names (repeated fields as tuples)."""
    return cls(**{f.name: v if isinstance(v := getattr(m, f.name), (str, int, float, bool))
                  else tuple(v) for f in fields(cls)})


def _usage_to_pb(u: Usage) -> generation_pb2.Usage:
    return _copy_to_pb(generation_pb2.Usage, u)


def _usage_from_pb(m: generation_pb2.Usage) -> Usage:
    return _copy_from_pb(Usage, m)


def _timing_to_pb(t: Timing) -> generation_pb2.Timing:
    return _copy_to_pb(generation_pb2.Timing, t)


def _timing_from_pb(m: generation_pb2.Timing) -> Timing:
    return _copy_from_pb(Timing, m)


def worker_status_to_pb(s: WorkerStatus) -> worker_pb2.WorkerStatus:
    return _copy_to_pb(worker_pb2.WorkerStatus, s)


def worker_status_from_pb(m: worker_pb2.WorkerStatus) -> WorkerStatus:
    return _copy_from_pb(WorkerStatus, m)


def adapter_to_pb(v: AdapterVersion) -> adapters_pb2.Adapter:
    return _copy_to_pb(adapters_pb2.Adapter, v)


def adapter_from_pb(m: adapters_pb2.Adapter) -> AdapterVersion:
    return _copy_from_pb(AdapterVersion, m)


def upload_part_from_pb(m: adapters_pb2.UploadRequest) -> UploadPart:
    which = m.WhichOneof("part")
    if which == "metadata":
        return UploadMetadata(m.metadata.name, m.metadata.tenant, m.metadata.uploader)
    if which == "file":
        return FileHeader(m.file.name, m.file.size, m.file.sha256)
    if which == "chunk":
        return bytes(m.chunk)
    raise ValueError("upload: each message must set metadata, file or chunk")


def upload_part_to_pb(part: UploadPart) -> adapters_pb2.UploadRequest:
    if isinstance(part, UploadMetadata):
        return adapters_pb2.UploadRequest(metadata=adapters_pb2.UploadMetadata(
            name=part.name, tenant=part.tenant, uploader=part.uploader))
    if isinstance(part, FileHeader):
        return adapters_pb2.UploadRequest(file=adapters_pb2.FileHeader(
            name=part.name, size=part.size, sha256=part.sha256))
    return adapters_pb2.UploadRequest(chunk=bytes(part))


# -- servicer glue ------------------------------------------------------------------------------
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


# -- client stubs -------------------------------------------------------------------------------
Metadata = list[tuple[str, str]]
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


def _call(rpc: Any, request: Any, parse: Callable[[Any], Any], metadata: Metadata | None,
          timeout: float | None) -> Any:
    try:
        return parse(rpc(request, metadata=metadata, timeout=timeout))
    except grpc.RpcError as exc:
        raise _error(exc) from None


async def _acall(rpc: Any, request: Any, parse: Callable[[Any], Any],
                 metadata: Metadata | None, timeout: float | None) -> Any:
    try:
        return parse(await rpc(request, metadata=metadata, timeout=timeout))
    except grpc.RpcError as exc:
        raise _error(exc) from None


def _listed(m: adapters_pb2.ListAdaptersResponse) -> list[AdapterVersion]:
    return [adapter_from_pb(v) for v in m.adapters]


def _deleted(m: adapters_pb2.DeleteAdapterResponse) -> list[AdapterVersion]:
    return [adapter_from_pb(v) for v in m.deleted]


def _health_request(service: str) -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=service)


def _health_name(m: health_pb2.HealthCheckResponse) -> str:
    return _HEALTH_NAMES.get(m.status, "UNKNOWN")


def _list_request(q: AdapterQuery) -> adapters_pb2.ListAdaptersRequest:
    return adapters_pb2.ListAdaptersRequest(name=q.ref, tenant=q.tenant)


def _get_request(q: AdapterQuery) -> adapters_pb2.GetAdapterRequest:
    return adapters_pb2.GetAdapterRequest(adapter=q.ref, tenant=q.tenant)


def _delete_request(q: AdapterQuery) -> adapters_pb2.DeleteAdapterRequest:
    return adapters_pb2.DeleteAdapterRequest(adapter=q.ref, tenant=q.tenant)


class ClientStub:
    """The public services (``Generation``, ``Adapters``, ``Health``) over a blocking
    channel. Every call raises ``ServiceError`` for a non-OK status."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._gen = generation_pb2_grpc.GenerationStub(channel)
        self._adapters = adapters_pb2_grpc.AdaptersStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)

    def generate(self, request: GenerateRequest, metadata: Metadata | None = None,
                 timeout: float | None = None) -> Completion:
        return _call(self._gen.Generate, generate_request_to_pb(request), completion_from_pb,
                     metadata, timeout)

    def generate_stream(self, request: GenerateRequest, metadata: Metadata | None = None,
                        timeout: float | None = None) -> Iterator[GenerateChunk]:
        """Chunks as they come; closing the iterator cancels the call."""
        call = self._gen.GenerateStream(generate_request_to_pb(request), metadata=metadata,
                                        timeout=timeout)
        try:
            for m in call:
                yield chunk_from_pb(m)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()

    def upload(self, parts: Iterable[UploadPart], metadata: Metadata | None = None,
               timeout: float | None = None) -> AdapterVersion:
        return _call(self._adapters.Upload, (upload_part_to_pb(p) for p in parts),
                     adapter_from_pb, metadata, timeout)

    def list_adapters(self, query: AdapterQuery, metadata: Metadata | None = None,
                      timeout: float | None = None) -> list[AdapterVersion]:
        return _call(self._adapters.List, _list_request(query), _listed, metadata, timeout)

    def get_adapter(self, query: AdapterQuery, metadata: Metadata | None = None,
                    timeout: float | None = None) -> AdapterVersion:
        return _call(self._adapters.Get, _get_request(query), adapter_from_pb, metadata,
                     timeout)

    def delete_adapter(self, query: AdapterQuery, metadata: Metadata | None = None,
                       timeout: float | None = None) -> list[AdapterVersion]:
        return _call(self._adapters.Delete, _delete_request(query), _deleted, metadata,
                     timeout)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """``SERVING`` / ``NOT_SERVING`` / ``SERVICE_UNKNOWN`` (standard health checking)."""
        return _call(self._health.Check, _health_request(service), _health_name, None, timeout)


class AsyncClientStub:
    """``ClientStub`` over a ``grpc.aio`` channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._gen = generation_pb2_grpc.GenerationStub(channel)
        self._adapters = adapters_pb2_grpc.AdaptersStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)

    async def generate(self, request: GenerateRequest, metadata: Metadata | None = None,
                       timeout: float | None = None) -> Completion:
        return await _acall(self._gen.Generate, generate_request_to_pb(request),
                            completion_from_pb, metadata, timeout)

    async def generate_stream(self, request: GenerateRequest, metadata: Metadata | None = None,
                              timeout: float | None = None) -> AsyncIterator[GenerateChunk]:
        call = self._gen.GenerateStream(generate_request_to_pb(request), metadata=metadata,
                                        timeout=timeout)
        try:
            async for m in call:
                yield chunk_from_pb(m)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()

    async def upload(self, parts: Iterable[UploadPart], metadata: Metadata | None = None,
                     timeout: float | None = None) -> AdapterVersion:
        return await _acall(self._adapters.Upload, (upload_part_to_pb(p) for p in parts),
                            adapter_from_pb, metadata, timeout)

    async def list_adapters(self, query: AdapterQuery, metadata: Metadata | None = None,
                            timeout: float | None = None) -> list[AdapterVersion]:
        return await _acall(self._adapters.List, _list_request(query), _listed, metadata,
                            timeout)

    async def get_adapter(self, query: AdapterQuery, metadata: Metadata | None = None,
                          timeout: float | None = None) -> AdapterVersion:
        return await _acall(self._adapters.Get, _get_request(query), adapter_from_pb,
                            metadata, timeout)

    async def delete_adapter(self, query: AdapterQuery, metadata: Metadata | None = None,
                             timeout: float | None = None) -> list[AdapterVersion]:
        return await _acall(self._adapters.Delete, _delete_request(query), _deleted,
                            metadata, timeout)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        return await _acall(self._health.Check, _health_request(service), _health_name, None,
                            timeout)


class WorkerStub:
    """The internal ``Worker`` service over a ``grpc.aio`` channel (the gateway's side)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = worker_pb2_grpc.WorkerStub(channel)

    async def generate(self, request: WorkerRequest, timeout: float | None
                       ) -> AsyncGenerator[GenerateChunk, None]:
        """Stream a request's chunks; cancelled (on the worker too) when the caller stops
        iterating. Raises ``ServiceError`` with the worker's status."""
        call = self._stub.Generate(worker_request_to_pb(request), timeout=timeout)
        try:
            async for m in call:
                yield chunk_from_pb(m)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()

    async def status(self, timeout: float) -> WorkerStatus:
        return await _acall(self._stub.Status, worker_pb2.StatusRequest(),
                            worker_status_from_pb, None, timeout)
