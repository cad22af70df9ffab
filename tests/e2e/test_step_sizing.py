"""An inter-token latency target through the service: with a target no step can meet and
``decode_floor_ratio`` 1 (the target alone), every step computes one minimum prefill chunk
beside its decodes (so a prompt of P tokens takes
ceil(P / min_prefill_chunk) steps), streams still produce the tokens each request produces
alone, and the worker's /metrics show steps measured against the cost model's predictions."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from loraplex.server.engine.request import SamplingParams
from tests.e2e.harness import Cluster, wait_for
from tests.e2e.test_prefix import scrape

CHUNK = 4
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
PROMPTS = [[(13 * i + 7 * j) % 250 + 1 for j in range(10 + 7 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    # 1 microsecond: every step is over it, so each step's prefill is the minimum chunk
    # (ratio 1: no room over the decode floor either)
    c = Cluster(model_dir, tmp_path_factory.mktemp("store"),
                engine={"target_itl_ms": 0.001, "min_prefill_chunk": CHUNK,
                        "decode_floor_ratio": 1.0,
                        "enable_prefix_caching": False},
                worker={"metrics_port": 0})
    yield c
    c.close()


def test_a_prompt_prefills_in_minimum_chunks(cluster: Cluster) -> None:
    before = cluster.wait_idle().num_steps
    prompt = PROMPTS[3]  # 31 tokens
    with cluster.client() as client:
        out = client.generate(prompt, params=GREEDY)
    assert len(out.token_ids) == 5
    steps = cluster.wait_idle().num_steps - before
    assert steps == -(-len(prompt) // CHUNK) + GREEDY.max_tokens - 1


def test_streams_under_a_target_match_each_request_alone(cluster: Cluster) -> None:
    with cluster.client() as client:
        alone = [client.generate(p, params=GREEDY).token_ids for p in PROMPTS]
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
    assert [got.get(i) for i in range(len(PROMPTS))] == alone
    stats = cluster.wait_idle()
    times = stats.step_times
    assert times.num_steps == stats.num_steps
    assert times.num_over_target == times.num_steps  # nothing meets 1 microsecond
    assert times.predicted_seconds > 0  # calibrated at start
    assert len(times.coefficients) == 6
    port = cluster.workers[0].metrics_port
    wait_for(lambda: scrape(port).get("loraplex_worker_steps_over_target_total", 0)
             >= times.num_steps, what="steps over the target in the worker's metrics")
    metrics = scrape(port)
    assert metrics["loraplex_worker_step_seconds_total"] > 0
    assert metrics["loraplex_worker_step_predicted_seconds_total"] > 0
    assert 'loraplex_worker_step_last_seconds{kind="predicted"}' in metrics
