"""n > 1 over real gRPC: each sequence's chunks carry its index, usage sums the n, every
sequence ends with its own finish reason, and cancelling ends all n."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest

from loraplex.server.client import ServiceError
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


def test_n_is_bounded_and_unary_refuses_it(cluster: Cluster) -> None:
    with cluster.client() as client:
        with pytest.raises(ServiceError) as info:
            list(client.generate_stream("hi", max_tokens=2, n=9))
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.message.startswith("n: 9, over the limit of 8")
        with pytest.raises(ServiceError) as info:
            client.generate("hi", max_tokens=2, n=2)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.message.startswith("n: n > 1 needs GenerateStream")


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
