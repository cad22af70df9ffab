"""One gateway and one worker: generation over real gRPC, bounds, cancellation, deadlines,
health, reflection and metrics."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from loraplex.server.client import AsyncClient, ServiceError
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.llm import LLM
from loraplex.server.engine.request import SamplingParams
from tests.e2e.harness import Cluster, counter_total, engine_config, wait_for

PROMPTS: list[str | list[int]] = ["Hello, world", [5, 17, 99, 3, 200, 41], "tenant"]


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(model_dir, tmp_path_factory.mktemp("store"),
                gateway={"max_tokens_limit": 1500, "max_prompt_bytes": 4096})
    yield c
    c.close()


def worker_requests(cluster: Cluster) -> float:
    return counter_total(cluster.workers[0].registry, "loraplex_worker_requests")


def test_stream_unary_and_offline_engine_agree(cluster: Cluster, model_dir: Path) -> None:
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    offline = LLM(engine=Engine(engine_config(model_dir)))
    with cluster.client() as client:
        for params in (greedy, sampled):
            expected = offline.generate(PROMPTS, params)
            for prompt, want in zip(PROMPTS, expected):
                unary = client.generate(prompt, params=params)
                chunks = list(client.generate_stream(prompt, params=params))
                streamed = [t for c in chunks for t in c.token_ids]
                assert unary.token_ids == streamed == want.token_ids
                assert unary.text == "".join(c.text for c in chunks) == want.text
                assert unary.finish_reason == chunks[-1].finish_reason == "length"
                assert all(c.finish_reason is None for c in chunks[:-1])
                assert chunks[-1].usage == unary.usage
                assert unary.usage.completion_tokens == params.max_tokens
                assert unary.usage.prompt_tokens == len(want.prompt_token_ids)
                assert 0 < unary.timing.ttft_seconds <= unary.timing.total_seconds


def test_logprobs_and_request_id_echo(cluster: Cluster) -> None:
    with cluster.client() as client:
        out = client.generate("abc", max_tokens=4, logprobs=3, request_id="my-id-1")
    assert out.request_id == "my-id-1"
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token and lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0][1] >= lp.top[-1][1]


def test_sampling_controls_over_grpc_agree_with_the_offline_engine(cluster: Cluster,
                                                                   model_dir: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True,
                            min_tokens=2, presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.4, min_p=0.05, logit_bias={3: 4.0, 9: -2.0})
    offline = LLM(engine=Engine(engine_config(model_dir)))
    want = offline.generate(PROMPTS[:2], params)
    with cluster.client() as client:
        for prompt, expected in zip(PROMPTS[:2], want):
            assert client.generate(prompt, params=params).token_ids == expected.token_ids
        forced = client.generate("x", max_tokens=3, logit_bias={77: 100.0})
        assert forced.token_ids == [77, 77, 77]
        vocab = cluster.workers[0].engine.model_config.vocab_size
        with pytest.raises(ServiceError) as info:  # unknown to the model: the worker refuses
            client.generate("x", max_tokens=3, logit_bias={vocab + 5: 1.0})
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.message.startswith("logit_bias:")


def test_prompt_logprobs_over_grpc(cluster: Cluster, model_dir: Path) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    want = LLM(engine=Engine(engine_config(model_dir))).generate(PROMPTS[:2], params)
    with cluster.client() as client:
        for prompt, expected in zip(PROMPTS[:2], want):
            unary = client.generate(prompt, params=params)
            chunks = list(client.generate_stream(prompt, params=params))
            assert len(expected.prompt_logprobs) == len(expected.prompt_token_ids) - 1
            for got in (unary.prompt_logprobs, chunks[0].prompt_logprobs):
                assert [lp.token_id for lp in got] == expected.prompt_token_ids[1:]
                assert [lp.logprob for lp in got] == pytest.approx(
                    [lp.logprob for lp in expected.prompt_logprobs], abs=1e-5)
                assert all(len(lp.top) == 2 for lp in got)
            assert all(c.prompt_logprobs == [] for c in chunks[1:])
        assert client.generate("abc", max_tokens=2).prompt_logprobs == []


def test_async_client_matches_sync(cluster: Cluster) -> None:
    async def run() -> tuple[list[int], list[int]]:
        async with AsyncClient(cluster.address, api_key="") as client:
            unary = await client.generate("async", max_tokens=8, ignore_eos=True)
            streamed = [t async for c in client.generate_stream("async", max_tokens=8,
                                                                 ignore_eos=True)
                        for t in c.token_ids]
            assert await client.health() == "SERVING"
            return unary.token_ids, streamed

    unary, streamed = asyncio.run(run())
    with cluster.client() as client:
        assert unary == streamed == client.generate("async", max_tokens=8,
                                                    ignore_eos=True).token_ids


def unchecked_params(**fields: object) -> SamplingParams:
    """SamplingParams with values the client would refuse, to test the server's checks."""
    params = object.__new__(SamplingParams)
    for k, v in {**SamplingParams().__dict__, **fields}.items():
        object.__setattr__(params, k, v)
    return params


