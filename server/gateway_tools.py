"""Tool calling on the gRPC API: a request's ``tools`` and ``tool_choice`` become the same
tool-call constraint the HTTP API builds (``server/http/tools.py``: ``"required"`` or a named
function constrain the output to one ``{"name": ..., "arguments": {...}}`` object whose
arguments follow the function's schema; ``"auto"`` is refused, ``"none"`` leaves the tools
out), and each sequence's output, once its grammar completes, becomes a ``ToolCall`` with
finish reason ``tool_calls``. Workers see only the constraint.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import grpc

from loraplex.server.api import GenerateChunk, GenerateRequest, ServiceError, ToolCall
from loraplex.server.http.tools import ToolCalls, tool_calls

MAX_DESCRIPTION_CHARS = 8192


def _invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _openai_tools(request: GenerateRequest) -> list[dict[str, Any]]:
    # The HTTP builder's input: OpenAI's {"type": "function", "function": {...}} objects.
    out = []
    for i, tool in enumerate(request.tools):
        fn: dict[str, Any] = {"name": tool.name}
        if len(tool.description) > MAX_DESCRIPTION_CHARS:
            raise _invalid(f"tools[{i}].description: at most {MAX_DESCRIPTION_CHARS} "
                           "characters")
        if tool.parameters:
            try:
                fn["parameters"] = json.loads(tool.parameters)
            except ValueError:
                raise _invalid(f"tools[{i}].parameters: not JSON text") from None
        out.append({"type": "function", "function": fn})
    return out


def constrain(request: GenerateRequest) -> tuple[GenerateRequest, ToolCalls | None]:
    """The request with its tool-call constraint in ``params.structured`` (unchanged, None:
    no tool call asked for).

    Raises:
        ServiceError: INVALID_ARGUMENT naming the field (``tools[i]...``, ``tool_choice``,
            ``n``), as the HTTP API's 400s do.
    """
    choice = request.tool_choice
    if not request.tools and choice is None:
        return request, None
    openai_choice: str | dict[str, Any] | None = None
    if choice is not None:
        if choice.mode and choice.function:
            raise _invalid("tool_choice: set mode or function, not both")
        openai_choice = ({"type": "function", "function": {"name": choice.function}}
                         if choice.function else choice.mode)
    try:
        tools = tool_calls(_openai_tools(request), openai_choice)
    except ValueError as exc:  # StructuredError names the field
        raise _invalid(str(exc)) from None
    if tools is None:
        return request, None
    if request.params.structured is not None:
        raise _invalid("tool_choice: a tool call cannot also follow params.structured")
    try:
        params = replace(request.params, structured=tools.constraint)
    except ValueError as exc:  # the constraint refused by SamplingParams
        raise _invalid(str(exc)) from None
    return replace(request, params=params), tools


class ToolCallOutputs:
    """Turns each sequence's finished output into its tool call (one call per sequence)."""

    def __init__(self, tools: ToolCalls) -> None:
        self._tools = tools
        self._text: dict[int, str] = {}

    def update(self, chunk: GenerateChunk) -> None:
        """Follow ``chunk`` (in place): on its sequence's last chunk ended by the grammar
        (``stop``), the call and finish reason ``tool_calls``; cut short (``length``, or a
        stop the caller asked for), it stays text."""
        text = self._text.get(chunk.index, "") + chunk.text
        self._text[chunk.index] = text
        if chunk.finish_reason != "stop":
            return
        try:
            calls = self._tools.parse(text)
        except ValueError:  # a stop string or token of the caller's cut the call short
            return
        chunk.tool_calls = [ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                            for c in calls]
        chunk.finish_reason = "tool_calls"
