"""The router's policy as a pure function of worker snapshots (no gRPC, no clock)."""

from __future__ import annotations

import random
from collections import Counter

from loraplex.server.router import (
    AFFINITY,
    HOST_CACHED,
    LEAST_LOADED,
    RESIDENT,
    SPILL,
    WorkerSnapshot,
    load_cap,
    rendezvous_score,
    route,
)

WORKERS = [WorkerSnapshot(f"10.0.0.{i}:50061") for i in range(4)]
DIGESTS = [f"{i:064x}" for i in range(400)]


def first_choice(digest: str, workers: list[WorkerSnapshot]) -> str:
    return max(workers, key=lambda w: rendezvous_score(digest, w.address)).address


def test_idle_workers_get_each_digest_on_its_first_choice_and_spread_evenly() -> None:
    picks = Counter()
    for d in DIGESTS:
        r = route(d, WORKERS)
        assert r.decision == AFFINITY
        assert r.addresses[0] == first_choice(d, WORKERS)
        assert sorted(r.addresses) == sorted(w.address for w in WORKERS)
        picks[r.addresses[0]] += 1
    assert all(70 <= n <= 130 for n in picks.values()), picks  # ~100 each


def test_the_same_digest_always_goes_to_the_same_worker() -> None:
    shuffled = random.Random(0).sample(WORKERS, len(WORKERS))
    for d in DIGESTS[:50]:
        assert route(d, WORKERS).addresses[0] == route(d, shuffled).addresses[0]


def test_removing_a_worker_moves_only_its_digests() -> None:
    before = {d: route(d, WORKERS).addresses[0] for d in DIGESTS}
    gone = WORKERS[1].address
    after = {d: route(d, [w for w in WORKERS if w.address != gone]).addresses[0]
             for d in DIGESTS}
    for d in DIGESTS:
        if before[d] != gone:
            assert after[d] == before[d]


def test_resident_worker_preferred_over_first_choice() -> None:
    d = DIGESTS[0]
    home = first_choice(d, WORKERS)
    other = next(w for w in WORKERS if w.address != home)
    workers = [WorkerSnapshot(w.address, resident=frozenset({d}) if w is other else frozenset())
               for w in WORKERS]
    r = route(d, workers)
    assert (r.addresses[0], r.decision) == (other.address, RESIDENT)
    host = [WorkerSnapshot(w.address, host_cached=frozenset({d}) if w is other else frozenset())
            for w in WORKERS]
    r = route(d, host)
    assert (r.addresses[0], r.decision) == (other.address, HOST_CACHED)


def test_spill_when_the_first_choice_is_overloaded() -> None:
    d = DIGESTS[1]
    home = first_choice(d, WORKERS)
    # The first choice holds the adapter but carries far more than its share.
    workers = [WorkerSnapshot(w.address, num_running=20 if w.address == home else 2,
                              resident=frozenset({d}) if w.address == home else frozenset())
               for w in WORKERS]
    r = route(d, workers, load_factor=1.25)
    assert r.decision == SPILL
    assert r.addresses[0] != home
    assert r.addresses[-1] == home  # still a last resort for retries
    # The spill goes to the digest's next choice among the workers within the bound.
    rest = [w for w in WORKERS if w.address != home]
    assert r.addresses[0] == first_choice(d, rest)


def test_mild_imbalance_keeps_affinity() -> None:
    d = DIGESTS[2]
    home = first_choice(d, WORKERS)
    workers = [WorkerSnapshot(w.address, num_running=3 if w.address == home else 2)
               for w in WORKERS]
    assert route(d, workers).addresses[0] == home


def test_inflight_counts_toward_load() -> None:
    d = DIGESTS[3]
    home = first_choice(d, WORKERS)
    workers = [WorkerSnapshot(w.address, inflight=30 if w.address == home else 0)
               for w in WORKERS]
    assert route(d, workers).decision == SPILL


def test_bounded_load_never_leaves_a_request_without_a_worker() -> None:
    rng = random.Random(1)
    for _ in range(500):
        n = rng.randint(1, 6)
        workers = [WorkerSnapshot(f"w{i}:1", queue_depth=rng.randint(0, 9),
                                  num_running=rng.randint(0, 40), inflight=rng.randint(0, 9))
                   for i in range(n)]
        factor = rng.choice([1.0, 1.1, 1.25, 2.0])
        cap = load_cap((w.load for w in workers), factor)
        r = route(rng.choice(DIGESTS), workers, load_factor=factor)
        best = next(w for w in workers if w.address == r.addresses[0])
        assert best.load + 1 <= cap
        assert best.load + 1 <= factor * (sum(w.load for w in workers) + 1) / n + 1


def test_full_unhealthy_and_tried_workers_are_skipped() -> None:
    d = DIGESTS[4]
    home = first_choice(d, WORKERS)
    full = [WorkerSnapshot(w.address, queue_depth=4, max_queue=4) if w.address == home else w
            for w in WORKERS]
    assert home not in route(d, full).addresses
    down = [WorkerSnapshot(w.address, healthy=False) if w.address == home else w
            for w in WORKERS]
    assert home not in route(d, down).addresses
    assert home not in route(d, WORKERS, exclude=frozenset({home})).addresses
    all_full = [WorkerSnapshot(w.address, queue_depth=1, max_queue=1) for w in WORKERS]
    assert route(d, all_full).addresses == () and route(d, all_full).decision == "full"
    none = [WorkerSnapshot(w.address, healthy=False) for w in WORKERS]
    assert route(d, none).decision == "none"


def test_base_model_goes_to_the_least_loaded_worker() -> None:
    workers = [WorkerSnapshot(w.address, num_running=i + 1) for i, w in enumerate(WORKERS)]
    workers[2] = WorkerSnapshot(workers[2].address, num_running=0)
    r = route(None, workers)
    assert (r.addresses[0], r.decision) == (workers[2].address, LEAST_LOADED)


def test_requests_ended_since_the_status_do_not_count() -> None:
    d = DIGESTS[5]
    home = first_choice(d, WORKERS)
    # The Status still counts 6 running on the first choice, but all 6 have ended since.
    stale = [WorkerSnapshot(w.address, num_running=6, ended=6) if w.address == home else w
             for w in WORKERS]
    assert route(d, stale).decision == AFFINITY
    busy = [WorkerSnapshot(w.address, num_running=6) if w.address == home else w
            for w in WORKERS]
    assert route(d, busy).decision == SPILL


def test_placement_follows_the_stable_worker_id_not_the_address() -> None:
    # A StatefulSet pod that restarts on a new IP keeps its name, and so its adapters.
    before = [WorkerSnapshot(f"10.0.0.{i}:50061", worker_id=f"worker-{i}") for i in range(4)]
    after = [WorkerSnapshot(f"10.9.9.{i}:50061", worker_id=f"worker-{i}") for i in range(4)]
    for n in range(50):
        digest = f"{n:064x}"
        home_before = route(digest, before).addresses[0]
        home_after = route(digest, after).addresses[0]
        assert home_before.split(".")[-1] == home_after.split(".")[-1]
