"""Prefix caching through the service: cached tokens in usage, hit rates by tenant on the
worker's /metrics, and a re-uploaded adapter that never meets its old pages."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from loraplex.server.commands import write_demo_adapter
from loraplex.server.engine.request import SamplingParams
from tests.e2e.harness import Cluster, wait_for, write_keys

KEYS = {"acme-key-0123456789": ("acme", False), "globex-key-0123456789": ("globex", False)}
ACME, GLOBEX = KEYS
PAGE_SIZE = 16
SYSTEM = [(7 * i + 3) % 250 + 1 for i in range(40)]  # 40 tokens: two full pages and a half
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = write_keys(tmp_path_factory.mktemp("keys") / "keys.txt", KEYS)
    c = Cluster(model_dir, tmp_path_factory.mktemp("store"), keys=keys,
                engine={"page_size": PAGE_SIZE, "enable_prefix_caching": True},
                worker={"metrics_port": 0})
    yield c
    c.close()


def scrape(port: int | None) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_shared_system_prompt_reports_cached_tokens_per_tenant(cluster: Cluster) -> None:
    first, second = SYSTEM + [11, 12], SYSTEM + [21, 22, 23]
    full_pages = len(SYSTEM) // PAGE_SIZE * PAGE_SIZE  # 32: the pages wholly inside SYSTEM
    with cluster.client(ACME) as acme, cluster.client(GLOBEX) as globex:
        assert acme.generate(first, params=GREEDY).usage.cached_tokens == 0
        unary = acme.generate(second, params=GREEDY)
        assert unary.usage.cached_tokens == full_pages
        chunks = list(acme.generate_stream(second, params=GREEDY))
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.cached_tokens == full_pages
        assert [t for c in chunks for t in c.token_ids] == unary.token_ids
        # The same prompt from another tenant: its own cache scope, nothing to reuse.
        theirs = globex.generate(second, params=GREEDY)
        assert theirs.usage.cached_tokens == 0
        assert theirs.token_ids == unary.token_ids  # same base model, same tokens
    # the worker's stats snapshot refreshes on the engine thread: wait until it has both tenants
    wait_for(lambda: 'loraplex_worker_prefix_queried_tokens_total{tenant="globex"}'
             in scrape(cluster.workers[0].metrics_port), what="globex in the worker's metrics")
    metrics = scrape(cluster.workers[0].metrics_port)
    hits = {t: metrics[f'loraplex_worker_prefix_hit_tokens_total{{tenant="{t}"}}']
            for t in ("acme", "globex")}
    queried = {t: metrics[f'loraplex_worker_prefix_queried_tokens_total{{tenant="{t}"}}']
               for t in ("acme", "globex")}
    assert hits == {"acme": 2 * full_pages, "globex": 0}
    assert queried == {"acme": len(first) + 2 * len(second), "globex": len(second)}
    assert metrics['loraplex_worker_prefix_hit_ratio{tenant="acme"}'] == pytest.approx(
        hits["acme"] / queried["acme"])
    assert metrics['loraplex_worker_prefix_hit_ratio{tenant="globex"}'] == 0.0


def test_reupload_never_reuses_old_pages(cluster: Cluster, model_dir: Path,
                                         tmp_path: Path) -> None:
    # Same name, rank and targets; only the weights differ.
    v1_dir, v2_dir = (write_demo_adapter(tmp_path / f"v{i}", str(model_dir), 8,
                                         ("q_proj", "v_proj"), seed=40 + i, std=0.3)
                      for i in (1, 2))
    prompt = SYSTEM + [99]
    with cluster.client(ACME) as acme:
        v1 = acme.upload_adapter(v1_dir, "x")
        old = acme.generate(prompt, "x", params=GREEDY)
        assert acme.generate(prompt, "x", params=GREEDY).usage.cached_tokens == 32  # cached
        v2 = acme.upload_adapter(v2_dir, "x")
        assert (v1.version, v2.version) == (1, 2) and v1.digest != v2.digest
        new = acme.generate(prompt, "x", params=GREEDY)
        assert new.usage.cached_tokens == 0  # a new digest starts a new cache chain
        assert new.token_ids != old.token_ids
        pinned = acme.generate(prompt, "x@1", params=GREEDY)
        assert pinned.token_ids == old.token_ids and pinned.usage.cached_tokens == 32
    # both versions came from the store into the host cache and from there into pool pages
    port = cluster.workers[0].metrics_port
    wait_for(lambda: scrape(port).get("loraplex_worker_adapter_copies_in_total", 0) >= 2,
             what="two adapter copies in the worker's metrics")
    metrics = scrape(port)
    assert metrics["loraplex_worker_adapter_loads_total"] >= 2
    assert metrics["loraplex_worker_adapter_copy_in_seconds_total"] > 0
    cold = Cluster(model_dir, tmp_path / "cold-store")
    try:
        with cold.client() as client:
            client.upload_adapter(v2_dir, "x")
            assert client.generate(prompt, "x", params=GREEDY).token_ids == new.token_ids
    finally:
        cold.close()
