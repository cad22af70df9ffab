"""vLLM's metric names, for inference-aware routers (Gateway API Inference Extension, llm-d).

Those routers pick a model-server pod by scraping its ``/metrics`` for vLLM's series; a worker
exports the same names beside its own ``loraplex_worker_*`` ones (``--no-router-metrics``
turns them off). The semantics follow vLLM v1's ``PrometheusStatLogger``:

- ``vllm:num_requests_waiting{model_name}``: requests admitted, not running (queued).
- ``vllm:num_requests_running{model_name}``: requests in the running batch.
- ``vllm:kv_cache_usage_perc{model_name}``: the fraction (0..1, not percent, as in vLLM) of
  the pool's pages that an allocation could not take now; pages of unpinned cached entries
  (prefix pages no request holds, idle adapters) count as free, as vLLM counts its
  evictable cached blocks.
- ``vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}``: value
  the unix time of the scrape (routers keep the series with the latest value); the adapters
  of running / waiting requests, comma-separated (no spaces), and the most distinct adapters
  one step runs (``--max-adapters-per-step``; uncapped, ``--max-num-seqs``).

Beyond vLLM, the adapters resident in the pool that no request uses have their own series,
``loraplex_worker_idle_lora_adapters_info{idle_lora_adapters}`` (the same shape: the scrape's
unix time, a comma-separated label), kept off vLLM's gauge so that parsers of its three labels
see exactly them.

Adapters are named by digest; with ``--metrics-adapter-names`` by ``tenant/name@version``
(the gateway passes the name down with each request; an idle adapter keeps the name of its
last request).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from loraplex.server.engine.request import Request, RequestStatus
from loraplex.server.engine.stats import EngineStats


class RouterSnapshot(NamedTuple):
    """One worker's state in the routers' terms (adapter labels already chosen)."""

    model_name: str
    num_waiting: int
    num_running: int
    kv_cache_usage: float  # 0..1
    running_adapters: tuple[str, ...]
    waiting_adapters: tuple[str, ...]
    idle_adapters: tuple[str, ...]  # resident in the pool, no request
    max_lora: int


def router_snapshot(model_name: str, stats: EngineStats,
                    requests: Iterable[tuple[Request, str]], idle_names: dict[str, str],
                    max_lora: int) -> RouterSnapshot:
    """The routers' view of one worker.

    Counts and adapter lists come from the same pass over the requests' live states (the
    engine's stats snapshot lags by up to 50 ms), so a request counted as running is the one
    whose adapter is listed as running.

    Args:
        model_name: the ``model_name`` label.
        stats: the engine's latest snapshot (pages, resident digests).
        requests: the admitted requests, each with its adapter's label (unused for the base
            model); a request counts as running once the engine has scheduled it.
        idle_names: digest -> label for resident adapters (a digest missing: itself).
        max_lora: the ``max_lora`` label.
    """
    running: dict[str, None] = {}  # ordered sets: first come, first listed
    waiting: dict[str, None] = {}
    used: set[str] = set()
    num_running = num_waiting = 0
    for req, label in requests:
        if req.finished:
            continue
        is_running = req.status is RequestStatus.RUNNING
        num_running += is_running
        num_waiting += not is_running
        if req.adapter_digest is not None:
            used.add(req.adapter_digest)
            (running if is_running else waiting)[label] = None
    idle = tuple(idle_names.get(d, d) for d in stats.resident_adapters if d not in used)
    p = stats.pages
    usage = (p.num_pages - p.num_free - p.num_evictable) / p.num_pages if p.num_pages else 0.0
    return RouterSnapshot(model_name, num_waiting, num_running, usage, tuple(running),
                          tuple(waiting), idle, max_lora)


class RouterCollector(Collector):
    """Renders ``snapshot()`` (None: nothing yet) in vLLM's names at scrape time."""

    def __init__(self, snapshot: Callable[[], RouterSnapshot | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._snapshot()
        if snap is None:
            return
        for name, doc, value in (
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                 snap.num_waiting),
                ("vllm:num_requests_running", "Number of requests in model execution batches.",
                 snap.num_running),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 snap.kv_cache_usage)):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([snap.model_name], value)
            yield family
        now = time.time()
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        lora.add_metric([str(snap.max_lora), ",".join(snap.running_adapters),
                         ",".join(snap.waiting_adapters)], now)
        yield lora
        idle = GaugeMetricFamily(
            "loraplex_worker_idle_lora_adapters_info", "Adapters resident in the pool that no "
            "request uses, comma-separated; the value is the scrape's unix time",
            labels=["idle_lora_adapters"])
        idle.add_metric([",".join(snap.idle_adapters)], now)
        yield idle


def register_router_metrics(registry: CollectorRegistry,
                            snapshot: Callable[[], RouterSnapshot | None]) -> None:
    """Export vLLM's router series from ``registry`` (see the module docstring)."""
    registry.register(RouterCollector(snapshot))
