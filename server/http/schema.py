"""OpenAI request bodies -> the service's ``GenerateRequest``s (the HTTP wire's edge).

A body is bounded before it is parsed (bytes, JSON nesting), then validated strictly against
the models below: unknown fields, wrong types and parameters loraplex does not implement yet
on this wire (``best_of``, ``echo``, ``suffix``) are 400 naming the parameter, never
silently ignored. Penalties, ``logit_bias`` (token ids as strings, as OpenAI sends them) and
vLLM's ``min_p``, ``min_tokens`` and ``repetition_penalty`` map onto the engine's sampling
controls; ``n`` onto its parallel sampling (the choices of a prompt share its KV pages).
``response_format`` and vLLM's ``guided_*`` fields map to a structured-output constraint
(``server/http/structured.py``), and so do ``tools`` with ``tool_choice``
(``server/http/tools.py``). Defaults are OpenAI's (``temperature`` 1, completions
``max_tokens`` 16), not the gRPC API's.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from loraplex.server.api import ChatMessage, ChatMessages, GenerateRequest, TokenizeRequest
from loraplex.server.engine.request import SamplingParams
from loraplex.server.http.structured import StructuredError, structured_output
from loraplex.server.http.tools import ToolCalls, render_tool_calls, tool_calls
from loraplex.server.params import StructuredOutput

MAX_JSON_DEPTH = 32
MAX_PROMPTS = 64
MAX_TOP_LOGPROBS = 20
OPENAI_DEFAULT_TEMPERATURE = 1.0
OPENAI_COMPLETIONS_MAX_TOKENS = 16


class BadRequest(ValueError):
    """A request body the API refuses (400, or 413 for one over the size bound); ``param``
    names the offending parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    """A call an earlier assistant turn made (sent back in the conversation)."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class Message(_Strict):
    role: str
    content: str | list[TextPart] | None = None  # required, but on an assistant's tool call
    tool_calls: list[ToolCall] | None = None  # assistant turns only
    tool_call_id: str | None = None  # tool turns: the call this answers


class _Common(_Strict):
    """Parameters both endpoints take (and the loraplex extensions ``top_k``, ``ignore_eos``,
    ``stop_token_ids``, as vLLM takes them through the client's ``extra_body``)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatBody(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TokenizeBody(_Strict):
    """vLLM's ``/tokenize``: a completion's ``prompt`` or a chat's ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeBody(_Strict):
    """vLLM's ``/detokenize``."""

    model: str | None = None
    tokens: list[int]


def parse_json(body: bytes) -> Any:
    """Decode a body and bound its nesting.

    Raises:
        BadRequest: not UTF-8 JSON, or nested deeper than ``MAX_JSON_DEPTH``.
    """
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest(f"the body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    if _depth(doc) > MAX_JSON_DEPTH:
        raise BadRequest(f"the body is nested deeper than {MAX_JSON_DEPTH} levels")
    if not isinstance(doc, dict):
        raise BadRequest("the body must be a JSON object")
    return doc


def _depth(doc: Any) -> int:
    # Iterative: a hostile body must not exhaust the stack before it is refused.
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            break
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return deepest


def _validate(cls: type[_Strict], doc: Any) -> Any:
    try:
        return cls.model_validate(doc)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = _format_loc(error["loc"])
        raise BadRequest(f"{path}: {error['msg']}", param=path) from None


def _format_loc(loc: tuple[Any, ...]) -> str:
    """``("messages", 0, "role")`` -> ``messages[0].role``, leaving out the union members
    pydantic names in the path (``str``, ``list[int]``...)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool"):
            out += f".{part}" if out else part
    return out or "body"


def _refuse_unsupported(body: _Common, extra: dict[str, Any]) -> None:
    """400 for parameters that would change the output and are not implemented yet."""
    values: dict[str, Any] = dict(extra)
    for name, used in values.items():
        if used:
            raise BadRequest(f"{name}: not supported by this server's HTTP API yet",
                             param=name)


def _token_ids(ids: list[int], path: str, param: str) -> tuple[int, ...]:
    """``ids`` as a prompt's token ids; JSON's integers are unbounded, the gRPC wire's ids
    uint32 (the worker checks them against the vocabulary). Raises ``BadRequest``."""
    for i, t in enumerate(ids):
        if not 0 <= t < 1 << 32:
            raise BadRequest(f"{path}[{i}]: {t} is not a token id", param=param)
    return tuple(ids)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    # OpenAI's JSON keys are token ids as strings.
    pairs = []
    for key, value in (bias or {}).items():
        if not key.isdigit() or int(key) >= 1 << 32:  # the wire's token ids are uint32
            raise BadRequest(f"logit_bias: keys must be token ids, got {key[:32]!r}",
                             param="logit_bias")
        pairs.append((int(key), value))
    return tuple(pairs)


def _structured(body: _Common, response_format: dict[str, Any] | None
                ) -> StructuredOutput | None:
    try:
        return structured_output(response_format, body.guided_json, body.guided_regex,
                                 body.guided_choice, body.guided_grammar)
    except StructuredError as exc:
        raise BadRequest(str(exc), param=exc.param) from None


def _params(body: _Common, max_tokens: int, logprobs: int | None,
            response_format: dict[str, Any] | None = None) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": OPENAI_DEFAULT_TEMPERATURE if body.temperature is None
        else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": body.top_k or 0, "seed": body.seed, "stop": stop,
        "stop_token_ids": tuple(body.stop_token_ids or ()),
        "ignore_eos": bool(body.ignore_eos), "logprobs": logprobs,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if body.repetition_penalty is None
        else body.repetition_penalty,
        "logit_bias": _logit_bias(body.logit_bias), "min_p": body.min_p or 0.0,
        "min_tokens": body.min_tokens or 0, "n": 1 if body.n is None else body.n,
        "structured": _structured(body, response_format)}
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        # SamplingParams names the field first ("max_tokens: ...").
        raise BadRequest(str(exc), param=str(exc).split(":", 1)[0]) from None


def _chat_message(i: int, m: Message) -> ChatMessage:
    # OpenAI's "developer" messages are what chat templates know as "system" ones.
    role = "system" if m.role == "developer" else m.role
    if m.tool_calls is not None and role != "assistant":
        raise BadRequest(f"messages[{i}].tool_calls: only assistant messages make tool calls",
                         param=f"messages[{i}].tool_calls")
    if m.tool_call_id is not None and role != "tool":
        raise BadRequest(f"messages[{i}].tool_call_id: only tool messages answer a call",
                         param=f"messages[{i}].tool_call_id")
    if m.content is None and not m.tool_calls:
        raise BadRequest(f"messages[{i}].content: required", param=f"messages[{i}].content")
    text = m.content if isinstance(m.content, str) else "".join(
        part.text for part in m.content or [])
    if m.tool_calls:
        # The call as the model wrote it (the tool-call constraint's form), so that the
        # conversation reads back as the model would continue it.
        text += render_tool_calls([(c.function.name, c.function.arguments)
                                   for c in m.tool_calls])
    return ChatMessage(role=role, content=text)


def chat_tools(body: ChatBody) -> ToolCalls | None:
    """The tool call a chat body asks for (None: text). Raises ``BadRequest``."""
    try:
        return tool_calls(body.tools, body.tool_choice)
    except StructuredError as exc:
        raise BadRequest(str(exc), param=exc.param) from None


def completion_requests(doc: Any, request_id: str = "") -> tuple[CompletionBody,
                                                                 list[GenerateRequest]]:
    """A ``/v1/completions`` body -> one ``GenerateRequest`` per prompt (``model`` is left
    for the caller to resolve: the base model or an adapter).

    Raises:
        BadRequest: naming the parameter.
    """
    body: CompletionBody = _validate(CompletionBody, doc)
    _refuse_unsupported(body, {"echo": bool(body.echo), "suffix": body.suffix is not None,
                               "best_of": body.best_of not in (None, 1)})
    prompts: list[str | tuple[int, ...]] = []
    if isinstance(body.prompt, str):
        prompts = [body.prompt]
    elif body.prompt and isinstance(body.prompt[0], int):
        prompts = [_token_ids([t for t in body.prompt if isinstance(t, int)], "prompt",
                              "prompt")]
    else:
        for j, p in enumerate(body.prompt):
            prompts.append(p if isinstance(p, str) else _token_ids(p, f"prompt[{j}]", "prompt")
                           if isinstance(p, list) else ())
    if not prompts:
        raise BadRequest("prompt: must not be empty", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"prompt: at most {MAX_PROMPTS} prompts in one request",
                         param="prompt")
    max_tokens = OPENAI_COMPLETIONS_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    params = _params(body, max_tokens, body.logprobs)
    many = len(prompts) > 1
    return body, [GenerateRequest(prompt=p, params=params,
                                  request_id=f"{request_id}-{i}" if many and request_id
                                  else request_id)
                  for i, p in enumerate(prompts)]


def chat_request(doc: Any, default_max_tokens: int, request_id: str = ""
                 ) -> tuple[ChatBody, GenerateRequest]:
    """A ``/v1/chat/completions`` body -> a ``GenerateRequest`` whose prompt is the messages.

    Raises:
        BadRequest: naming the parameter.
    """
    body: ChatBody = _validate(ChatBody, doc)
    _refuse_unsupported(body, {})
    tools = chat_tools(body)
    if not body.messages:
        raise BadRequest("messages: must not be empty", param="messages")
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise BadRequest("max_completion_tokens: differs from max_tokens; give one",
                         param="max_completion_tokens")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise BadRequest("top_logprobs: needs logprobs: true", param="top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}]",
                             param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _params(body, default_max_tokens if max_tokens is None else max_tokens, logprobs,
                     body.response_format)
    if tools is not None:
        if params.structured is not None:
            raise BadRequest("tool_choice: a tool call cannot also follow response_format or "
                             "guided_*", param="tool_choice")
        params = replace(params, structured=tools.constraint)
    messages = ChatMessages(tuple(_chat_message(i, m) for i, m in enumerate(body.messages)))
    return body, GenerateRequest(prompt=messages, params=params, request_id=request_id)


def tokenize_request(doc: Any) -> tuple[str | None, TokenizeRequest]:
    """A ``/tokenize`` body -> (its ``model``, the request). ``prompt`` is encoded as a
    completion's (the tokenizer's special tokens unless ``add_special_tokens`` is false),
    ``messages`` as a chat's (the chat template, the assistant turn's prompt after them).

    Raises:
        BadRequest: naming the parameter (one of prompt or messages; options not served).
    """
    body: TokenizeBody = _validate(TokenizeBody, doc)
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("prompt: give either prompt or messages", param="prompt")
    strs = bool(body.return_token_strs)
    if body.messages is None:
        return body.model, TokenizeRequest(body.prompt or "", body.add_special_tokens
                                           is not False, strs)
    # a chat's prompt is always the template's rendering followed by the assistant turn's
    # prompt, special tokens only as the template writes them (vLLM's chat defaults)
    _refuse_unsupported(_Common(model=""), {
        "add_generation_prompt": body.add_generation_prompt is False,
        "add_special_tokens": bool(body.add_special_tokens)})
    if not body.messages:
        raise BadRequest("messages: must not be empty", param="messages")
    return body.model, TokenizeRequest(ChatMessages(tuple(
        _chat_message(i, m) for i, m in enumerate(body.messages))), return_token_strs=strs)


def detokenize_request(doc: Any) -> tuple[str | None, TokenizeRequest]:
    """A ``/detokenize`` body -> (its ``model``, the request for the text of its ``tokens``).

    Raises:
        BadRequest: naming the parameter.
    """
    body: DetokenizeBody = _validate(DetokenizeBody, doc)
    return body.model, TokenizeRequest(_token_ids(body.tokens, "tokens", "tokens"))
