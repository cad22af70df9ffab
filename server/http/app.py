"""The OpenAI-compatible HTTP API as a Starlette app over the gateway's ``GenerationService``.

A request's way through it:

1. Read the body under the gRPC API's message bound (413 past it), decode and bound the JSON
   (``schema.parse_json``), validate it strictly into ``GenerateRequest``s (``schema``).
2. ``model`` names the base model (its served name) or an adapter (``name[@version]``).
3. Call ``GenerationService.generate_stream`` -- the same path as gRPC: authentication
   (``Authorization: Bearer``), bounds, adapter resolution, quota, routing, proxying -- with an
   ``HttpCall`` as its call context (headers and a deadline).
4. Answer JSON, or server-sent events (``sse-starlette``) ending with ``data: [DONE]``. A
   stream's status is decided by its first chunk: errors before it are HTTP errors in OpenAI's
   shape (``errors.py``); an error after it is a last ``{"error": ...}`` event.

A client that disconnects cancels its generation (the worker aborts it and frees its pages),
whether it was streaming or waiting for a whole response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import replace
from typing import Any, TypeVar

import grpc
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.server.api import (
    Completion,
    GenerateChunk,
    GenerateRequest,
    ServiceError,
    TokenizeRequest,
    TokenizeResult,
    Usage,
)
from loraplex.server.gateway_bounds import MAX_REQUEST_ID_CHARS
from loraplex.server.gateway_generation import GenerationService
from loraplex.server.http import responses as out
from loraplex.server.http.errors import (
    bad_request,
    error_response,
    service_error_body,
    service_error_response,
)
from loraplex.server.http.schema import (
    BadRequest,
    chat_request,
    chat_tools,
    completion_requests,
    detokenize_request,
    parse_json,
    tokenize_request,
)
from loraplex.server.http.tools import ToolCalls
from loraplex.server.worker import MAX_MESSAGE_BYTES

T = TypeVar("T")
logger = logging.getLogger(__name__)
SSE_PING_SECONDS = 15
# Events end with "\n\n", as OpenAI's and vLLM's servers end them (sse-starlette's default is
# "\r\n"): vLLM's benchmark client splits a stream on "\n\n" only, and two "\r\n" events that
# reached it in one read stuck in its buffer, the rest of the stream lost to it.
SSE_SEPARATOR = "\n"


class ClientGone(Exception):
    """The client disconnected before its response began."""


class HttpCall:
    """An HTTP request as the service's ``CallContext``: its headers, and the deadline the
    gateway gives every HTTP request (HTTP has none of its own)."""

    def __init__(self, headers: Iterable[tuple[bytes, bytes]], timeout_seconds: float) -> None:
        self._headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in headers]
        self._deadline = time.monotonic() + timeout_seconds

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._headers

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_MESSAGE_BYTES:
        raise BadRequest(f"the body is over the limit of {MAX_MESSAGE_BYTES} bytes", "body", 413)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_MESSAGE_BYTES:
            raise BadRequest(f"the body is over the limit of {MAX_MESSAGE_BYTES} bytes", "body",
                             413)
        parts.append(part)
    return b"".join(parts)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is already read, so the next message
    the server receives is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or ``ClientGone`` (``work`` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


async def merge(streams: list[AsyncGenerator[GenerateChunk, None]]
                ) -> AsyncGenerator[tuple[int, GenerateChunk], None]:
    """Each chunk of several streams with its stream's index, as they come; the first error
    ends them all. Closing this closes (cancels) every stream."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for chunk in only:
                yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, GenerateChunk | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[GenerateChunk, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    queue.put_nowait((i, chunk))
            queue.put_nowait((i, None))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class OpenAIApp:
    """The routes (see the module docstring).

    Args:
        service: the gateway's generation service (auth, bounds, routing: shared with gRPC).
        served_model_name: the base model's ``model`` name.
        timeout_seconds: each request's deadline.
        chat_default_max_tokens: ``max_tokens`` of a chat request that gives none.
        ready: whether the gateway can serve (a healthy worker, not draining): ``/health``.
    """

    def __init__(self, service: GenerationService, served_model_name: str,
                 timeout_seconds: float, chat_default_max_tokens: int,
                 ready: Callable[[], bool]) -> None:
        self.service = service
        self.model = served_model_name
        self.timeout_seconds = timeout_seconds
        self.chat_default_max_tokens = chat_default_max_tokens
        self.ready = ready
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ])

    # -- models and health -------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def _models(self, request: Request) -> list[dict[str, Any]]:
        identity = self.service.keys.authenticate(HttpCall(request.headers.raw, 1.0)
                                                  .invocation_metadata())
        versions = await asyncio.to_thread(self.service.store.list, identity.tenant)
        models = [{"id": self.model, "object": "model", "created": 0, "owned_by": "loraplex",
                   "root": self.model, "parent": None}]
        latest = {v.name: v for v in versions}  # listed by name then version: the last wins
        for v in versions:
            if latest[v.name] is v:
                models.append(self._model_card(v.name, v.created, identity.tenant))
            models.append(self._model_card(v.ref, v.created, identity.tenant))
        return models

    def _model_card(self, model_id: str, created: float, tenant: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": int(created), "owned_by": tenant,
                "root": model_id, "parent": self.model}

    async def list_models(self, request: Request) -> Response:
        try:
            models = await self._models(request)
        except ServiceError as exc:
            return service_error_response(exc)
        return JSONResponse({"object": "list", "data": models})

    async def get_model(self, request: Request) -> Response:
        name = request.path_params["model"]
        try:
            models = await self._models(request)
        except ServiceError as exc:
            return service_error_response(exc)
        for card in models:
            if card["id"] == name:
                return JSONResponse(card)
        return self._not_found(name)

    def _not_found(self, model: str) -> Response:
        # The same body whether the adapter is missing or another tenant's.
        return error_response(404, f"The model {model!r} does not exist.",
                              "invalid_request_error", "model", "model_not_found")

    # -- generation ----------------------------------------------------------------------------
    def _request_id(self, request: Request) -> str:
        given = request.headers.get("x-request-id", "")
        return given[:MAX_REQUEST_ID_CHARS] if given.isprintable() else ""

    def _adapter(self, model: str) -> str:
        if not model:
            raise BadRequest("model: must name the base model or an adapter", "model")
        return "" if model == self.model else model

    def _error(self, exc: ServiceError, model: str) -> Response:
        if exc.code == grpc.StatusCode.NOT_FOUND:
            return self._not_found(model)
        if exc.message.startswith("adapter: "):  # a malformed name: "model" on this wire
            return bad_request("model: " + exc.message[len("adapter: "):], "model")
        return service_error_response(exc)

    async def completions(self, request: Request) -> Response:
        try:
            doc = parse_json(await _read_body(request))
            request_id = self._request_id(request) or uuid.uuid4().hex
            body, gens = completion_requests(doc, request_id)
            adapter = self._adapter(body.model)
        except BadRequest as exc:
            return error_response(exc.status, str(exc), "invalid_request_error", exc.param)
        gens = [replace(g, adapter=adapter) for g in gens]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await self._respond(request, gens, body.model, body.stream, include_usage,
                                   chat=False, response_id=f"cmpl-{request_id}")

    async def chat_completions(self, request: Request) -> Response:
        try:
            doc = parse_json(await _read_body(request))
            request_id = self._request_id(request) or uuid.uuid4().hex
            body, gen = chat_request(doc, self.chat_default_max_tokens, request_id)
            tools = chat_tools(body)
            adapter = self._adapter(body.model)
        except BadRequest as exc:
            return error_response(exc.status, str(exc), "invalid_request_error", exc.param)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await self._respond(request, [replace(gen, adapter=adapter)], body.model,
                                   body.stream, include_usage, chat=True,
                                   response_id=f"chatcmpl-{request_id}", tools=tools)

    # -- vLLM's tokenizer endpoints -------------------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``: ``{"count", "max_model_len", "tokens", "token_strs"}``."""
        return await self._tokenizer_call(request, tokenize_request, lambda r: {
            "count": len(r.token_ids), "max_model_len": r.max_model_len,
            "tokens": list(r.token_ids), "token_strs": list(r.token_strs) or None})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: ``{"prompt": <the text of the tokens>}``."""
        return await self._tokenizer_call(request, detokenize_request,
                                          lambda r: {"prompt": r.text})

    async def _tokenizer_call(self, request: Request,
                              parse: Callable[[Any], tuple[str | None, TokenizeRequest]],
                              shape: Callable[[TokenizeResult], dict[str, Any]]) -> Response:
        try:
            model, req = parse(parse_json(await _read_body(request)))
            adapter = self._adapter(model) if model is not None else ""
        except BadRequest as exc:
            return error_response(exc.status, str(exc), "invalid_request_error", exc.param)
        call = HttpCall(request.headers.raw, self.timeout_seconds)
        try:
            if adapter:  # one of the caller's adapters (its tokenizer is the base model's)
                await self.service.resolve(self.service.authenticate(call), adapter)
            result = await until_disconnect(request, self.service.tokenize(req, call))
        except ServiceError as exc:
            if isinstance(req.prompt, tuple) and exc.message.startswith("token_ids"):
                exc = ServiceError(exc.code, "tokens" + exc.message[len("token_ids"):])
            return self._error(exc, model or self.model)
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(shape(result))

    async def _respond(self, request: Request, gens: list[GenerateRequest], model: str,
                       stream: bool, include_usage: bool, chat: bool, response_id: str,
                       tools: ToolCalls | None = None) -> Response:
        call = HttpCall(request.headers.raw, self.timeout_seconds)
        chunks = merge([self.service.generate_stream(g, call) for g in gens])
        created = int(time.time())
        # n choices per prompt (parallel sampling): choice i * n + index, as OpenAI numbers
        # them; every prompt of one request has the same n.
        shape = _Shape(response_id, created, model, chat, tools, n=gens[0].params.n)
        try:
            if not stream:  # _gather closes the chunks
                results = await until_disconnect(request, _gather(chunks, len(gens) * shape.n,
                                                                  shape.n))
                return JSONResponse(shape.whole(results))
            first = await until_disconnect(request, anext(chunks))
        except ServiceError as exc:
            await chunks.aclose()
            return self._error(exc, model)
        except (ClientGone, StopAsyncIteration):
            await chunks.aclose()
            return Response(status_code=499)  # nobody is left to read it
        except Exception:
            await chunks.aclose()
            logger.exception("%s: failed", response_id)
            return error_response(500, "internal error (logged by the gateway)", "server_error")
        return EventSourceResponse(self._events(first, chunks, shape, include_usage),
                                   ping=SSE_PING_SECONDS, sep=SSE_SEPARATOR)

    async def _events(self, first: tuple[int, GenerateChunk],
                      chunks: AsyncGenerator[tuple[int, GenerateChunk], None], shape: _Shape,
                      include_usage: bool) -> AsyncIterator[dict[str, str]]:
        usages: list[Usage] = []
        calls_text: dict[int, str] = {}  # by choice: with n > 1 the sequences interleave

        def event(obj: dict[str, Any]) -> dict[str, str]:
            if include_usage and "usage" not in obj:
                obj["usage"] = None
            return {"data": json.dumps(obj)}

        async with contextlib.aclosing(chunks):
            if shape.chat:
                for index in range(shape.n):
                    yield event(shape.chunk(index, {"role": "assistant", "content": ""}, None,
                                            None))
            try:
                pending: tuple[int, GenerateChunk] | None = first
                while pending is not None:
                    i, chunk = pending
                    if chunk.usage is not None:
                        usages.append(chunk.usage)
                    choice = i * shape.n + chunk.index
                    if shape.tools is not None:
                        # A tool call is sent whole, once its JSON is complete.
                        calls_text[choice] = calls_text.get(choice, "") + chunk.text
                        if chunk.finished:
                            for obj in shape.tool_call_deltas(shape.tools, calls_text[choice],
                                                              chunk, choice):
                                yield event(obj)
                    # One event per step that made tokens, text or not (as vLLM does): a
                    # token whose bytes end mid-character has no text yet, but clients still
                    # see progress at the pace of the engine (and time it per token).
                    elif chunk.token_ids or chunk.text or chunk.logprobs or chunk.finished:
                        yield event(shape.delta(choice, chunk))
                    pending = await anext(chunks, None)
            except ServiceError as exc:
                yield {"data": json.dumps(service_error_body(exc))}
                return
        if include_usage:
            yield {"data": json.dumps(shape.envelope([], out.total_usage(usages)))}
        yield {"data": "[DONE]"}


async def _gather(chunks: AsyncGenerator[tuple[int, GenerateChunk], None], num: int,
                  n: int = 1) -> list[Completion]:
    """The ``num`` choices: stream ``i``'s sequence ``index`` is choice ``i * n + index`` (a
    stream's usage, on its last chunk, lands on one of its choices: summed once)."""
    results = [Completion(request_id="") for _ in range(num)]
    async with contextlib.aclosing(chunks):
        async for i, chunk in chunks:
            results[i * n + chunk.index].add(chunk)
    return results


