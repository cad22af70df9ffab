"""Structured output over real gRPC (the Python client) and over the HTTP API (the official
``openai`` client), against a real gateway and worker with uploaded adapters."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest
from openai import OpenAI

from loraplex.server.client import ServiceError
from loraplex.server.params import SamplingParams, StructuredOutput
from tests.e2e.harness import Cluster, counter_total

BASE = "tiny"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "score": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["name", "tags", "score"]}


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            adapter_dirs: dict[str, Path]) -> Iterator[Cluster]:
    c = Cluster(model_dir, tmp_path_factory.mktemp("store"),
                gateway={"http_port": 0, "served_model_name": BASE})
    with c.client() as client:
        client.upload_adapter(adapter_dirs["alpha"], "alpha")
        client.upload_adapter(adapter_dirs["gamma"], "gamma")
    yield c
    c.close()


def oai(cluster: Cluster) -> OpenAI:
    assert cluster.http_url is not None
    return OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0,
                  timeout=60)


def test_grpc_constrained_requests_beside_free_ones(cluster: Cluster) -> None:
    schema = StructuredOutput("json_schema", json.dumps(SCHEMA))
    regex = StructuredOutput("regex", r"[a-f]{2,4}-[0-9]{2}")
    jobs = []
    for i, adapter in enumerate(["", "alpha", "gamma"] * 2):
        temperature = 0.0 if i < 3 else 0.9
        jobs.append((adapter, SamplingParams(max_tokens=150, temperature=temperature, seed=i,
                                             structured=schema), "schema"))
        jobs.append((adapter, SamplingParams(max_tokens=40, temperature=temperature, seed=i,
                                             structured=regex), "regex"))
        jobs.append((adapter, SamplingParams(max_tokens=6), "free"))
    with cluster.client() as client, ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: client.generate(f"job {job[2]}", job[0],
                                                            params=job[1]), jobs))
        streamed = "".join(c.text for c in client.generate_stream(
            "stream", "alpha", params=SamplingParams(max_tokens=150, structured=schema)))
    for (_, _, kind), out in zip(jobs, results):
        if kind == "free":
            assert out.finish_reason == "length"
            continue
        assert out.finish_reason == "stop", (kind, out.text)
        if kind == "schema":
            jsonschema.validate(json.loads(out.text), SCHEMA)
        else:
            assert re.fullmatch(r"[a-f]{2,4}-[0-9]{2}", out.text), out.text
    jsonschema.validate(json.loads(streamed), SCHEMA)
    registry = cluster.workers[0].registry
    assert counter_total(registry, "loraplex_worker_jump_forward_tokens") > 0
    assert counter_total(registry, "loraplex_worker_grammar_cache_hits") > 0
    assert counter_total(registry, "loraplex_worker_grammar_compiles") >= 2


@pytest.mark.parametrize(("spec", "needle"), [
    (StructuredOutput("grammar", "root ::= ("), "structured.grammar: does not compile"),
    (StructuredOutput("regex", r"[^\s\S]"), "structured.regex: no token can continue"),
])
def test_grpc_bad_grammar_is_invalid_argument_for_that_request(cluster: Cluster,
                                                               spec: StructuredOutput,
                                                               needle: str) -> None:
    with cluster.client() as client, ThreadPoolExecutor(2) as pool:
        free = pool.submit(client.generate, "free", "alpha", max_tokens=8)
        with pytest.raises(ServiceError) as info:
            client.generate("x", params=SamplingParams(max_tokens=8, structured=spec))
        assert free.result().finish_reason == "length"
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith(needle), info.value.message


def test_grpc_oversized_schema_is_refused_at_the_gateway(cluster: Cluster) -> None:
    from loraplex.v1 import generation_pb2, generation_pb2_grpc

    # A raw request: the client's own StructuredOutput would refuse it before sending.
    channel = grpc.insecure_channel(cluster.address)
    stub = generation_pb2_grpc.GenerationStub(channel)
    big = json.dumps({"enum": ["x" * 100] * 1000})
    for structured, needle in (
            (generation_pb2.StructuredOutput(json_schema=big), "over the limit of 65536"),
            (generation_pb2.StructuredOutput(), "structured: set one of"),
            (generation_pb2.StructuredOutput(json_schema="[1]"), "must be a JSON object")):
        request = generation_pb2.GenerateRequest(
            text="x", params=generation_pb2.SamplingParams(structured=structured))
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in info.value.details(), info.value.details()
    channel.close()


def test_http_response_format_json_schema_with_the_openai_client(cluster: Cluster) -> None:
    client = oai(cluster)
    for model in (BASE, "alpha"):
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "describe a thing"}],
            max_tokens=150, temperature=0,
            response_format={"type": "json_schema", "json_schema": {
                "name": "thing", "schema": SCHEMA, "strict": True}})
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        assert choice.message.content is not None
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.chat.completions.create(
        model="gamma", messages=[{"role": "user", "content": "json please"}], max_tokens=150,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
        stream=True)
    text, reasons = "", []
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_http_json_object_and_guided_fields(cluster: Cluster) -> None:
    client = oai(cluster)
    out = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "an object"}], max_tokens=60,
        response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":  # free-form strings may run past max_tokens
        assert isinstance(json.loads(out.choices[0].message.content or ""), dict)
    else:
        assert (out.choices[0].message.content or "").startswith("{")
    done = client.completions.create(model="alpha", prompt=["a", "b"], max_tokens=20,
                                     extra_body={"guided_choice": ["left", "right"]})
    assert [c.text for c in done.choices if c.text not in ("left", "right")] == []
    assert {c.finish_reason for c in done.choices} == {"stop"}
    done = client.completions.create(model=BASE, prompt="r", max_tokens=20,
                                     extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", done.choices[0].text)
    done = client.completions.create(model=BASE, prompt="g", max_tokens=20,
                                     extra_body={"guided_grammar": 'root ::= "x" [a-c]+ "y"'})
    assert re.fullmatch("x[a-c]+y", done.choices[0].text)


def test_http_bad_constraints_answer_400(cluster: Cluster) -> None:
    client = oai(cluster)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=BASE, prompt="x", max_tokens=5,
                                  extra_body={"guided_grammar": "root ::= ("})
    assert "structured.grammar: does not compile" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": "x"}], max_tokens=5,
            response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "guided_regex"


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 7}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                               "maximum": 99}}, "required": ["a"]}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def test_http_tool_calls_required_and_named(cluster: Cluster) -> None:
    client = oai(cluster)
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    for model, choice in ((BASE, "required"), ("alpha", "required"),
                          (BASE, {"type": "function", "function": {"name": "add"}})):
        for seed in range(3):
            out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                 tool_choice=choice, max_tokens=120,
                                                 temperature=1.0, seed=seed)
            message = out.choices[0].message
            assert out.choices[0].finish_reason == "tool_calls", out.choices[0]
            assert message.content is None and message.tool_calls
            [call] = message.tool_calls
            if isinstance(choice, dict):
                assert call.function.name == "add"
            jsonschema.validate(json.loads(call.function.arguments),
                                PARAMETERS[call.function.name])
    stream = client.chat.completions.create(model="gamma", messages=messages, tools=TOOLS,
                                            tool_choice="required", max_tokens=120,
                                            stream=True)
    calls, reasons = [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        calls.extend(delta.tool_calls or [])
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls" and len(calls) == 1
    assert calls[0].index == 0 and calls[0].id and calls[0].function
    jsonschema.validate(json.loads(calls[0].function.arguments or ""),
                        PARAMETERS[calls[0].function.name or ""])
    # The loop: the call goes back in the conversation with the tool's answer.
    first = client.chat.completions.create(model="alpha", messages=messages, tools=TOOLS,
                                           tool_choice="required", max_tokens=120)
    message = first.choices[0].message
    assert message.tool_calls
    call = message.tool_calls[0]
    followup = client.chat.completions.create(
        model="alpha", tools=TOOLS, tool_choice="none", max_tokens=8,
        messages=[*messages, message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    assert followup.choices[0].finish_reason in ("stop", "length")
    assert followup.choices[0].message.tool_calls is None
    assert followup.usage is not None and first.usage is not None
    assert followup.usage.prompt_tokens > first.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=BASE, messages=messages, tools=TOOLS,
                                       max_tokens=10)
    assert info.value.body["param"] == "tool_choice"  # "auto" has no parser here
    assert "auto" in info.value.message


def test_n_constrained_choices_over_http_and_grpc(cluster: Cluster) -> None:
    """n > 1 with a constraint: each choice its own valid output (own matcher), whole and
    streamed, as JSON and as tool calls; over gRPC each streamed sequence validates."""
    client = oai(cluster)
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA,
                                                  "strict": True}}
    out = client.chat.completions.create(model="alpha", messages=messages, response_format=fmt,
                                         max_tokens=150, temperature=1.0, seed=3, n=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for c in out.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content or ""), SCHEMA)
    calls = client.chat.completions.create(model=BASE, messages=messages, tools=TOOLS,
                                           tool_choice="required", max_tokens=120,
                                           temperature=1.0, seed=5, n=2)
    for c in calls.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments),
                                PARAMETERS[call.function.name])
    stream = client.chat.completions.create(model="gamma", messages=messages, tools=TOOLS,
                                            tool_choice="required", max_tokens=120,
                                            temperature=1.0, seed=5, n=2, stream=True)
    streamed: dict[int, list] = {0: [], 1: []}
    reasons: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index].extend(c.delta.tool_calls or [])
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    for index, deltas in streamed.items():
        assert deltas, index
        for d in deltas:
            jsonschema.validate(json.loads(d.function.arguments or ""),
                                PARAMETERS[d.function.name or ""])
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    with cluster.client() as grpc_client:
        for chunk in grpc_client.generate_stream("n", "alpha", params=SamplingParams(
                max_tokens=150, temperature=1.0, seed=8, n=3,
                structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))):
            texts[chunk.index] += chunk.text
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)
