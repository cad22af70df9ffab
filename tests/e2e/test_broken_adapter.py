"""One broken adapter among good ones, on a gateway with two workers over a real Redis store:
its requests fail alone (FAILED_PRECONDITION naming it), every other request is served, and
no worker leaves routing."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from loraplex.adapter_store.format import load_adapter
from loraplex.server.client import ServiceError
from loraplex.server.commands import write_demo_adapter
from tests.e2e.harness import Cluster, counter_total, wait_for


def samples(registry: object, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """A counter's ``_total`` samples by label set."""
    return {tuple(sorted(s.labels.items())): s.value
            for m in registry.collect() if m.name == name  # type: ignore[attr-defined]
            for s in m.samples if s.name == f"{name}_total"}


@pytest.fixture
def cluster(model_dir: Path, redis_url: str) -> Iterator[Cluster]:
    c = Cluster(model_dir, redis_url, num_workers=2,
                gateway={"status_interval": 0.05})
    yield c
    c.close()


def test_a_corrupt_adapter_fails_alone(cluster: Cluster, redis_url: str, model_dir: Path,
                                       adapter_dirs: dict[str, Path], tmp_path: Path) -> None:
    broken_dir = write_demo_adapter(tmp_path / "broken", str(model_dir), 8,
                                    ("q_proj", "v_proj"), seed=11, std=0.2)
    with cluster.client() as client:
        for name, path in adapter_dirs.items():
            client.upload_adapter(path, name)
    # Pushed to the store directly, as `loraplex adapters push` does: an upload through the
    # gateway would warm it into a worker's host cache before the damage below (a direct
    # put's announcement is acted on ANNOUNCED_DELAY_SECONDS later: after the damage).
    digest = cluster.store.put("default", "broken", load_adapter(broken_dir, cluster.base)).digest
    # Damage it the way a lost Redis key would: one chunk of its blob gone.
    r = redis.Redis.from_url(redis_url)
    assert r.delete(f"loraplex:blob:{digest}:0") == 1
    r.close()
    assert cluster.gateway.pool.num_healthy == 2

    adapters = [*adapter_dirs, "", "broken"]  # "" is the base model
    jobs = list(itertools.islice(itertools.cycle(adapters), 60))

    def run(adapter: str) -> tuple[str, str, str]:
        try:
            with cluster.client() as c:
                c.generate(f"hello {adapter}", adapter, max_tokens=3)
            return adapter, "OK", ""
        except ServiceError as exc:
            return adapter, exc.code.name, exc.message

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(run, jobs))

    good = [r for r in results if r[0] != "broken"]
    bad = [r for r in results if r[0] == "broken"]
    assert [r for r in good if r[1] != "OK"] == []  # 0 unrelated failures
    assert len(good) == 48 and len(bad) == 12
    for _, code, message in bad:
        assert code == "FAILED_PRECONDITION", message
        assert message.startswith("adapter 'broken': ") and "chunk 0" in message
    # Both workers stayed in routing all along: none was lost, both served requests.
    assert cluster.gateway.pool.num_healthy == 2
    assert all(s.healthy for s in cluster.gateway.pool.snapshots())
    assert counter_total(cluster.gateway.registry, "loraplex_gateway_workers_lost") == 0
    assert counter_total(cluster.gateway.registry, "loraplex_gateway_retries") == 0
    assert all(counter_total(w.registry, "loraplex_worker_requests") > 0
               for w in cluster.workers)
    # The failures are counted by cause at both ends.
    failures = samples(cluster.gateway.registry, "loraplex_gateway_request_failures")
    assert failures == {(("cause", "adapter"), ("code", "FAILED_PRECONDITION")): 12.0}
    on_workers: Counter[tuple[tuple[str, str], ...]] = Counter()
    for w in cluster.workers:
        on_workers.update(samples(w.registry, "loraplex_worker_request_failures"))
    assert dict(on_workers) == {(("cause", "adapter"), ("code", "FAILED_PRECONDITION")): 12}


def test_a_killed_worker_counts_as_lost(cluster: Cluster) -> None:
    """A worker that stops answering is taken out by the transport, and counted."""
    with cluster.client() as client:
        assert client.generate("hi", max_tokens=2).usage.completion_tokens == 2
        cluster.loop.run(cluster.workers[1].stop())
        for i in range(6):  # base-model requests spread by load; the dead one is retried
            assert client.generate(f"hi {i}", max_tokens=2).usage.completion_tokens == 2
    wait_for(lambda: cluster.gateway.pool.num_healthy == 1, timeout=10, what="worker lost")
    lost = samples(cluster.gateway.registry, "loraplex_gateway_workers_lost")
    assert sum(lost.values()) == 1
    assert set(lost) <= {(("reason", "transport"),), (("reason", "unreachable"),)}
