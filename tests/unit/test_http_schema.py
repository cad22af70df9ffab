"""OpenAI request bodies -> GenerateRequests, without a server: chat messages (until the
worker renders them, chat is checked end to end only up to its 400), parameter mapping and
the parameters that are refused rather than ignored."""

from __future__ import annotations

import pytest

from loraplex.server.api import ChatMessage, ChatMessages
from loraplex.server.http.schema import (
    MAX_JSON_DEPTH,
    BadRequest,
    chat_request,
    completion_requests,
    parse_json,
)


def test_chat_messages_become_the_prompt() -> None:
    body, request = chat_request({
        "model": "m", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hel"},
                                         {"type": "text", "text": "lo"}]}],
        "max_completion_tokens": 7, "temperature": 0, "seed": 3, "stop": "END",
        "logprobs": True, "top_logprobs": 4, "user": "u-1",
        "stream": True, "stream_options": {"include_usage": True}}, 99, "rid")
    assert request.prompt == ChatMessages((ChatMessage("system", "be brief"),
                                           ChatMessage("user", "hello")))
    p = request.params
    assert (p.max_tokens, p.temperature, p.seed, p.stop, p.logprobs) == (7, 0.0, 3, ("END",), 4)
    assert request.request_id == "rid" and body.stream and body.stream_options is not None
    # Defaults: OpenAI's temperature, the gateway's chat max_tokens, no logprobs.
    _, plain = chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}]}, 99)
    assert (plain.params.max_tokens, plain.params.temperature, plain.params.logprobs) == (
        99, 1.0, None)
    _, legacy = chat_request({"model": "m", "max_tokens": 5, "logprobs": True,
                              "messages": [{"role": "user", "content": "x"}]}, 99)
    assert (legacy.params.max_tokens, legacy.params.logprobs) == (5, 0)


def test_completion_prompts() -> None:
    for prompt, want in (("hi", ["hi"]), ([1, 2], [(1, 2)]), (["a", "b"], ["a", "b"]),
                         ([[1], [2, 3]], [(1,), (2, 3)])):
        _, requests = completion_requests({"model": "m", "prompt": prompt}, "r")
        assert [r.prompt for r in requests] == want
        assert all(r.params.max_tokens == 16 and r.params.temperature == 1.0 for r in requests)
    _, many = completion_requests({"model": "m", "prompt": ["a", "b"]}, "r")
    assert [r.request_id for r in many] == ["r-0", "r-1"]


@pytest.mark.parametrize(("doc", "param"), [
    ({"n": 0}, "n"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"-1": 2}}, "logit_bias"), ({"tools": [{}]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content"),
    ({"top_logprobs": 3}, "top_logprobs"), ({"temperature": "hot"}, "temperature"),
    ({"functions": []}, "functions"), ({"model": 3}, "model"),
])
def test_chat_refusals_name_the_parameter(doc: dict, param: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **doc}
    with pytest.raises(BadRequest) as info:
        chat_request(body, 16)
    assert info.value.param == param and str(info.value).startswith(param), info.value


def test_json_bounds() -> None:
    assert parse_json(b'{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]}
    for body in (b"", b"nope", b"[]", b"\xff", b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (
            MAX_JSON_DEPTH + 1), b"[" * 100000):
        with pytest.raises(BadRequest):
            parse_json(body)


def test_chat_objects_parse_as_the_openai_client_types() -> None:
    """Chat cannot run end to end until the worker renders messages: check the objects the
    HTTP layer builds against the official client's own models instead."""
    openai_types = pytest.importorskip("openai.types.chat")
    from loraplex.server.api import Completion, GenerateChunk, Usage
    from loraplex.server.engine.request import TokenLogprob
    from loraplex.server.http.app import _Shape

    shape = _Shape("chatcmpl-1", 1700000000, "mylora@2", chat=True)
    lps = [TokenLogprob(5, -0.1, ((5, -0.1), (7, -2.5)))]
    whole = openai_types.ChatCompletion.model_validate(shape.whole([Completion(
        "r", [5], "Hi", lps, "stop", Usage(10, 1, 8))]))
    assert whole.choices[0].message.content == "Hi" and whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens == 8
    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.content
    assert whole.choices[0].logprobs.content[0].top_logprobs[1].token == "token_id:7"
    first = openai_types.ChatCompletionChunk.model_validate(
        shape.chunk(0, {"role": "assistant", "content": ""}, None, None))
    assert first.choices[0].delta.role == "assistant"
    last = openai_types.ChatCompletionChunk.model_validate(
        shape.delta(0, GenerateChunk("r", [5], "!", lps, "length")))
    assert last.choices[0].delta.content == "!" and last.choices[0].finish_reason == "length"
