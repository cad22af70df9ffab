"""vLLM's router metrics on a worker's /metrics, scraped over HTTP while requests run: queue
depth, running count, KV usage, and the running / waiting / idle adapters by name or digest."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.server.config import WorkerConfig
from loraplex.server.engine.request import SamplingParams
from loraplex.server.worker import WorkerServer, build_engine
from tests.e2e.harness import Cluster, LoopThread, engine_config, wait_for, write_keys

KEYS = {"acme-key-0123456789": ("acme", False)}
ACME = next(iter(KEYS))


def scrape(port: int | None) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples by name: (labels, value) pairs, parsed by prometheus_client's parser."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), s.value))
    return samples


def lora_info(port: int | None) -> tuple[dict[str, str], float]:
    (info,) = scrape(port)["vllm:lora_requests_info"]
    return info


def only_value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    (sample,) = samples[name]
    assert sample[0] == {"model_name": "llama"}  # the model folder's name, as serve's default
    return sample[1]


@pytest.fixture(scope="module")
def named(model_dir: Path, adapter_dirs: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory):
    keys = write_keys(tmp_path_factory.mktemp("keys") / "keys.txt", KEYS)
    c = Cluster(model_dir, tmp_path_factory.mktemp("store"), keys=keys,
                engine={"max_adapters_per_step": 1, "enable_prefix_caching": False},
                worker={"metrics_port": 0, "metrics_adapter_names": True})
    with c.client(ACME) as client:
        for name in ("alpha", "beta"):
            client.upload_adapter(adapter_dirs[name], name)
    yield c
    c.close()


def test_running_waiting_and_idle_adapters_by_name(named: Cluster) -> None:
    port = named.workers[0].metrics_port
    named.wait_idle()
    info = lora_info(port)
    assert info[0] == {"max_lora": "1", "running_lora_adapters": "",
                       "waiting_lora_adapters": ""}
    beta_done: list[int] = []
    with named.client(ACME) as acme:
        alpha = acme.generate_stream("a long one", "alpha", max_tokens=1500, ignore_eos=True)
        next(iter(alpha))  # alpha runs; beta cannot join it (one adapter per step)

        def beta() -> None:
            with named.client(ACME) as other:
                beta_done.extend(t for c in other.generate_stream(
                    "b", "beta@1", params=SamplingParams(max_tokens=4, ignore_eos=True))
                    for t in c.token_ids)

        thread = threading.Thread(target=beta)
        thread.start()
        wait_for(lambda: lora_info(port)[0]["waiting_lora_adapters"] == "acme/beta@1",
                 timeout=10.0, what="beta waiting in vllm:lora_requests_info")
        # Page counts come from the engine's stats snapshot, which lags by up to 50 ms.
        wait_for(lambda: scrape(port)["vllm:kv_cache_usage_perc"][0][1] > 0, timeout=10.0,
                 what="alpha's KV pages in vllm:kv_cache_usage_perc")
        samples = scrape(port)
        (labels, stamp), = samples["vllm:lora_requests_info"]
        assert labels == {"max_lora": "1", "running_lora_adapters": "acme/alpha@1",
                          "waiting_lora_adapters": "acme/beta@1"}
        assert abs(stamp - time.time()) < 60  # a unix time, the scrape's
        assert only_value(samples, "vllm:num_requests_running") == 1
        assert only_value(samples, "vllm:num_requests_waiting") == 1
        assert 0 < only_value(samples, "vllm:kv_cache_usage_perc") <= 1
        (idle_labels, _), = samples["loraplex_worker_idle_lora_adapters_info"]
        assert idle_labels == {"idle_lora_adapters": ""}  # alpha runs: not idle
        alpha.close()  # type: ignore[attr-defined]
        thread.join(timeout=30)
    assert len(beta_done) == 4
    # Both stay resident with no request: idle, under the names of their last requests.
    wait_for(lambda: lora_info(port)[0]["running_lora_adapters"] == ""
             and scrape(port)["vllm:num_requests_running"][0][1] == 0, timeout=10.0,
             what="nothing running")
    samples = scrape(port)
    (idle_labels, _), = samples["loraplex_worker_idle_lora_adapters_info"]
    assert sorted(idle_labels["idle_lora_adapters"].split(",")) == ["acme/alpha@1",
                                                                     "acme/beta@1"]
    assert lora_info(port)[0]["waiting_lora_adapters"] == ""
    assert only_value(samples, "vllm:num_requests_waiting") == 0
    # Idle adapter pages can be evicted for KV at once: they count as free, as in vLLM.
    wait_for(lambda: only_value(scrape(port), "vllm:kv_cache_usage_perc") == 0, timeout=10.0,
             what="no pages held in vllm:kv_cache_usage_perc")


@pytest.fixture(scope="module")
def by_digest(model_dir: Path, adapter_dirs: dict[str, Path],
              tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(model_dir, tmp_path_factory.mktemp("store"), worker={"metrics_port": 0})
    yield c
    c.close()


def test_adapters_are_digests_unless_names_are_enabled(by_digest: Cluster,
                                                       adapter_dirs: dict[str, Path]) -> None:
    port = by_digest.workers[0].metrics_port
    with by_digest.client() as client:
        version = client.upload_adapter(adapter_dirs["gamma"], "gamma")
        stream = client.generate_stream("x", "gamma", max_tokens=1500, ignore_eos=True)
        next(iter(stream))
        wait_for(lambda: lora_info(port)[0]["running_lora_adapters"] == version.digest,
                 timeout=10.0, what="gamma's digest running")
        # uncapped adapters per step: max_lora is the most requests a step runs
        assert lora_info(port)[0]["max_lora"] == "256"
        stream.close()  # type: ignore[attr-defined]
    wait_for(lambda: scrape(port)["loraplex_worker_idle_lora_adapters_info"][0][0]
             == {"idle_lora_adapters": version.digest}, timeout=10.0, what="gamma idle")
    assert "gamma" not in urllib.request.urlopen(
        f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def test_router_metrics_can_be_turned_off(model_dir: Path) -> None:
    loop = LoopThread()
    server = WorkerServer(build_engine(engine_config(model_dir)),
                          WorkerConfig(port=0, metrics_port=0, router_metrics=False))
    try:
        loop.run(server.start())
        samples = scrape(server.metrics_port)
        assert "loraplex_worker_running" in samples
        assert not [name for name in samples if name.startswith("vllm:")]
        assert "loraplex_worker_idle_lora_adapters_info" not in samples
    finally:
        loop.run(server.stop())
        loop.close()
