"""Tool calling over real gRPC (the Python client, a real gateway and worker) on the demo
model: ``tools`` with ``tool_choice`` "required" or a named function constrain the output to
one call, returned as ``tool_calls`` with finish reason ``tool_calls`` (unary, and on the
stream's last chunk); "auto" is refused with INVALID_ARGUMENT naming the reason, as HTTP
refuses it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import jsonschema
import pytest

from loraplex.server.client import ServiceError, Tool, ToolChoice
from loraplex.server.engine.models.demo import demo_model_path
from loraplex.server.params import StructuredOutput
from tests.e2e.harness import Cluster

PARAMETERS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]},
    "add": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                   "maximum": 99}}, "required": ["a"]},
}
TOOLS = [Tool("get_weather", "The forecast for a city.", json.dumps(PARAMETERS["get_weather"])),
         {"type": "function", "function": {"name": "add", "parameters": PARAMETERS["add"]}}]
MESSAGES = [{"role": "user", "content": "weather in Oslo?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(demo_model_path(), tmp_path_factory.mktemp("store"))
    yield c
    c.close()


def _check_call(call, names: set[str]) -> None:
    assert call.id.startswith("call_") and call.name in names
    jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])


def test_unary_tool_call_required_and_named(cluster: Cluster) -> None:
    with cluster.client(timeout=120) as client:
        for choice, names in (("required", set(PARAMETERS)), (ToolChoice(function="add"),
                                                                {"add"}),
                              ({"type": "function", "function": {"name": "get_weather"}},
                               {"get_weather"})):
            for seed in range(3):
                out = client.generate(messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                      max_tokens=120, temperature=1.0, seed=seed)
                assert out.finish_reason == "tool_calls", out
                [call] = out.tool_calls
                _check_call(call, names)
                assert json.loads(out.text) == {"name": call.name,
                                                "arguments": json.loads(call.arguments)}
                assert out.sequences[0].tool_calls == out.tool_calls
                assert out.sequences[0].finish_reason == "tool_calls"
    assert cluster.wait_idle().pages.num_kv == 0


def test_streamed_tool_call_on_the_last_chunk(cluster: Cluster) -> None:
    with cluster.client(timeout=120) as client:
        chunks = list(client.generate_stream(messages=MESSAGES, tools=TOOLS,
                                             tool_choice="required", max_tokens=120))
    assert chunks[-1].finish_reason == "tool_calls"
    assert all(c.finish_reason is None and not c.tool_calls for c in chunks[:-1])
    [call] = chunks[-1].tool_calls
    _check_call(call, set(PARAMETERS))
    text = "".join(c.text for c in chunks)  # the call's JSON text, streamed as generated
    assert json.loads(text)["name"] == call.name


def test_n_sequences_each_make_their_own_call(cluster: Cluster) -> None:
    """n > 1: every sequence is constrained on its own and carries its own call, unary (in
    ``sequences``) and streamed (on each sequence's last chunk)."""
    with cluster.client(timeout=120) as client:
        out = client.generate(messages=MESSAGES, tools=TOOLS, tool_choice="required", n=3,
                              max_tokens=120, temperature=1.0, seed=7)
        assert [s.index for s in out.sequences] == [0, 1, 2]
        for seq in out.sequences:
            assert seq.finish_reason == "tool_calls", seq
            [call] = seq.tool_calls
            _check_call(call, set(PARAMETERS))
            assert json.loads(seq.text)["name"] == call.name
        chunks = list(client.generate_stream(messages=MESSAGES, tools=TOOLS, n=3,
                                             tool_choice=ToolChoice(function="add"),
                                             max_tokens=120, temperature=1.0, seed=7))
    last = {c.index: c for c in chunks if c.finish_reason is not None}
    assert sorted(last) == [0, 1, 2]
    for chunk in last.values():
        assert chunk.finish_reason == "tool_calls"
        [call] = chunk.tool_calls
        _check_call(call, {"add"})
    assert cluster.wait_idle().pages.num_kv == 0


def test_tool_choice_none_is_plain_text(cluster: Cluster) -> None:
    with cluster.client(timeout=120) as client:
        out = client.generate(messages=MESSAGES, tools=TOOLS, tool_choice="none",
                              max_tokens=6)
    assert out.finish_reason in ("stop", "length") and out.tool_calls == []


@pytest.mark.parametrize("kwargs,message", [
    ({"tools": TOOLS}, 'tool_choice: "auto" needs a chat template that renders tools'),
    ({"tools": TOOLS, "tool_choice": "auto"}, 'tool_choice: "auto" needs a chat template'),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, 'tool_choice: "sometimes" is not none'),
    ({"tools": TOOLS, "tool_choice": ToolChoice(function="nope")},
     'tool_choice.function.name: "nope" is not one of the tools'),
    ({"tool_choice": "required"}, "tool_choice: needs tools"),
    ({"tools": [Tool("f", parameters="{not json")], "tool_choice": "required"},
     "tools[0].parameters: not JSON text"),
    ({"tools": [Tool("bad name!")], "tool_choice": "required"}, "tools[0].function.name"),
    ({"tools": [Tool("f", "x" * 8193)], "tool_choice": "required"},
     "tools[0].description: at most 8192"),
    ({"tools": TOOLS, "tool_choice": "required",
      "structured": StructuredOutput("json_object")}, "tool_choice: a tool call cannot"),
])
def test_refused_with_invalid_argument(cluster: Cluster, kwargs, message: str) -> None:
    with cluster.client(timeout=120) as client:
        for call in (lambda: client.generate(messages=MESSAGES, max_tokens=4, **kwargs),
                     lambda: list(client.generate_stream(messages=MESSAGES, max_tokens=4,
                                                         **kwargs))):
            with pytest.raises(ServiceError) as info:
                call()
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.message.startswith(message), info.value.message


def test_a_call_cut_short_stays_text(cluster: Cluster) -> None:
    with cluster.client(timeout=120) as client:
        cut = client.generate(messages=MESSAGES, tools=TOOLS, tool_choice="required",
                              max_tokens=3)
        stopped = client.generate(messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                  max_tokens=60, stop=['"'])
    assert cut.finish_reason == "length" and cut.tool_calls == [] and cut.text
    # the caller's stop string ends it inside the call's JSON: text, not a call
    assert stopped.finish_reason == "stop" and stopped.tool_calls == []
    assert stopped.text == "{"
