"""``tools`` and ``tool_choice`` -> a tool-call constraint, and its parse (no server)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from loraplex.server.http.schema import BadRequest, chat_request, chat_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "d",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}},
                                                "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add"}}


def chat(**fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    parsed, request = chat_request(body, 16)
    return chat_tools(parsed), request.params.structured


def test_required_and_named_functions_constrain_to_a_call() -> None:
    tools, structured = chat(tools=[WEATHER, ADD], tool_choice="required")
    assert tools is not None and tools.names == ("get_weather", "add")
    assert structured == tools.constraint
    schema = json.loads(structured.value)
    jsonschema.validate({"name": "add", "arguments": {}}, schema)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {}}, schema)
    tools, structured = chat(tools=[WEATHER, ADD], tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    assert tools is not None and tools.names == ("get_weather",)
    [call] = tools.parse('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_none_is_text() -> None:
    assert chat(tools=[WEATHER], tool_choice="none") == (None, None)
    assert chat() == (None, None)


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [WEATHER]}, "tool_choice"),  # "auto": no tool-call parser for this model
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}],
      "tool_choice": "required"}, "tools[0].function.name"),
    ({"tools": [ADD, ADD], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "tool_choice"),
])
def test_refusals_name_the_parameter(fields: dict, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        chat(**fields)
    assert info.value.param == param and str(info.value).startswith(param), info.value


def test_a_conversation_with_earlier_calls_renders_them() -> None:
    body = {"model": "m", "tools": [WEATHER], "tool_choice": "none", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}
    _, request = chat_request(body, 16)
    roles = [m.role for m in request.prompt.messages]
    assert roles == ["user", "assistant", "tool"]
    assert json.loads(request.prompt.messages[1].content) == {
        "name": "get_weather", "arguments": {"city": "Oslo"}}
    assert request.prompt.messages[2].content == "sunny"
    assert request.params.structured is None


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls"),
    ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[0].tool_call_id"),
    ({"role": "assistant"}, "messages[0].content"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                           "function": {"name": "f"}}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_message_refusals(message: dict, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        chat_request({"model": "m", "messages": [message]}, 16)
    assert info.value.param == param, info.value
