"""An adapter pushed straight to a Redis store (``loraplex adapters push --store redis://...``,
not through a gateway) is warmed on the worker its requests will land on, as an upload is:
the store announces the put and every gateway watching it sends the ``Prefetch``. A
gateway's own upload, announced back to it, is warmed once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.server.cli import main as cli_main
from loraplex.server.commands import write_demo_adapter
from loraplex.server.gateway_warm import ANNOUNCED_DELAY_SECONDS
from loraplex.server.router import rendezvous_score
from tests.e2e.harness import Cluster, wait_for

pytestmark = pytest.mark.redis


@pytest.fixture
def cluster(model_dir: Path, redis_url: str) -> Iterator[Cluster]:
    c = Cluster(model_dir, redis_url, num_workers=2, gateway={"status_interval": 0.05})
    yield c
    c.close()


def _warms(cluster: Cluster) -> dict[str, float]:
    return {s.labels["result"]: s.value for m in cluster.gateway.registry.collect()
            if m.name == "loraplex_gateway_adapter_warms"
            for s in m.samples if s.name.endswith("_total")}


def _home(cluster: Cluster, digest: str) -> int:
    ids = [w.service.worker_id for w in cluster.workers]  # type: ignore[union-attr]
    return max(range(len(ids)), key=lambda i: rendezvous_score(digest, ids[i]))


def test_a_push_to_the_store_is_warmed_on_its_worker(cluster: Cluster, model_dir: Path,
                                                     redis_url: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = write_demo_adapter(tmp_path / "pushed", str(model_dir), 8, seed=5)
    assert cli_main(["adapters", "push", str(path), "--name", "pushed", "--model",
                     str(model_dir), "--store", redis_url, "--quiet", "--json"]) == 0
    digest = cluster.store.resolve("default", "pushed").digest
    assert digest in capsys.readouterr().out
    home = _home(cluster, digest)
    wait_for(lambda: digest in cluster.stats(home).host_adapters, timeout=30,
             what="the pushed adapter in its worker's host cache")
    assert digest not in cluster.stats(1 - home).host_adapters
    warms = _warms(cluster)
    assert (warms.get("started"), warms.get("cached", 0), warms.get("repeat", 0)) == (1, 0, 0)
    loads = cluster.stats(home).adapter_loads
    with cluster.client() as client:
        assert client.generate("hi", "pushed", max_tokens=2).usage.completion_tokens == 2
    assert digest in cluster.stats(home).resident_adapters
    assert cluster.stats(home).adapter_loads == loads  # found cached: no second load


def test_an_upload_through_the_gateway_is_warmed_once(cluster: Cluster, model_dir: Path,
                                                      tmp_path: Path) -> None:
    path = write_demo_adapter(tmp_path / "up", str(model_dir), 8, seed=6)
    with cluster.client() as client:
        digest = client.upload_adapter(path, "up").digest
    home = _home(cluster, digest)
    wait_for(lambda: digest in cluster.stats(home).host_adapters, timeout=30,
             what="the upload in its worker's host cache")
    # the store announced it back to this gateway, which had warmed it just then
    wait_for(lambda: _warms(cluster).get("repeat", 0) == 1, timeout=ANNOUNCED_DELAY_SECONDS + 10,
             what="the upload's announcement")
    warms = _warms(cluster)
    assert (warms.get("started"), warms.get("cached", 0)) == (1, 0)
