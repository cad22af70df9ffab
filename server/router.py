"""Which worker serves a request: a pure function of the workers' snapshots.

Policy (``route``), for a request naming adapter digest ``d``:

1. Candidates are the healthy workers with room in their queue (``queue_depth < max_queue``)
   that the request has not tried yet. None with room: RESOURCE_EXHAUSTED; none healthy:
   UNAVAILABLE.
2. Load bound (consistent hashing with bounded loads, Mirrokni et al. 2018): a worker may take
   the request only if ``load + 1 <= ceil(load_factor * (total_load + 1) / num_candidates)``,
   where ``load = queue_depth + num_running`` (the worker's last ``Status``) ``+ inflight``
   (what this gateway sent it since that ``Status`` was asked for) ``- ended`` (what it
   counted that has ended since). With
   ``load_factor >= 1`` the least-loaded candidate always passes, so no worker becomes a hot
   spot and the request always has somewhere to go.
3. Among the workers within the bound: first those that report ``d`` resident in their pool,
   then those holding it in their host cache, then the rest; each group ordered by rendezvous
   (highest-random-weight) score of ``(d, worker)``. So an adapter stays where it is loaded,
   a new adapter lands on its first-choice worker, and removing a worker only moves the
   adapters that lived there. Workers over the bound come last, least loaded first.
4. The base model (no digest) goes to the least-loaded worker.

The result lists every candidate in order, so the gateway can retry a request (before its
first token) on the next one. Snapshot freshness, in-flight counting and retries live in the
gateway (``gateway_pool.py``); this module has no clock and no I/O.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

RESIDENT, HOST_CACHED, AFFINITY = "resident", "host_cached", "affinity"
SPILL, LEAST_LOADED = "spill", "least_loaded"


@dataclass(frozen=True)
class WorkerSnapshot:
    """What the router knows of one worker: its last ``Status`` plus the gateway's in-flight
    count to it.

    Attributes:
        address: the worker's ``host:port`` (where to send requests).
        worker_id: the worker's stable name from its ``Status`` (a StatefulSet pod's name);
            the identity for hashing, so a pod that restarts on a new IP keeps its adapters.
            Empty until the first ``Status``: the address stands in.
        healthy: its last ``Status`` call succeeded and it is not draining.
        queue_depth / num_running / max_queue: from its last ``Status``.
        inflight: requests this gateway has in flight to it that its last ``Status`` does
            not count yet (sent after that ``Status`` was asked for).
        ended: requests its last ``Status`` counts that have ended since.
        resident / host_cached: adapter digests in its page pool / its host cache.
    """

    address: str
    healthy: bool = True
    worker_id: str = ""
    queue_depth: int = 0
    num_running: int = 0
    max_queue: int = 1 << 30
    inflight: int = 0
    ended: int = 0
    resident: frozenset[str] = frozenset()
    host_cached: frozenset[str] = frozenset()

    @property
    def key(self) -> str:
        return self.worker_id or self.address

    @property
    def load(self) -> int:
        return max(self.queue_depth + self.num_running - self.ended, 0) + self.inflight

    @property
    def full(self) -> bool:
        return self.queue_depth >= self.max_queue


@dataclass(frozen=True)
class Route:
    """The router's answer.

    Attributes:
        addresses: candidate workers, best first (empty: nowhere to go).
        decision: ``resident | host_cached | affinity | spill | least_loaded`` for the first
            candidate;
            ``full`` (every healthy worker's queue is full) or ``none`` (no healthy worker)
            when ``addresses`` is empty.
    """

    addresses: tuple[str, ...]
    decision: str


def rendezvous_score(digest: str, address: str) -> int:
    """The highest-random-weight score of a worker for a digest (stable across processes)."""
    h = hashlib.blake2b(f"{digest}\x00{address}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big")


def load_cap(loads: Iterable[int], load_factor: float) -> int:
    """The most load one worker may have after taking one more request."""
    loads = list(loads)
    return max(1, math.ceil(load_factor * (sum(loads) + 1) / len(loads)))


def affinity_worker(digest: str, workers: Sequence[WorkerSnapshot]) -> str | None:
    """The healthy worker a new adapter lands on when loads are even: the highest rendezvous
    score of ``(digest, worker)`` (None: no healthy worker). Where the gateway warms an
    adapter just uploaded (``WorkerPool.warm``)."""
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        return None
    return max(healthy, key=lambda w: rendezvous_score(digest, w.key)).address


def route(digest: str | None, workers: Sequence[WorkerSnapshot], load_factor: float = 1.25,
          exclude: frozenset[str] = frozenset()) -> Route:
    """Order the workers that may serve a request for adapter ``digest`` (None: base model).

    Args:
        digest: the adapter's content digest, or None for the base model.
        workers: every known worker's snapshot.
        load_factor: the bound on a worker's load relative to the mean (>= 1).
        exclude: addresses already tried for this request.

    Returns:
        The candidates, best first, and the kind of decision taken.
    """
    healthy = [w for w in workers if w.healthy and w.address not in exclude]
    open_ = [w for w in healthy if not w.full]
    if not open_:
        return Route((), "full" if healthy else "none")
    cap = load_cap((w.load for w in open_), load_factor)
    within = [w for w in open_ if w.load + 1 <= cap]
    over = sorted((w for w in open_ if w.load + 1 > cap), key=lambda w: (w.load, w.address))
    if not digest:
        ordered = sorted(within, key=lambda w: (w.load, -rendezvous_score("", w.key)))
        return Route(tuple(w.address for w in ordered + over), LEAST_LOADED)

    def by_score(group: Iterable[WorkerSnapshot]) -> list[WorkerSnapshot]:
        return sorted(group, key=lambda w: -rendezvous_score(digest, w.key))

    resident = by_score(w for w in within if digest in w.resident)
    host = by_score(w for w in within if digest in w.host_cached and digest not in w.resident)
    rest = by_score(w for w in within if digest not in w.resident | w.host_cached)
    ordered = resident + host + rest + over
    first_choice = affinity_worker(digest, healthy)
    if resident:
        decision = RESIDENT
    elif host:
        decision = HOST_CACHED
    elif ordered[0].address == first_choice:
        decision = AFFINITY
    else:
        decision = SPILL
    return Route(tuple(w.address for w in ordered), decision)
