"""The OpenAI-HTTP backend of the load generator: a trace against any OpenAI-compatible server
(loraplex's HTTP API, ``vllm serve``, SGLang, ...), through the official ``openai`` client.

Each request is a streaming ``POST /v1/completions`` (``model`` = the trace's adapter, or
``base_model`` for the base; the prompt's token ids as ``prompt``; ``max_tokens`` = the output
length with ``ignore_eos``, which vLLM and loraplex take as an extra field;
``stream_options.include_usage``). The client parses the server-sent events; each chunk that
carries text is stamped on arrival as one token (servers stream a token per chunk). The
final usage chunk gives the true completion-token count: tokens no chunk carried (several in
one chunk, or tokens with no text) are stamped at the stream's end, so the count is exact and
the inter-token gaps are, if anything, conservative.

Errors become ``ServiceError`` with the gRPC code of the HTTP status (429 ->
``RESOURCE_EXHAUSTED``, ...), so a run's records read alike over both wires.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import openai

from loraplex.loadtest.records import RunLog
from loraplex.loadtest.runner import RunConfig, StreamFn, run_stream
from loraplex.loadtest.trace import Trace, TraceRequest
from loraplex.server import env
from loraplex.server.api import GenerateChunk, ServiceError, Usage

# The gRPC code a run records for each HTTP status (the HTTP API's own mapping, reversed).
_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
          408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.INVALID_ARGUMENT,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
          503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


def _service_error(exc: openai.OpenAIError) -> ServiceError:
    if isinstance(exc, openai.APIStatusError):
        code = _CODES.get(exc.status_code, grpc.StatusCode.INTERNAL)
        return ServiceError(code, f"HTTP {exc.status_code}: {exc.message}")
    if isinstance(exc, openai.APITimeoutError):
        return ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
    return ServiceError(grpc.StatusCode.UNAVAILABLE, f"{type(exc).__name__}: {exc}")


def _key(key: str | None) -> str:
    # As the gRPC runner: the tenant's key, else $LORAPLEX_API_KEY; a keyless server ignores it
    return key or env.get("API_KEY") or "none"


def openai_stream(clients: dict[str, openai.AsyncOpenAI], default: openai.AsyncOpenAI,
                  base_model: str) -> StreamFn:
    """A ``StreamFn`` over the OpenAI API: each tenant's requests through its own client (its
    API key), others through ``default``; the base model is called ``base_model``."""

    async def stream(req: TraceRequest, timeout: float | None) -> AsyncIterator[GenerateChunk]:
        client = clients.get(req.tenant, default)
        prompt: str | list[int] = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
        seen = 0
        try:
            events = await client.completions.create(
                model=req.adapter or base_model, prompt=prompt, max_tokens=req.output_len,
                temperature=0.0, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}, timeout=timeout)
            async with events:
                async for event in events:
                    choice = event.choices[0] if event.choices else None
                    # A last chunk with no text only closes the stream: no token in it.
                    if choice is not None and (choice.text or choice.finish_reason is None):
                        seen += 1
                        yield GenerateChunk(req.request_id, [0], choice.text)
                    if event.usage is not None:
                        u = event.usage
                        details = u.prompt_tokens_details
                        cached = (details.cached_tokens or 0) if details is not None else 0
                        yield GenerateChunk(
                            req.request_id, [0] * max(u.completion_tokens - seen, 0), "",
                            finish_reason="length",
                            usage=Usage(u.prompt_tokens, u.completion_tokens, cached))
        except openai.OpenAIError as exc:
            raise _service_error(exc) from None

    return stream


async def run_openai(trace: Trace, base_url: str, config: RunConfig, base_model: str,
                     system: str = "openai") -> RunLog:
    """Run ``trace`` against the OpenAI-compatible server at ``base_url`` (``.../v1``)."""

    def client(key: str | None) -> openai.AsyncOpenAI:
        # No retries: a refused request is a result (the openai client retries 429 and 5xx).
        return openai.AsyncOpenAI(base_url=base_url, api_key=_key(key), max_retries=0)

    default = client(config.default_api_key)
    clients = {tenant: client(key) for tenant, key in config.api_keys}
    try:
        log = await run_stream(trace, openai_stream(clients, default, base_model), config)
    finally:
        for c in [default, *clients.values()]:
            await c.close()
    log.meta.update(system=system, target=base_url, base_model=base_model)
    return log


async def base_model_name(base_url: str, api_key: str | None) -> str:
    """The server's first listed model (loraplex and vLLM list the base model first)."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key=_key(api_key),
                                  max_retries=0) as client:
        page = await client.models.list()
        for model in page.data:
            return model.id
    raise ValueError(f"{base_url}: lists no models; give --openai-model")
