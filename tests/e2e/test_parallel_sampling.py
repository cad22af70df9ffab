"""n > 1 over real gRPC: each sequence's chunks carry its index, usage sums the n, every
sequence ends with its own finish reason, cancelling ends all n, and unary Generate returns
all n."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import grpc
import pytest

from loraplex.server.api import Completion
from loraplex.server.client import AsyncClient, ServiceError
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.llm import LLM
from loraplex.server.engine.request import SamplingParams
from tests.e2e.harness import Cluster, engine_config


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(model_dir, tmp_path_factory.mktemp("store"), gateway={"max_n": 8})
    yield c
    c.close()


def test_stream_of_n_sequences_equals_the_offline_engine(cluster: Cluster,
                                                         model_dir: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=9, n=4, stop_token_ids=(7,),
                            ignore_eos=True)
    prompt = [5, 17, 99, 3, 200, 41, 8]
    offline = LLM(engine=Engine(engine_config(model_dir)))
    want = offline.generate([prompt], params)
    singles = [offline.generate([prompt], dataclasses.replace(params, n=1, seed=9 + i))[0]
               for i in range(4)]
    assert [c.token_ids for c in want] == [c.token_ids for c in singles]
    with cluster.client() as client:
        chunks = list(client.generate_stream(prompt, params=params))
    by_index: dict[int, list[int]] = {i: [] for i in range(4)}
    reasons: dict[int, str] = {}
    for chunk in chunks:
        assert chunk.index not in reasons  # nothing after a sequence's last chunk
        by_index[chunk.index].extend(chunk.token_ids)
        if chunk.finish_reason is not None:
            reasons[chunk.index] = chunk.finish_reason
    assert [by_index[i] for i in range(4)] == [c.token_ids for c in want]
    assert reasons == {i: c.finish_reason for i, c in enumerate(want)}
    assert all(c.usage is None for c in chunks[:-1])
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].timing is not None
    assert usage.prompt_tokens == len(prompt)
    assert usage.completion_tokens == sum(len(c.token_ids) for c in want)
    assert cluster.wait_idle().pages.num_kv == 0


def test_n_is_bounded(cluster: Cluster) -> None:
    with cluster.client() as client:
        for call in (lambda: list(client.generate_stream("hi", max_tokens=2, n=9)),
                     lambda: client.generate("hi", max_tokens=2, n=9)):
            with pytest.raises(ServiceError) as info:
                call()
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.message.startswith("n: 9, over the limit of 8")


def test_unary_generate_returns_all_n_sequences(cluster: Cluster, model_dir: Path) -> None:
    # Unary Generate with n > 1: every sequence in ``sequences`` (index, tokens, text,
    # logprobs, finish reason) equal to the offline engine's, sequence 0 in the top-level
    # fields, usage summed; the asyncio client gets the same.
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=21, n=3, stop_token_ids=(9,),
                            ignore_eos=True, logprobs=2)
    prompt = [11, 4, 250, 33, 7]
    want = LLM(engine=Engine(engine_config(model_dir))).generate([prompt], params)
    with cluster.client() as client:
        got = client.generate(prompt, params=params)
    assert [s.index for s in got.sequences] == [0, 1, 2]
    assert [s.token_ids for s in got.sequences] == [c.token_ids for c in want]
    assert [s.finish_reason for s in got.sequences] == [c.finish_reason for c in want]
    assert len({tuple(s.token_ids) for s in got.sequences}) > 1  # sampled, not copies
    for seq in got.sequences:
        assert [lp.token_id for lp in seq.logprobs] == seq.token_ids
        assert all(len(lp.top) == 2 for lp in seq.logprobs)
    first = got.sequences[0]
    assert (got.token_ids, got.text, got.finish_reason) == (
        first.token_ids, first.text, first.finish_reason)
    assert got.usage.prompt_tokens == len(prompt)
    assert got.usage.completion_tokens == sum(len(c.token_ids) for c in want)

    async def unary_async() -> Completion:
        async with AsyncClient(cluster.address, api_key="", timeout=30) as aclient:
            return await aclient.generate(prompt, params=params)

    assert asyncio.run(unary_async()).sequences == got.sequences
    with cluster.client() as client:  # n = 1: one sequence, the response itself
        single = client.generate(prompt, params=dataclasses.replace(params, n=1))
    assert [(s.index, s.token_ids) for s in single.sequences] == [(0, single.token_ids)]
    assert cluster.wait_idle().pages.num_kv == 0


def test_cancelling_ends_all_n_and_frees_their_pages(cluster: Cluster) -> None:
    baseline = cluster.wait_idle()
    with cluster.client() as client:
        stream = client.generate_stream("cancel us", max_tokens=1000, ignore_eos=True, n=6,
                                        temperature=1.0)
        seen = set()
        for chunk in stream:
            seen.add(chunk.index)
            if len(seen) == 6:
                break
        stream.close()  # type: ignore[attr-defined]
    after = cluster.wait_idle(timeout=5.0)
    assert after.pages.num_kv == baseline.pages.num_kv == 0
    assert after.num_running == 0
