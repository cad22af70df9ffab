"""Speculative decoding over real gRPC: streamed greedy tokens with ``speculative_method
ngram`` equal an offline engine's without speculation; the worker's metrics count it; each
request's final usage carries its own draft and accepted counts (0 / 0 without speculation)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from loraplex.server.api import Usage
from loraplex.server.config import EngineConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.request import SamplingParams
from tests.e2e.harness import Cluster, wait_for
from tests.e2e.test_prefix import scrape

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
PROMPTS = [[(11 * i + 5 * j) % 200 + 1 for j in range(6 + 3 * i)] * 2 for i in range(6)]


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(model_dir, tmp_path_factory.mktemp("store"),
                engine={"speculative_method": "ngram", "speculative_cost_gate": False},
                worker={"metrics_port": 0})
    yield c
    c.close()


def test_streams_with_speculation_equal_decoding_without(cluster: Cluster,
                                                         model_dir: Path) -> None:
    plain = Engine(EngineConfig(model=str(model_dir), num_pages=256))
    for i, prompt in enumerate(PROMPTS):
        plain.add_request(f"p{i}", prompt, GREEDY)
    expected: dict[str, list[int]] = {f"p{i}": [] for i in range(len(PROMPTS))}
    while plain.has_unfinished():
        for out in plain.step():
            expected[out.request_id].extend(out.new_token_ids)
    got: dict[int, list[int]] = {}

    def stream(i: int) -> None:
        with cluster.client() as c:
            got[i] = [t for chunk in c.generate_stream(PROMPTS[i], params=GREEDY)
                      for t in chunk.token_ids]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [got.get(i) for i in range(len(PROMPTS))] == \
        [expected[f"p{i}"] for i in range(len(PROMPTS))]
    spec = cluster.wait_idle().spec
    assert spec.num_accepted_tokens > 0
    port = cluster.workers[0].metrics_port
    wait_for(lambda: scrape(port).get("loraplex_worker_spec_accepted_tokens_total", 0)
             == spec.num_accepted_tokens)
    samples = scrape(port)
    assert samples["loraplex_worker_spec_proposed_tokens_total"] == spec.num_proposed_tokens
    assert samples["loraplex_worker_spec_acceptance_ratio"] == pytest.approx(
        spec.acceptance_rate)


def _final_usages(cluster: Cluster, prompt: list[int], params: SamplingParams
                  ) -> tuple[Usage, Usage]:
    """The streamed last chunk's usage (only the last chunk has one) and the unary one."""
    with cluster.client() as c:
        chunks = list(c.generate_stream(prompt, params=params))
        unary = c.generate(prompt, params=params)
    assert [ch.usage is not None for ch in chunks].count(True) == 1
    assert chunks[-1].usage is not None
    return chunks[-1].usage, unary.usage


def test_final_usage_counts_the_request_drafts(cluster: Cluster) -> None:
    before = cluster.wait_idle().spec
    usages: list[Usage] = []
    for prompt in PROMPTS:
        usages.extend(_final_usages(cluster, prompt, GREEDY))
    # n = 2, sampled: the drafts of both sequences, summed.
    usages.extend(_final_usages(cluster, PROMPTS[2], SamplingParams(
        max_tokens=24, ignore_eos=True, n=2, temperature=0.7, seed=3)))
    after = cluster.wait_idle().spec
    for u in usages:
        assert 0 <= u.accepted_draft_tokens <= u.draft_tokens
    assert usages[-1].completion_tokens == 48
    # The copy-heavy prompts draft (each is a span repeated); the counts are the engine's own.
    assert sum(u.draft_tokens > 0 for u in usages) >= len(usages) // 2
    assert sum(u.draft_tokens for u in usages) == \
        after.num_proposed_tokens - before.num_proposed_tokens
    assert sum(u.accepted_draft_tokens for u in usages) == \
        after.num_accepted_tokens - before.num_accepted_tokens > 0


def test_final_usage_without_speculation_counts_no_drafts(
        model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    plain = Cluster(model_dir, tmp_path_factory.mktemp("store-off"))
    try:
        for u in _final_usages(plain, PROMPTS[3], GREEDY):
            assert (u.completion_tokens, u.draft_tokens, u.accepted_draft_tokens) == (24, 0, 0)
    finally:
        plain.close()
