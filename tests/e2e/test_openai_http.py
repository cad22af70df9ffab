"""The OpenAI-compatible HTTP API, driven by the official ``openai`` client over loopback
against a real gateway and worker (the tiny random Llama; adapters uploaded for real)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from loraplex.server.client import Client
from loraplex.server.commands import write_demo_adapter
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.llm import LLM
from loraplex.server.engine.models.demo import BOS, IM_START
from loraplex.server.engine.request import SamplingParams
from loraplex.server.http.schema import MAX_JSON_DEPTH
from tests.e2e.harness import REPO, Cluster, engine_config, read_line, wait_for, write_keys

KEYS = {"acme-key-0123456789": ("acme", False), "globex-key-0123456789": ("globex", False),
        "tight-key-0123456789": ("tight", False)}
ACME, GLOBEX, TIGHT = KEYS
BASE = "tiny"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_keys(tmp_path_factory.mktemp("keys") / "keys.txt", KEYS)
    # tight: 200 tokens a minute, so a second request within the minute is refused.
    lines = [f"{line}  tokens_per_minute=200" if " tight" in line else line
             for line in path.read_text().splitlines()]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, key_file: Path,
            adapter_dirs: dict[str, Path]) -> Iterator[Cluster]:
    c = Cluster(model_dir, tmp_path_factory.mktemp("store"), keys=key_file,
                gateway={"http_port": 0, "served_model_name": BASE})
    with c.client(ACME) as acme:
        acme.upload_adapter(adapter_dirs["alpha"], "private")
        acme.upload_adapter(adapter_dirs["beta"], "private")  # private@2
    yield c
    c.close()


def oai(cluster: Cluster, key: str = ACME, timeout: float = 30.0) -> OpenAI:
    assert cluster.http_url is not None
    return OpenAI(base_url=f"{cluster.http_url}/v1", api_key=key, max_retries=0,
                  timeout=timeout)


def token_ids(logprobs: openai.types.completion_choice.Logprobs | None) -> list[int]:
    assert logprobs is not None and logprobs.tokens is not None
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens]


def test_completion_greedy_tokens_equal_grpc(cluster: Cluster) -> None:
    client = oai(cluster)
    with cluster.client(ACME) as grpc_client:
        for model, adapter in ((BASE, ""), ("private", "private"), ("private@1", "private@1")):
            want = grpc_client.generate(PROMPT, adapter, max_tokens=8, temperature=0,
                                        ignore_eos=True)
            got = client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                            temperature=0, logprobs=0,
                                            extra_body={"ignore_eos": True})
            choice = got.choices[0]
            assert token_ids(choice.logprobs) == want.token_ids, model
            assert choice.text == want.text and choice.finish_reason == "length"
            assert got.model == model and got.object == "text_completion"
            assert got.usage is not None
            assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
                want.usage.prompt_tokens, 8)
            assert got.usage.total_tokens == want.usage.prompt_tokens + 8
            assert got.usage.prompt_tokens_details is not None
            # The same prompt just ran over gRPC: its full pages come from the prefix cache.
            assert got.usage.prompt_tokens_details.cached_tokens > 0
        # And the offline engine, on the same weights (the adapter by its digest).
        digest = cluster.store.resolve("acme", "private@1").digest
        offline = LLM(engine=Engine(engine_config(cluster.model_dir),
                                    adapter_source=cluster.store))
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        for adapter, model in ((None, BASE), (digest, "private@1")):
            want_ids = offline.generate([PROMPT], params, adapters=[adapter])[0].token_ids
            got = client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                            temperature=0, logprobs=0,
                                            extra_body={"ignore_eos": True})
            assert token_ids(got.choices[0].logprobs) == want_ids, model
        # Adapters change the output: the names really reach different weights.
        base = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})
        lora = client.completions.create(model="private@2", prompt=PROMPT, max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert base.choices[0].text != lora.choices[0].text


def test_every_token_streams_its_own_event_text_or_not(cluster: Cluster) -> None:
    # Byte-level tokens that end mid-character decode to no text yet; the stream still
    # sends their events (as vLLM does), so clients see progress and can time each token.
    client = oai(cluster)
    chunks = [c for c in client.completions.create(
        model=BASE, prompt=[200, 201, 202], max_tokens=40, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices]
    assert len(chunks) == 40
    assert any(c.choices[0].text == "" for c in chunks)  # the case this is about


def test_token_id_prompts_and_a_list_of_prompts(cluster: Cluster) -> None:
    client = oai(cluster)
    with cluster.client(ACME) as grpc_client:
        want = [grpc_client.generate(p, max_tokens=5, ignore_eos=True).token_ids
                for p in ([5, 6, 7, 8], "second prompt")]
    got = client.completions.create(model=BASE, prompt=[5, 6, 7, 8], max_tokens=5,
                                    temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    assert token_ids(got.choices[0].logprobs) == want[0]
    many = client.completions.create(model=BASE, prompt=["hello", "second prompt"],
                                     max_tokens=5, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1]
    assert token_ids(many.choices[1].logprobs) == want[1]
    assert many.usage is not None and many.usage.completion_tokens == 10


def test_streaming_with_usage_equals_the_whole_response(cluster: Cluster) -> None:
    client = oai(cluster)
    whole = client.completions.create(model="private", prompt=PROMPT, max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(
        model="private", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1
    # Without include_usage no chunk carries usage.
    plain = list(client.completions.create(model=BASE, prompt=PROMPT, max_tokens=3,
                                           stream=True, temperature=0))
    assert plain and all(c.usage is None and c.choices for c in plain)


def test_stream_events_end_with_two_newlines_as_vllm_clients_split_them(
        cluster: Cluster) -> None:
    # vLLM's benchmark client (`vllm bench serve`) splits a stream's bytes on "\n\n" only;
    # with "\r\n\r\n" events, two that arrived in one read were never parsed again.
    body = {"model": "private", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    r = httpx.post(f"{cluster.http_url}/v1/completions", json=body, timeout=30,
                   headers={"Authorization": f"Bearer {ACME}"})
    assert r.status_code == 200 and "\r" not in r.text
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"]
               ) == 12  # every token's event parsed, none lost in the buffer
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_streaming_a_list_of_prompts_interleaves_their_choices(cluster: Cluster) -> None:
    client = oai(cluster)
    prompts = ["first prompt", "the second one", "third"]
    whole = client.completions.create(model="private", prompt=prompts, max_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True})
    texts = ["", "", ""]
    finished = []
    for chunk in client.completions.create(model="private", prompt=prompts, max_tokens=6,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.append(choice.index)
        usage = chunk.usage
    assert texts == [c.text for c in whole.choices] and sorted(finished) == [0, 1, 2]
    assert usage is not None and usage.completion_tokens == 18


def test_logprobs_stop_and_seed(cluster: Cluster) -> None:
    client = oai(cluster)
    got = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    for token, top in zip(lp.tokens or [], lp.top_logprobs):
        assert max(top, key=lambda t: top[t]) == token

    text = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text[4:6]
    assert stop and stop in text
    stopped = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=16,
                                        temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == text[:text.index(stop)]

    def sampled(seed: int) -> str:
        return client.completions.create(
            model="private", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True}).choices[0].text

    assert sampled(7) == sampled(7)
    assert len({sampled(s) for s in (1, 2, 3)}) > 1


def test_models_are_the_base_and_the_callers_own_adapters(cluster: Cluster) -> None:
    acme = {m.id: m for m in oai(cluster, ACME).models.list()}
    assert set(acme) == {BASE, "private", "private@1", "private@2"}
    assert all(m.owned_by == "acme" and m.model_extra == {"root": m.id, "parent": BASE}
               for name, m in acme.items() if name != BASE)
    assert [m.id for m in oai(cluster, GLOBEX).models.list()] == [BASE]
    assert oai(cluster, ACME).models.retrieve("private@2").id == "private@2"
    with pytest.raises(openai.NotFoundError):
        oai(cluster, GLOBEX).models.retrieve("private@2")


def error_of(fn: object, *args: object, **kwargs: object) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        fn(*args, **kwargs)  # type: ignore[operator]
    return info.value


def test_keys_and_unknown_models(cluster: Cluster) -> None:
    exc = error_of(oai(cluster, "not-a-key").completions.create, model=BASE, prompt="hi",
                   max_tokens=2)
    assert isinstance(exc, openai.AuthenticationError) and exc.status_code == 401
    assert isinstance(error_of(oai(cluster, "not-a-key").models.list),
                      openai.AuthenticationError)
    r = httpx.post(f"{cluster.http_url}/v1/completions", json={"model": BASE, "prompt": "hi"})
    assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
    # Another tenant's adapter and a missing one: the same 404, the same body.
    bodies = []
    for model in ("private", "nothing-here"):
        exc = error_of(oai(cluster, GLOBEX).completions.create, model=model, prompt="hi",
                       max_tokens=2)
        assert isinstance(exc, openai.NotFoundError)
        bodies.append(json.dumps(exc.body).replace(model, "X"))
    assert bodies[0] == bodies[1]
    assert isinstance(error_of(oai(cluster, ACME).completions.create, model="private@9",
                               prompt="hi", max_tokens=2), openai.NotFoundError)


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"n": 0}, "n"), ({"n": 65}, "n"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"min_p": 2}}, "min_p"),
    ({"echo": True}, "echo"), ({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix"),
    ({"max_tokens": 10**6}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"stop": ["s"] * 17}, "stop"), ({"logprobs": 21}, "logprobs"),
    ({"extra_body": {"nonsense": 1}}, "nonsense"),
    ({"extra_body": {"max_tokens": "ten"}}, "max_tokens"),
    ({"extra_body": {"seed": True}}, "seed"),
    ({"extra_body": {"prompt": ""}}, "prompt"),
    ({"extra_body": {"model": "bad name!"}}, "model"),
    # numbers the gRPC wire below cannot carry (uint32 / uint64 fields): 400, not a 500
    ({"extra_body": {"prompt": [5, -1]}}, "prompt"),
    ({"extra_body": {"prompt": [[5], [2**32]]}}, "prompt"),
    ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids"),
    ({"extra_body": {"seed": -1}}, "seed"), ({"extra_body": {"seed": 2**64}}, "seed"),
    ({"logit_bias": {str(2**32): 1}}, "logit_bias"),
    ({"extra_body": {"min_tokens": -1}}, "min_tokens"), ({"extra_body": {"top_k": -1}}, "top_k"),
    ({"extra_body": {"max_tokens": 2**32}}, "max_tokens"),
])
def test_bad_parameters_are_400_naming_them(cluster: Cluster, kwargs: dict[str, object],
                                            param: str) -> None:
    exc = error_of(oai(cluster).completions.create, **{"model": BASE, "prompt": "hi",
                                                       "max_tokens": 2, **kwargs})
    assert isinstance(exc, openai.BadRequestError), exc
    assert isinstance(exc.body, dict) and exc.body["param"] == param, exc.body
    assert exc.body["message"].startswith(param) or param in exc.body["message"]
    assert exc.type == "invalid_request_error"


def test_n_choices_are_parallel_samples(cluster: Cluster) -> None:
    client = oai(cluster)
    # Greedy: n equal choices, each what one request gives.
    one = client.completions.create(model=BASE, prompt="The fox", max_tokens=6, temperature=0)
    many = client.completions.create(model=BASE, prompt="The fox", max_tokens=6, temperature=0,
                                     n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert {c.text for c in many.choices} == {one.choices[0].text}
    assert many.usage is not None and many.usage.completion_tokens == 18
    assert many.usage.prompt_tokens == one.usage.prompt_tokens  # type: ignore[union-attr]
    # Seeded: choice i draws as a single request seeded seed + i; two prompts number their
    # choices prompt * n + i.
    drawn = client.completions.create(model=BASE, prompt=["ab", "cd"], max_tokens=5,
                                      temperature=1.0, seed=40, n=2)
    texts = {c.index: c.text for c in drawn.choices}
    for p, prompt in enumerate(["ab", "cd"]):
        for i in range(2):
            alone = client.completions.create(model=BASE, prompt=prompt, max_tokens=5,
                                              temperature=1.0, seed=40 + i)
            assert texts[p * 2 + i] == alone.choices[0].text
    # Streamed chat: each choice's deltas carry its index, each ends with its reason.
    stream = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4,
        temperature=1.0, seed=7, n=2, stream=True, stream_options={"include_usage": True})
    text: dict[int, str] = {0: "", 1: ""}
    reasons: dict[int, str] = {}
    usage = None
    for event in stream:
        for c in event.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
        usage = event.usage or usage
    assert set(reasons) == {0, 1} and usage is not None and usage.completion_tokens <= 8
    whole = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4,
        temperature=1.0, seed=7, n=2)
    assert [c.message.content for c in whole.choices] == [text[0], text[1]]


def test_sampling_controls_reach_the_engine(cluster: Cluster) -> None:
    client = oai(cluster)
    # The demo model's tokens 0..255 are bytes: a +100 bias on "A" makes every token "A".
    forced = client.completions.create(model=BASE, prompt="hi", max_tokens=4, temperature=0,
                                       logit_bias={str(ord("A")): 100})
    assert forced.choices[0].text == "AAAA"
    chat = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3,
        temperature=0, logit_bias={str(ord("z")): 100})
    assert chat.choices[0].message.content == "zzz"
    # min_tokens holds off the end of the turn; penalties are accepted and bounded.
    held = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=6,
        temperature=0, presence_penalty=1.0, frequency_penalty=0.5,
        extra_body={"min_tokens": 6, "repetition_penalty": 1.2, "min_p": 0.05})
    assert held.usage is not None and held.usage.completion_tokens == 6


def post(cluster: Cluster, path: str, content: bytes, key: str = ACME) -> httpx.Response:
    return httpx.post(f"{cluster.http_url}{path}", content=content, timeout=30,
                      headers={"Authorization": f"Bearer {key}",
                               "Content-Type": "application/json"})


def test_bad_json_deep_json_and_big_bodies(cluster: Cluster) -> None:
    for body in (b"{not json", b"[1, 2]", b"\xff\xfe", b'{"model": "tiny", "prompt": "hi",'):
        r = post(cluster, "/v1/completions", body)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param",
                                                                   "code"}
    deep = b'{"model": "tiny", "prompt": "hi", "user": ' + b"[" * 40 + b"]" * 40 + b"}"
    r = post(cluster, "/v1/completions", deep)
    assert r.status_code == 400 and f"{MAX_JSON_DEPTH} levels" in r.json()["error"]["message"]
    huge = b'{"model": "tiny", "prompt": "' + b"a" * (2 << 20) + b'"}'
    r = post(cluster, "/v1/completions", huge)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt: ")
    # A body declared over the gRPC message bound is refused before it is read.
    host, port = cluster.http_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
                     f"{ACME}\r\nContent-Length: {1 << 30}\r\n\r\n{{}}".encode())
        assert sock.recv(64).startswith(b"HTTP/1.1 413 ")


def test_quota_is_429_with_retry_after(cluster: Cluster) -> None:
    client = oai(cluster, TIGHT)
    # The first pays ~104 tokens (settled to its usage: all 100 tokens, no early EOS).
    client.completions.create(model=BASE, prompt="hi", max_tokens=100,
                              extra_body={"ignore_eos": True})
    exc = error_of(client.completions.create, model=BASE, prompt="hi", max_tokens=100)
    assert isinstance(exc, openai.RateLimitError)
    assert int(exc.response.headers["retry-after"]) >= 1
    assert "tokens_per_minute" in exc.message


def test_chat_validation(cluster: Cluster) -> None:

    client = oai(cluster)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for kwargs, param in (({"n": 0}, "n"), ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {}}}]}, "tool_choice"),
            ({"response_format": {"type": "yaml"}}, "response_format.type"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"top_logprobs": 2}, "top_logprobs"),
            ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
            ({"messages": [{"role": "user"}]}, "messages[0].content"),
            ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
             "messages[0].tool_calls"),
            ({"messages": []}, "messages"),
            ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens")):
        exc = error_of(client.chat.completions.create, **{
            "model": BASE, "messages": messages, **kwargs})
        assert isinstance(exc, openai.BadRequestError) and isinstance(exc.body, dict)
        assert exc.body["param"] == param, exc.body
    exc = error_of(client.chat.completions.create, model=BASE, max_completion_tokens=4,
                   messages=[{"role": "wizard", "content": "hi"}])
    assert isinstance(exc, openai.BadRequestError) and "messages[0].role" in exc.message
    reply = client.chat.completions.create(model=BASE, messages=messages,  # type: ignore
                                           max_completion_tokens=4)
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    # OpenAI's "developer" role is a system message to the chat template.
    reply = client.chat.completions.create(
        model=BASE, max_completion_tokens=4,
        messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert reply.choices[0].message.role == "assistant"


def worker_cancelled(cluster: Cluster, tenant: str = "acme") -> float:
    value = cluster.workers[0].registry.get_sample_value(
        "loraplex_worker_requests_total", {"tenant": tenant, "code": "CANCELLED"})
    return value or 0.0


def test_a_client_that_disconnects_mid_stream_frees_its_pages(cluster: Cluster) -> None:
    baseline = cluster.wait_idle()
    cancelled = worker_cancelled(cluster)
    stream = oai(cluster).completions.create(model="private", prompt="cancel me",
                                             max_tokens=1500, stream=True,
                                             extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    # the request holds pages: KV ones, or full blocks already registered in the prefix cache
    # (counted as prefix pages: at a page boundary every page it holds may be one of those)
    during = cluster.stats()
    assert during.num_running == 1
    assert during.pages.num_kv > 0 or during.pages.num_prefix > baseline.pages.num_prefix
    stream.close()
    after = cluster.wait_idle(timeout=3.0)
    assert after.pages.num_kv == baseline.pages.num_kv == 0
    wait_for(lambda: worker_cancelled(cluster) == cancelled + 1, 3.0, "the worker's abort")


def test_a_client_that_gives_up_on_a_whole_response_frees_its_pages(cluster: Cluster) -> None:
    cluster.wait_idle()
    cancelled = worker_cancelled(cluster)
    with pytest.raises(openai.APITimeoutError):
        oai(cluster, timeout=0.5).completions.create(model=BASE, prompt="wait for me",
                                                     max_tokens=1500,
                                                     extra_body={"ignore_eos": True})
    cluster.wait_idle(timeout=3.0)
    wait_for(lambda: worker_cancelled(cluster) == cancelled + 1, 3.0, "the worker's abort")


def test_health(cluster: Cluster) -> None:
    r = httpx.get(f"{cluster.http_url}/health", timeout=5)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_no_worker_is_503_draining_is_503_and_deadline_is_504(model_dir: Path,
                                                              tmp_path: Path) -> None:
    lonely = Cluster(model_dir, tmp_path / "a", num_workers=0, extra_workers=("127.0.0.1:9",),
                     gateway={"http_port": 0})
    try:
        assert httpx.get(f"{lonely.http_url}/health", timeout=5).status_code == 503
        exc = error_of(oai(lonely, "unused").completions.create, model="base", prompt="hi")
        assert isinstance(exc, openai.InternalServerError) and exc.status_code == 503
    finally:
        lonely.close()
    slow = Cluster(model_dir, tmp_path / "b", gateway={"http_port": 0,
                                                       "http_timeout_seconds": 0.3})
    try:
        with pytest.raises(openai.InternalServerError) as info:
            oai(slow, "unused").completions.create(model="base", prompt="slow", max_tokens=1500,
                                             extra_body={"ignore_eos": True})
        assert info.value.status_code == 504
        slow.wait_idle(timeout=3.0)
        slow.loop.run(slow.gateway.generation.drain(0.0))  # draining, as after SIGTERM
        assert httpx.get(f"{slow.http_url}/health", timeout=5).status_code == 503
        exc = error_of(oai(slow, "unused").completions.create, model="base", prompt="hi")
        assert exc.status_code == 503
    finally:
        slow.close()


def test_grpc_still_serves_beside_http(cluster: Cluster) -> None:
    with Client(cluster.address, api_key=ACME) as client:
        assert client.generate("hi", "private", max_tokens=3).usage.completion_tokens == 3


def tokenizer_call(cluster: Cluster, path: str, body: dict, key: str = ACME) -> httpx.Response:
    return post(cluster, path, json.dumps(body).encode(), key)


def test_tokenize_gives_the_ids_generation_sees(cluster: Cluster) -> None:
    text = PROMPT + " \u00e9t\u00e9"  # two-byte characters: each is two byte tokens
    r = tokenizer_call(cluster, "/tokenize", {"model": BASE, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == [BOS, *text.encode()]  # as a completion's prompt: BOS first
    assert body["count"] == len(body["tokens"]) and body["token_strs"] is None
    assert body["max_model_len"] == cluster.workers[0].engine.max_model_len
    got = oai(cluster).completions.create(model=BASE, prompt=text, max_tokens=1)
    assert got.usage is not None and got.usage.prompt_tokens == body["count"]
    # vLLM's benchmark client asks without special tokens, and for an adapter the same ids
    # as for the base model; no model at all is the base model
    for model in ("private", "private@1", None):
        plain = tokenizer_call(cluster, "/tokenize", {
            **({"model": model} if model else {}), "prompt": text, "add_special_tokens": False})
        assert plain.status_code == 200 and plain.json()["tokens"] == list(text.encode())
    empty = tokenizer_call(cluster, "/tokenize", {"prompt": "", "add_special_tokens": False})
    assert empty.json()["tokens"] == [] and empty.json()["count"] == 0
    # each token's vocabulary string, as vLLM returns them (transformers' own lookup)
    vocab = AutoTokenizer.from_pretrained(cluster.model_dir)
    for req in ({"prompt": text}, {"messages": [{"role": "user", "content": text}]}):
        strs = tokenizer_call(cluster, "/tokenize", {**req, "return_token_strs": True}).json()
        assert strs["token_strs"] == vocab.convert_ids_to_tokens(strs["tokens"])
        assert len(strs["token_strs"]) == strs["count"] > len(text)
        assert strs["token_strs"][0] in ("<s>", "<|im_start|>")  # BOS, the template's first


def test_tokenize_renders_messages_as_a_chat_and_detokenize_reads_them_back(
        cluster: Cluster) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = tokenizer_call(cluster, "/tokenize", {"model": BASE, "messages": messages})
    assert r.status_code == 200, r.text
    rendered = cluster.workers[0].engine.tokenizer.apply_chat_template(messages)
    assert r.json()["tokens"] == rendered
    assert rendered[0] == IM_START and rendered[-1] == ord("\n")
    back = tokenizer_call(cluster, "/detokenize", {"model": BASE, "tokens": rendered})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": "<|im_start|>system\nBe brief.<|im_end|>\n"
                                     "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"}
    word = tokenizer_call(cluster, "/detokenize", {"tokens": [*"caf\u00e9".encode()]})
    assert word.json() == {"prompt": "caf\u00e9"}


def test_tokenizer_endpoints_refuse_what_they_cannot_serve(cluster: Cluster) -> None:
    vocab = cluster.workers[0].engine.model_config.vocab_size
    cases = [
        ("/detokenize", {"tokens": [65, vocab]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": [65, -1]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": [2**32]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": "65"}, 400, "tokens"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400,
         "prompt"),
        ("/tokenize", {"model": BASE}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "return_token_strs": "yes"}, 400, "return_token_strs"),
        ("/tokenize", {"messages": [{"role": "user", "content": "b"}],
                       "add_generation_prompt": False}, 400, "add_generation_prompt"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, 400,
         "messages[0].role"),
        ("/tokenize", {"prompt": "a", "temperature": 0}, 400, "temperature"),
        ("/tokenize", {"model": "nothing-here", "prompt": "a"}, 404, "model"),
    ]
    for path, body, status, param in cases:
        r = tokenizer_call(cluster, path, body)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param or error["message"].startswith(param), (body, error)
    # the key first: no key is 401 whatever the body, another tenant's adapter a 404
    assert tokenizer_call(cluster, "/tokenize", {"prompt": "a"}, "not-a-key").status_code == 401
    assert tokenizer_call(cluster, "/detokenize", {"tokens": [1]}, "x").status_code == 401
    assert tokenizer_call(cluster, "/tokenize", {"model": "private", "prompt": "a"},
                          GLOBEX).status_code == 404


def doc_curl_commands() -> list[str]:
    """The shell commands of the curl block in docs/service.md's OpenAI section."""
    doc = (REPO / "docs" / "service.md").read_text()
    section = doc.split("## OpenAI HTTP API", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands, current = [], ""
    for line in block.splitlines():
        current += line + "\n"
        if not line.endswith("\\") and current.count("'") % 2 == 0:
            commands.append(current.strip())
            current = ""
    return [c for c in commands if c and not c.startswith(("export ", "#"))]


def test_serve_prints_the_url_and_the_docs_curl_examples_work(tmp_path: Path) -> None:
    """``loraplex serve --model demo`` in a subprocess; every curl line of the docs runs
    against it unchanged (the URL and key through the variables the docs export)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplex.server.cli", "serve", "--model", "demo", "--port", "0",
         "--http-port", "0", "--metrics-port", "-1", "--num-pages", "128",
         "--store", f"fs:{tmp_path / 'store'}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = read_line(proc, "loraplex serving ", 120).split(" on ", 1)[1].split(" ")[0]
        url = read_line(proc, "OpenAI HTTP API: ", 10).split()[3].removesuffix("/v1")
        with Client(address) as client:
            adapter = write_demo_adapter(tmp_path / "lora", "demo")
            client.upload_adapter(adapter, "mylora")
        commands = doc_curl_commands()
        assert len(commands) >= 5 and all(c.startswith("curl ") for c in commands)
        env = {**os.environ, "LORAPLEX_HTTP_URL": url, "LORAPLEX_API_KEY": "none"}
        for command in commands:
            done = subprocess.run(["bash", "-c", command], env=env, capture_output=True,
                                  text=True, timeout=60)
            assert done.returncode == 0, (command, done.stderr)
            if " -sN " in command:  # a stream: JSON events, then [DONE]
                events = [line.removeprefix("data: ") for line in done.stdout.splitlines()
                          if line.startswith("data: ")]
                assert events[-1] == "[DONE]" and len(events) >= 3, done.stdout
                assert 1 <= json.loads(events[-2])["usage"]["completion_tokens"] <= 8
            else:
                reply = json.loads(done.stdout)
                assert "error" not in reply, (command, reply)
                if "/v1/models" in command:
                    assert {m["id"] for m in reply["data"]} == {"demo", "mylora", "mylora@1"}
                if "logprobs" in command:
                    assert len(reply["choices"][0]["logprobs"]["top_logprobs"][0]) == 2
                if "/detokenize" in command:
                    assert reply == {"prompt": "Hi"}
                elif "/tokenize" in command:  # the demo's byte tokenizer: BOS, then bytes
                    assert reply["tokens"] == [BOS, *b"Hi there"]
                    assert reply["count"] == 9 and reply["max_model_len"] > 9
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(30) == 0
        finally:
            proc.kill()