@pytest.mark.parametrize("kwargs, field", [
    ({"prompt": "x" * 5000}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": tuple(f"s{i}" for i in range(17))}, "stop"),
    ({"stop": ("x" * 300,)}, "stop"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"top_p": 0.0}, "top_p"),
    ({"temperature": float("nan")}, "temperature"),
    ({"stop_token_ids": tuple(range(65))}, "stop_token_ids"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_p": float("nan")}, "min_p"),
    ({"logit_bias": {3: 200.0}}, "logit_bias"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
    ({"request_id": "r" * 200}, "request_id"),
    ({"adapter": "Bad Name!"}, "adapter"),
])
def test_gateway_bounds_every_field(cluster: Cluster, kwargs: dict, field: str) -> None:
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", "hi")
    adapter = kwargs.pop("adapter", "")
    request_id = kwargs.pop("request_id", "")
    before = worker_requests(cluster)
    with cluster.client() as client, pytest.raises(ServiceError) as info:
        client.generate(prompt, adapter, params=unchecked_params(**kwargs),
                        request_id=request_id)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith(field) or f"{field}:" in info.value.message
    assert worker_requests(cluster) == before  # refused at the gateway: no worker saw it


def test_over_context_prompt_refused_before_queueing(cluster: Cluster) -> None:
    worker = cluster.workers[0]
    max_len = worker.engine.max_model_len
    with cluster.client() as client, pytest.raises(ServiceError) as info:
        client.generate([7] * (max_len - 10), max_tokens=20)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceed the context" in info.value.message
    assert worker.service.num_active == 0  # type: ignore[union-attr]
    assert not worker.engine.has_unfinished()


def test_unknown_adapter_is_not_found(cluster: Cluster) -> None:
    with cluster.client() as client:
        for ref in ("nope", "nope@3"):
            with pytest.raises(ServiceError) as info:
                client.generate("hi", ref)
            assert info.value.code == grpc.StatusCode.NOT_FOUND
            assert info.value.message == f"adapter {ref!r} not found"


def worker_cancelled(cluster: Cluster) -> float:
    value = cluster.workers[0].registry.get_sample_value(
        "loraplex_worker_requests_total", {"tenant": "default", "code": "CANCELLED"})
    return value or 0.0


def test_cancelling_a_stream_frees_its_pages(cluster: Cluster) -> None:
    baseline = cluster.wait_idle()
    cancelled = worker_cancelled(cluster)
    with cluster.client() as client:
        stream = client.generate_stream("cancel me", max_tokens=1500, ignore_eos=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        # the stream holds pages (as KV, or as full pages already published to the prefix
        # cache: which one depends on timing, so count them by what is no longer free)
        assert cluster.stats().pages.num_free < baseline.pages.num_free
        stream.close()  # type: ignore[attr-defined]
    after = cluster.wait_idle(timeout=3.0)
    assert after.pages.num_free + after.pages.num_prefix >= baseline.pages.num_free
    assert after.pages.num_kv == baseline.pages.num_kv == 0
    assert worker_cancelled(cluster) == cancelled + 1  # aborted, not run to the end


def test_short_deadline_is_deadline_exceeded_and_frees_the_work(cluster: Cluster) -> None:
    cluster.wait_idle()
    cancelled = worker_cancelled(cluster)
    start = time.monotonic()
    with cluster.client(timeout=0.2) as client, pytest.raises(ServiceError) as info:
        list(client.generate_stream("slow", max_tokens=1500, ignore_eos=True))
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 2.0
    cluster.wait_idle(timeout=3.0)
    assert worker_cancelled(cluster) == cancelled + 1


def test_health_reflection_and_metrics(cluster: Cluster) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with cluster.client() as client:
        assert client.health() == "SERVING"
        assert client.health("loraplex.v1.Generation") == "SERVING"
        client.generate("metrics", max_tokens=3)
    for address, want in ((cluster.address, {"loraplex.v1.Generation", "loraplex.v1.Adapters"}),
                          (cluster.workers[0].address, {"loraplex.v1.Worker"})):
        with grpc.insecure_channel(address) as channel:
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert want | {"grpc.health.v1.Health"} <= services
    text = urllib.request.urlopen(
        f"http://127.0.0.1:{cluster.gateway.metrics_port}/metrics", timeout=5).read().decode()
    for series in ("loraplex_gateway_requests_total{code=\"OK\",tenant=\"default\"}",
                   "loraplex_gateway_ttft_seconds_bucket", "loraplex_gateway_itl_seconds_bucket",
                   "loraplex_gateway_e2e_seconds_bucket",
                   "loraplex_router_decisions_total{decision=\"least_loaded\"}",
                   "loraplex_gateway_worker_up"):
        assert series in text, series


def test_full_queues_are_resource_exhausted_at_once(model_dir: Path,
                                                    tmp_path: Path) -> None:
    small = Cluster(model_dir, tmp_path / "store", engine={"max_num_seqs": 1},
                    worker={"max_queue": 1}, gateway={"status_interval": 0.05})
    try:
        service = small.workers[0].service
        assert service is not None
        with small.client() as client:
            running = client.generate_stream("one", max_tokens=1500, ignore_eos=True)
            next(running)
            wait_for(lambda: service.status().num_running == 1, what="one running")
            # The gateway routes on its last Status poll: wait until it, too, sees no queue
            # (a poll from before "one" started running would count it as queued).
            wait_for(lambda: not small.gateway.pool.snapshots()[0].full, what="gateway view")
            waited: list = []
            waiter = threading.Thread(
                target=lambda: waited.extend(client.generate_stream("two", max_tokens=4)))
            waiter.start()
            wait_for(lambda: service.status().queue_depth == 1, what="one waiting")
            with pytest.raises(ServiceError) as info:
                client.generate("three", max_tokens=4)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            # Refused at once, not after a wait in a queue: the 1500-token stream and its
            # waiter are both still where they were (no clock involved).
            assert service.status().num_running == 1 and service.status().queue_depth == 1
            running.close()  # type: ignore[attr-defined]
            waiter.join(10)
            assert waited[-1].finish_reason == "length"  # the queued request then ran
        small.wait_idle(timeout=5)
    finally:
        small.close()
