"""Tool calling on the chat API: ``tools`` and ``tool_choice`` served by structured output.

``tool_choice: "required"`` or a named function (``{"type": "function", "function": {"name":
...}}``) constrains the output to one call, the JSON object ``{"name": ..., "arguments":
{...}}`` whose ``arguments`` follow the function's ``parameters`` schema, so the call is always
valid; the response carries it in ``message.tool_calls`` with ``finish_reason: "tool_calls"``
(streamed as one tool-call delta once the call is complete). ``"none"`` generates text and
leaves the tools out. ``"auto"`` (the default with tools) needs a chat template that renders
tools and a parser for its tool-call format; this server has none yet, so it is refused with
400 naming the reason rather than served as text that never calls a tool.

One call per response (``parallel_tool_calls`` is accepted; at most one call is made). The
tool definitions do not reach the prompt (the chat templates served render messages only):
the constraint alone makes the output a call. Earlier calls sent back in the conversation
(an assistant message's ``tool_calls``) are rendered as that same JSON, and ``tool`` messages
as their content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from loraplex.server.http.structured import StructuredError
from loraplex.server.params import StructuredOutput

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


@dataclass(frozen=True)
class ToolCalls:
    """How a chat request's output becomes a tool call.

    Attributes:
        names: the functions the call may name.
        constraint: the structured output that makes the text a call.
    """

    names: tuple[str, ...]
    constraint: StructuredOutput

    def parse(self, text: str) -> list[dict[str, Any]]:
        """The OpenAI ``tool_calls`` list of a finished (``stop``) output.

        Raises:
            ValueError: the text is not a call (cannot happen for an output the constraint
                completed; a bug if it does).
        """
        call = json.loads(text)
        if not isinstance(call, dict) or call.get("name") not in self.names:
            raise ValueError(f"tool call: {text[:80]!r} names no function of the request")
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": call["name"],
                              "arguments": json.dumps(call.get("arguments", {}))}}]


def tool_calls(tools: list[Any] | None, tool_choice: str | dict[str, Any] | None
               ) -> ToolCalls | None:
    """What ``tools`` and ``tool_choice`` ask for (None: plain text).

    Raises:
        StructuredError: naming ``tools[i]...`` or ``tool_choice``.
    """
    if tool_choice is not None and not tools and tool_choice != "none":
        raise StructuredError("tool_choice: needs tools", "tool_choice")
    if not tools:
        return None
    functions = _functions(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice == "auto":
        raise StructuredError(
            'tool_choice: "auto" needs a chat template that renders tools and a parser for '
            'its tool-call format, and this model has neither; use "required" or name a '
            "function", "tool_choice")
    if choice == "required":
        chosen = list(functions)
    elif isinstance(choice, dict):
        name = _named(choice)
        if name not in functions:
            raise StructuredError(f"tool_choice.function.name: {json.dumps(name)[:80]} is not "
                                  "one of the tools", "tool_choice.function.name")
        chosen = [name]
    else:
        raise StructuredError(f"tool_choice: {json.dumps(choice)[:40]} is not none, auto, "
                              "required or a named function", "tool_choice")
    calls = [{"type": "object", "properties": {"name": {"enum": [name]},
                                               "arguments": functions[name]},
              "required": ["name", "arguments"]} for name in chosen]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    try:
        constraint = StructuredOutput("json_schema", json.dumps(schema))
    except ValueError as exc:
        raise StructuredError(f"tools: {str(exc).split(': ', 1)[-1]}", "tools") from None
    return ToolCalls(tuple(chosen), constraint)


def render_tool_calls(calls: list[tuple[str, str]]) -> str:
    """Earlier calls ``(name, arguments JSON text)`` as the text the model generated for them:
    one ``{"name": ..., "arguments": ...}`` object per line."""
    lines = []
    for name, arguments in calls:
        try:
            args: Any = json.loads(arguments)
        except ValueError:
            args = arguments  # not JSON: kept as the string it is
        lines.append(json.dumps({"name": name, "arguments": args}))
    return "\n".join(lines)


def _functions(tools: list[Any]) -> dict[str, dict[str, Any]]:
    if len(tools) > MAX_TOOLS:
        raise StructuredError(f"tools: at most {MAX_TOOLS}", "tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {
                "type", "function"}:
            raise StructuredError(f'{where}: must be {{"type": "function", "function": ...}}',
                                  where)
        fn = tool.get("function")
        if not isinstance(fn, dict) or set(fn) - FUNCTION_KEYS:
            keys = ", ".join(sorted(FUNCTION_KEYS))
            raise StructuredError(f"{where}.function: an object of {keys}", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise StructuredError(f"{where}.function.name: 1..64 letters, digits, _ or -",
                                  f"{where}.function.name")
        if name in functions:
            raise StructuredError(f"{where}.function.name: {name} is given twice",
                                  f"{where}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise StructuredError(f"{where}.function.parameters: must be a JSON schema object",
                                  f"{where}.function.parameters")
        functions[name] = params
    return functions


def _named(choice: dict[str, Any]) -> str:
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(
            fn.get("name"), str):
        raise StructuredError('tool_choice: must be {"type": "function", "function": '
                              '{"name": ...}}', "tool_choice")
    return str(fn["name"])