class _Shape:
    """Completions or chat objects of one response."""

    def __init__(self, response_id: str, created: int, model: str, chat: bool,
                 tools: ToolCalls | None = None, n: int = 1) -> None:
        self.n = n
        self.response_id = response_id
        self.created = created
        self.model = model
        self.chat = chat
        self.tools = tools

    def tool_call_deltas(self, tools: ToolCalls, text: str, last: GenerateChunk,
                         choice: int = 0) -> list[dict[str, Any]]:
        """A choice's end for a tool call: the call in one delta and ``tool_calls``, or,
        cut short by ``max_tokens``, the partial text and ``length``."""
        if last.finish_reason != "stop":
            return [self.chunk(choice, {"content": text}, None, last.finish_reason)]
        calls = [{"index": i, **c} for i, c in enumerate(tools.parse(text))]
        return [self.chunk(choice, {"tool_calls": calls}, None, None),
                self.chunk(choice, {}, None, "tool_calls")]

    def envelope(self, choices: list[dict[str, Any]], usage: Usage | None = None
                 ) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return out.envelope(kind, self.response_id, self.created, self.model, choices, usage)

    def chunk(self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None,
              finish_reason: str | None) -> dict[str, Any]:
        return self.envelope([{"index": index, "delta": delta, "logprobs": logprobs,
                               "finish_reason": finish_reason}])

    def delta(self, index: int, c: GenerateChunk) -> dict[str, Any]:
        if self.chat:
            return self.chunk(index, {"content": c.text} if c.text else {},
                              out.chat_logprobs(c.logprobs), c.finish_reason)
        return self.envelope([{"index": index, "text": c.text,
                               "logprobs": out.completion_logprobs(c.logprobs),
                               "finish_reason": c.finish_reason}])

    def whole(self, results: list[Completion]) -> dict[str, Any]:
        usage = out.total_usage([r.usage for r in results])
        if self.chat:
            choices = []
            for index, r in enumerate(results):
                message: dict[str, Any] = {"role": "assistant", "content": r.text,
                                           "refusal": None}
                finish_reason = r.finish_reason
                if self.tools is not None and finish_reason == "stop":
                    message.update(content=None, tool_calls=self.tools.parse(r.text))
                    finish_reason = "tool_calls"
                choices.append({"index": index, "message": message,
                                "logprobs": out.chat_logprobs(r.logprobs),
                                "finish_reason": finish_reason})
            return out.envelope("chat.completion", self.response_id, self.created,
                                self.model, choices, usage)
        choices = [{"index": i, "text": r.text, "logprobs": out.completion_logprobs(r.logprobs),
                    "finish_reason": r.finish_reason} for i, r in enumerate(results)]
        return out.envelope("text_completion", self.response_id, self.created, self.model,
                            choices, usage)
