"""Two workers behind one gateway: adapter affinity, draining, and a worker killed mid-run."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from loraplex.server.client import Client, ServiceError
from loraplex.server.router import rendezvous_score
from loraplex.server.wire.stubs import ClientStub
from loraplex.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.harness import Cluster, WorkerProcess, wait_for
from tests.engine.test_fault_isolation import write_huge_adapter


@pytest.fixture(scope="module")
def pair(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(model_dir, tmp_path_factory.mktemp("store"), num_workers=2,
                gateway={"status_interval": 0.05})
    yield c
    c.close()


def decisions(cluster: Cluster) -> dict[str, float]:
    out = {}
    for metric in cluster.gateway.registry.collect():
        if metric.name == "loraplex_router_decisions":
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["decision"]] = sample.value
    return out


def _gateway_loads(cluster: Cluster) -> dict[str, int]:
    # the router's view (WorkerSnapshot.load) of each worker, read on the gateway's loop
    async def loads() -> dict[str, int]:
        return {s.address: s.load for s in cluster.gateway.pool.snapshots()}

    return cluster.loop.run(loads(), timeout=5)


def test_requests_for_one_adapter_go_to_one_worker(pair: Cluster,
                                                   adapter_dirs: dict[str, Path]) -> None:
    with pair.client() as client:
        digests = {name: client.upload_adapter(path, name).digest
                   for name, path in adapter_dirs.items()}
        with ThreadPoolExecutor(2) as pool:
            for _ in range(4):
                for name in digests:
                    # Two at a time: a little load must not move an adapter. Each pair once the
                    # gateway's view of the load (a Status poll behind) agrees with the
                    # workers': a poll answered just before the last pair ended could leave a
                    # stale request counted on the home worker, pushing one of these off it.
                    wait_for(lambda: _gateway_loads(pair) == {w.address: w.service.num_active
                                                              for w in pair.workers},
                             what="the gateway's view of the workers' load")
                    list(pool.map(lambda i, n=name: client.generate(f"{n} {i}", n,
                                                                    max_tokens=4),
                                  range(2)))
    homes = {}
    for name, digest in digests.items():
        holders = [i for i in range(2) if digest in pair.stats(i).resident_adapters]
        assert len(holders) == 1, f"{name} resident on workers {holders}"
        homes[name] = holders[0]
        assert pair.stats(1 - holders[0]).adapter_loads + pair.stats(holders[0]).adapter_loads \
            == len(set(digests.values()))  # every adapter loaded exactly once
    counts = decisions(pair)
    assert counts.get("spill", 0) == 0, counts
    # Every request went to its adapter's home: resident there, or first choice (affinity), or,
    # when a status report caught the adapter between the worker's host cache and its pages
    # (loaded into the cache, its page copy not yet done), host_cached there: the adapter is
    # on one worker and loaded once (above) either way.
    home_decisions = sum(counts.get(d, 0) for d in ("resident", "affinity", "host_cached"))
    assert home_decisions == 4 * 2 * len(digests), counts
    # The first choice is the rendezvous winner among the two workers, by stable worker id.
    ids = [w.service.worker_id for w in pair.workers]  # type: ignore[union-attr]
    for name, digest in digests.items():
        best = max(range(2), key=lambda i: rendezvous_score(digest, ids[i]))
        assert homes[name] == best


def _warms(cluster: Cluster) -> dict[str, float]:
    return {s.labels["result"]: s.value for m in cluster.gateway.registry.collect()
            if m.name == "loraplex_gateway_adapter_warms"
            for s in m.samples if s.name.endswith("_total")}


def test_an_upload_is_warmed_on_the_worker_its_requests_go_to(pair: Cluster, model_dir: Path,
                                                              tmp_path: Path) -> None:
    path = write_huge_adapter(tmp_path / "warm", model_dir, value=0.01)
    ids = [w.service.worker_id for w in pair.workers]  # type: ignore[union-attr]
    before = _warms(pair)
    with pair.client() as client:
        digest = client.upload_adapter(path, "warm-me").digest
        home = max(range(2), key=lambda i: rendezvous_score(digest, ids[i]))
        # in the home worker's host cache with no request sent; not on the other worker
        wait_for(lambda: digest in pair.stats(home).host_adapters, timeout=30,
                 what="the upload in its worker's host cache")
        assert digest not in pair.stats(home).resident_adapters
        assert digest not in pair.stats(1 - home).host_adapters
        assert pair.stats(home).adapter_warm_loads >= 1
        assert _warms(pair).get("started", 0) == before.get("started", 0) + 1
        loads = pair.stats(home).adapter_loads
        misses = pair.stats(home).host_misses
        # its first request goes there and finds it cached: no second load, no host miss
        assert client.generate("warm", "warm-me", max_tokens=2).usage.completion_tokens == 2
        assert digest in pair.stats(home).resident_adapters
        assert pair.stats(home).adapter_loads == loads
        assert pair.stats(home).host_misses == misses
        # the same weights again (a new version): the worker holds them, nothing starts
        client.upload_adapter(path, "warm-me")
        wait_for(lambda: _warms(pair).get("cached", 0) == before.get("cached", 0) + 1,
                 what="the second upload's prefetch answered")
        assert pair.stats(home).adapter_loads == loads


def test_worker_prefetch_refuses_malformed_digests(pair: Cluster) -> None:
    worker = pair.workers[0]
    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for digests, needle in ((["nope"], "64 lowercase hex"),
                                (["ab" * 32] * 257, "more than 256")):
            with pytest.raises(grpc.RpcError) as info:
                stub.Prefetch(worker_pb2.PrefetchRequest(digests=digests), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in (info.value.details() or "")
        # a well-formed digest the store lacks: started, then failed in the background; the
        # worker serves on
        unknown = "cd" * 32
        reply = stub.Prefetch(worker_pb2.PrefetchRequest(digests=[unknown, unknown]), timeout=10)
        assert reply.started == 1  # a digest named twice starts one load
        wait_for(lambda: not worker.engine.adapters.is_loading(unknown),
                 what="the unknown digest's load to end")
        assert unknown not in pair.stats(0).host_adapters
        assert pair.stats(0).adapter_load_failures >= 1
    with pair.client() as client:
        assert client.generate("still", max_tokens=2).usage.completion_tokens == 2


def test_adapters_follow_their_worker_out_and_back(model_dir: Path, tmp_path: Path,
                                                  adapter_dirs: dict[str, Path]) -> None:
    # A worker that leaves routing hands its adapters to their next choice, warmed there
    # before any request; when it returns they are warmed on it again (here it never lost
    # them: the calls answer "cached").
    c = Cluster(model_dir, tmp_path / "store", num_workers=2, gateway={"status_interval": 0.05})
    try:
        with c.client() as client:
            digests = {client.upload_adapter(path, name).digest
                       for name, path in adapter_dirs.items()}
        ids = [w.service.worker_id for w in c.workers]  # type: ignore[union-attr]
        homes = {d: max(range(2), key=lambda i: rendezvous_score(d, ids[i])) for d in digests}
        for d, home in homes.items():
            wait_for(lambda d=d, home=home: d in c.stats(home).host_adapters, timeout=30,
                     what="each upload warmed on its home")
        leaving = homes[min(digests)]
        theirs = {d for d, home in homes.items() if home == leaving}
        assert not theirs & set(c.stats(1 - leaving).host_adapters)
        cached = _warms(c).get("cached", 0)

        async def lose() -> None:  # as a failed call marks it, until its next Status poll
            c.gateway.pool.mark_unhealthy(c.workers[leaving].address, "transport")

        c.loop.run(lose())
        wait_for(lambda: theirs <= set(c.stats(1 - leaving).host_adapters), timeout=30,
                 what="the leaving worker's adapters warmed on the other")
        wait_for(lambda: c.gateway.pool.num_healthy == 2, what="the worker back")
        wait_for(lambda: _warms(c).get("cached", 0) >= cached + len(theirs), timeout=30,
                 what="its adapters sent back to it")
    finally:
        c.close()


def test_drain_turns_health_not_serving_and_lets_in_flight_finish(pair: Cluster) -> None:
    # the worker drained is alpha's home, so that the drain moves at least one adapter
    ids = [w.service.worker_id for w in pair.workers]  # type: ignore[union-attr]
    alpha = pair.store.resolve("default", "alpha").digest
    home = max(range(2), key=lambda i: rendezvous_score(alpha, ids[i]))
    worker, keep = pair.workers[home], 1 - home
    with pair.client() as client, grpc.insecure_channel(worker.address) as channel:
        worker_health = ClientStub(channel)
        # Base-model requests go to the least-loaded worker: two long streams, one each. The
        # gateway sees a worker's load through its Status polls (status_interval): a poll
        # answered just before a worker took a request, or just before one ended, leaves its
        # view off by one until the next. So each stream starts once that view agrees with
        # the workers (a second stream sent within that window could follow the first).
        streams = []
        for _ in range(2):
            wait_for(lambda: _gateway_loads(pair) == {w.address: w.service.num_active
                                                      for w in pair.workers},
                     what="the gateway's view of the workers' load")
            streams.append(client.generate_stream("long", max_tokens=800, ignore_eos=True))
            assert next(streams[-1]).token_ids
        assert worker.service.num_active == 1  # type: ignore[union-attr]

        digests = {pair.store.resolve("default", n).digest for n in ("alpha", "beta", "gamma")}
        moved = {d for d in digests if d not in pair.stats(keep).host_adapters}
        assert alpha in moved
        started = _warms(pair).get("started", 0)

        # A draining worker: NOT_SERVING, out of the gateway's rotation, in-flight finishes.
        worker_draining = pair.loop.submit(worker.drain(grace_seconds=30))
        wait_for(lambda: worker_health.health() == "NOT_SERVING", what="worker health")
        assert worker_health.health("loraplex.liveness") == "SERVING"  # alive while draining
        wait_for(lambda: pair.gateway.pool.num_healthy == 1, what="gateway drops the worker")
        assert worker.service.num_active == 1  # type: ignore[union-attr]
        # the adapters routed before are warmed on the other worker (their home now) before
        # any request names them
        wait_for(lambda: digests <= set(pair.stats(keep).host_adapters), timeout=30,
                 what="the drained worker's adapters warmed on the other")
        assert _warms(pair).get("started", 0) >= started + len(moved)
        for name in ("alpha", "beta", "gamma"):  # whatever their home, the other serves them
            assert client.generate("after", name, max_tokens=2).usage.completion_tokens == 2

        # A draining gateway: NOT_SERVING, new requests UNAVAILABLE, in-flight finishes.
        gateway_draining = pair.loop.submit(pair.gateway.drain(grace_seconds=30))
        wait_for(lambda: client.health() == "NOT_SERVING", what="gateway health")
        assert client.health("loraplex.liveness") == "SERVING"
        assert pair.gateway.generation.num_active == 2  # both streams are still going
        with pytest.raises(ServiceError) as info:
            client.generate("new", max_tokens=2)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        for stream in streams:
            rest = list(stream)
            assert rest[-1].finish_reason == "length"
            assert sum(len(c.token_ids) for c in rest) == 800 - 1
        gateway_draining.result(15)
        worker_draining.result(15)


@dataclass
class Outcome:
    tokens: int = 0
    code: str = ""
    tokens_at_failure: int = 0
    first_token: threading.Event = field(default_factory=threading.Event)


def test_worker_killed_mid_run(model_dir: Path, tmp_path: Path,
                               adapter_dirs: dict[str, Path]) -> None:
    store = tmp_path / "store"
    # Two requests run at a time on each worker; the rest wait in its queue.
    a = WorkerProcess(model_dir, store, "--max-num-seqs", "2", "--worker-id", "a")
    b = WorkerProcess(model_dir, store, "--max-num-seqs", "2", "--worker-id", "b")
    try:
        addresses = (a.wait_ready(), b.wait_ready())
        # load_factor 50: every request for the adapter stays on its first-choice worker.
        cluster = Cluster(model_dir, store, num_workers=0, extra_workers=addresses,
                          gateway={"load_factor": 50.0, "status_interval": 0.05})
        try:
            wait_for(lambda: cluster.gateway.pool.num_healthy == 2, timeout=10,
                     what="both workers healthy")
            with cluster.client() as client:
                digest = client.upload_adapter(adapter_dirs["alpha"], "alpha").digest
            # hashing is on the stable worker ids ("a", "b"), not the addresses
            victim = a if rendezvous_score(digest, "a") > rendezvous_score(digest, "b") else b
            outcomes = [Outcome() for _ in range(6)]

            def run(out: Outcome) -> None:
                with Client(cluster.address, api_key="", timeout=60) as c:
                    try:
                        for chunk in c.generate_stream("doomed?", "alpha", max_tokens=400,
                                                       ignore_eos=True):
                            out.tokens += len(chunk.token_ids)
                            out.first_token.set()
                        out.code = "OK"
                    except ServiceError as exc:
                        out.code, out.tokens_at_failure = exc.code.name, out.tokens

            threads = [threading.Thread(target=run, args=(o,)) for o in outcomes]
            for t in threads:
                t.start()
                time.sleep(0.02)  # a stable order: the first two run, the rest queue
            wait_for(lambda: sum(o.first_token.is_set() for o in outcomes) >= 2, timeout=20,
                     what="two streams running")
            victim.kill()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads), "a request hangs"
        finally:
            cluster.close()
    finally:
        a.kill()
        b.kill()
    completed = [o for o in outcomes if o.code == "OK"]
    failed = [o for o in outcomes if o.code != "OK"]
    assert len(completed) + len(failed) == len(outcomes)  # nothing lost
    assert all(o.code == "UNAVAILABLE" for o in failed), [o.code for o in failed]
    # Only streams that had sent tokens fail; the queued ones went to the other worker.
    assert all(o.tokens_at_failure > 0 for o in failed)
    assert 1 <= len(failed) <= 2  # at most the two running on the killed worker
    assert len(completed) >= len(outcomes) - 2
    assert all(o.tokens == 400 for o in completed)
