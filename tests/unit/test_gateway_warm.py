"""``Warmer``'s handling of the adapter store's announcements, on a real event loop with a
recording worker stub: a bulk push goes out in per-worker batches of at most MAX_PREFETCH
digests, each to the worker its requests will land on; a gateway's own upload announced back
is a repeat (no second call); with no healthy worker nothing is sent."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from prometheus_client import CollectorRegistry

from loraplex.server import gateway_warm
from loraplex.server.gateway_warm import Warmer
from loraplex.server.metrics import GatewayMetrics
from loraplex.server.router import WorkerSnapshot, affinity_worker
from loraplex.server.worker import MAX_PREFETCH


class RecordingStub:
    def __init__(self, address: str, calls: list[tuple[str, tuple[str, ...]]]) -> None:
        self.address = address
        self.calls = calls

    async def prefetch(self, digests: tuple[str, ...], timeout: float | None = None) -> int:
        self.calls.append((self.address, digests))
        return len(digests)


def _digest(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def _warms(metrics: GatewayMetrics) -> dict[str, float]:
    return {s.labels["result"]: s.value for m in metrics.adapter_warms.collect()
            for s in m.samples if s.name.endswith("_total")}


@pytest.fixture(autouse=True)
def _short_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway_warm, "ANNOUNCED_DELAY_SECONDS", 0.05)


def _warmer(workers: list[WorkerSnapshot]) -> tuple[Warmer, list, GatewayMetrics]:
    calls: list[tuple[str, tuple[str, ...]]] = []
    metrics = GatewayMetrics(CollectorRegistry())
    return Warmer(lambda: workers, lambda a: RecordingStub(a, calls), metrics), calls, metrics


def test_a_bulk_push_goes_out_in_batches_to_each_adapters_worker() -> None:
    workers = [WorkerSnapshot("w0:1", worker_id="w0"), WorkerSnapshot("w1:1", worker_id="w1")]
    digests = [_digest(i) for i in range(2 * MAX_PREFETCH + 40)]

    async def run() -> list[tuple[str, tuple[str, ...]]]:
        warmer, calls, metrics = _warmer(workers)
        for d in digests:
            warmer.announced(d)
        warmer.announced(digests[0])  # announced twice: sent once
        await asyncio.sleep(0.3)
        assert _warms(metrics)["started"] == len(digests)
        return calls

    calls = asyncio.run(run())
    sent = [d for _, batch in calls for d in batch]
    assert sorted(sent) == sorted(digests)
    for address, batch in calls:
        assert 0 < len(batch) <= MAX_PREFETCH
        assert all(affinity_worker(d, workers) == address for d in batch)
    per_worker = {a: sum(len(b) for x, b in calls if x == a) for a, _ in calls}
    assert len(calls) == sum(-(-n // MAX_PREFETCH) for n in per_worker.values())


def test_an_upload_announced_back_is_a_repeat() -> None:
    workers = [WorkerSnapshot("w0:1", worker_id="w0"), WorkerSnapshot("w1:1", worker_id="w1")]

    async def run() -> tuple[list, dict[str, float]]:
        warmer, calls, metrics = _warmer(workers)
        warmer.announced(_digest(1))  # the store announces before the upload's handler returns
        warmer.upload(_digest(1))
        warmer.announced(_digest(2))  # someone else's push
        await asyncio.sleep(0.3)
        return calls, _warms(metrics)

    calls, warms = asyncio.run(run())
    assert sorted(d for _, batch in calls for d in batch) == sorted([_digest(1), _digest(2)])
    assert warms["repeat"] == 1 and warms["started"] == 2


def test_with_no_healthy_worker_nothing_is_sent() -> None:
    workers = [WorkerSnapshot("w0:1", healthy=False)]

    async def run() -> list:
        warmer, calls, _ = _warmer(workers)
        warmer.announced(_digest(3))
        await asyncio.sleep(0.3)
        return calls

    assert asyncio.run(run()) == []
