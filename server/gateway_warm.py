"""Adapters loaded into a worker's host cache before their requests reach it (the worker's
``Prefetch``), so that a request waits only for the copy into the pool:

* **an upload**, on the worker its requests will land on (``router.affinity_worker``): one
  through this gateway, or any put the adapter store announces (``watch_stored``: a push
  straight to a Redis store, an upload through another gateway; the store announces this
  gateway's own uploads back to it, skipped when warmed there within
  ``ANNOUNCED_REPEAT_SECONDS``);
* **a change of workers**: when one joins, leaves or comes back, the adapters the gateway
  routed recently (the last ``RECENT_ADAPTERS`` digests) whose affinity worker changed are
  warmed on their new one (a worker lost hands its adapters to their next choices; a worker
  restarted gets its adapters back with an empty cache).

Best effort, in the background on the event loop: a failed call is counted and logged, never
raised. A worker never evicts for a warm load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any

from loraplex.server.api import ServiceError
from loraplex.server.metrics import GatewayMetrics
from loraplex.server.router import WorkerSnapshot, affinity_worker
from loraplex.server.wire.stubs import WorkerStub
from loraplex.server.worker import MAX_PREFETCH

logger = logging.getLogger(__name__)

WARM_TIMEOUT_SECONDS = 5.0  # a Prefetch call (it only starts the loads)
RECENT_ADAPTERS = 4096  # digests remembered for re-warming after a change of workers
REWARM_SLICE = 256  # digests re-hashed between yields to the event loop
ANNOUNCED_REPEAT_SECONDS = 30.0  # an announced put warmed on that worker this long ago: skip
ANNOUNCED_DELAY_SECONDS = 0.5  # an announced put waits this long for the upload's own warm


class Warmer:
    """Sends ``Prefetch`` calls for uploads and after changes of workers.

    Args:
        snapshots: the workers' current snapshots (the router's view).
        stub: the worker stub of an address.
        metrics: ``adapter_warms`` counts each call's result by digest.
    """

    def __init__(self, snapshots: Callable[[], list[WorkerSnapshot]],
                 stub: Callable[[str], WorkerStub], metrics: GatewayMetrics) -> None:
        self._snapshots = snapshots
        self._stub = stub
        self._metrics = metrics
        # digest -> its affinity worker when last looked at, most recently routed last
        self._recent: OrderedDict[str, str | None] = OrderedDict()
        # digest -> (worker, when) of each upload's warm, oldest first (an announcement of
        # the same put skips it)
        self._uploads: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._announced: dict[str, None] = {}  # announced digests waiting for the next flush
        self._tasks: set[asyncio.Task[None]] = set()
        self._rewarming = asyncio.Lock()

    def note(self, digest: str, snapshots: list[WorkerSnapshot] | None = None) -> None:
        """A request was routed for ``digest``: remember it (and its affinity worker now,
        among ``snapshots``: the router's, or fresh ones when None)."""
        if digest in self._recent:
            self._recent.move_to_end(digest)
            return
        self._remember(digest, affinity_worker(
            digest, snapshots if snapshots is not None else self._snapshots()))

    def _remember(self, digest: str, home: str | None) -> None:
        """``digest``'s affinity worker is ``home`` now (most recent)."""
        self._recent.pop(digest, None)
        self._recent[digest] = home
        if len(self._recent) > RECENT_ADAPTERS:
            self._recent.popitem(last=False)

    def _uploaded(self, digest: str, home: str | None, now: float) -> str | None:
        """Remember an upload's (or announced put's) worker, ``home`` (None: no healthy
        worker, nothing to warm)."""
        self._remember(digest, home)
        if home is not None:
            self._uploads.pop(digest, None)
            self._uploads[digest] = (home, now)
        return home

    def upload(self, digest: str) -> None:
        """An adapter was stored: warm it on its affinity worker (and remember it)."""
        now = time.monotonic()
        self._forget_uploads(now)
        home = self._uploaded(digest, affinity_worker(digest, self._snapshots()), now)
        if home is not None:
            self._send_batches({home: [digest]})

    def announced(self, digest: str) -> None:
        """The adapter store announced a put (from anywhere): warm it as an upload, unless
        this gateway warmed it on that worker in the last ``ANNOUNCED_REPEAT_SECONDS`` (its
        own upload: the store announces a put before the gateway's handler gets it back, so
        announcements wait ``ANNOUNCED_DELAY_SECONDS``; those that arrive meanwhile, a bulk
        push's, go out together, ``MAX_PREFETCH`` digests a call to each worker)."""
        first = not self._announced
        self._announced[digest] = None
        if first:
            self._spawn(self._flush_announced())

    async def _flush_announced(self) -> None:
        await asyncio.sleep(ANNOUNCED_DELAY_SECONDS)
        digests, self._announced = list(self._announced), {}
        now = time.monotonic()
        self._forget_uploads(now)
        snapshots = self._snapshots()
        by_home: dict[str, list[str]] = {}
        for n, digest in enumerate(digests):
            if n and n % REWARM_SLICE == 0:
                await asyncio.sleep(0)
            home = affinity_worker(digest, snapshots)
            done = self._uploads.get(digest)
            if done is not None and done[0] == home:
                self._metrics.adapter_warms.labels(result="repeat").inc()
            elif (home := self._uploaded(digest, home, now)) is not None:
                by_home.setdefault(home, []).append(digest)
        self._send_batches(by_home)

    def _forget_uploads(self, now: float) -> None:
        while self._uploads and next(iter(self._uploads.values()))[1] < \
                now - ANNOUNCED_REPEAT_SECONDS:
            self._uploads.popitem(last=False)

    def workers_changed(self) -> None:
        """Warm each remembered adapter whose affinity worker changed on its new one (in the
        background: 4096 digests over 16 workers take ~45 ms of rendezvous hashing, done in
        slices so that the event loop keeps serving)."""
        self._spawn(self._rewarm())

    async def _rewarm(self) -> None:
        async with self._rewarming:  # one at a time, each on the snapshots when it starts
            snapshots = self._snapshots()
            moved: dict[str, list[str]] = {}
            for n, (digest, old) in enumerate(list(self._recent.items())):
                if n and n % REWARM_SLICE == 0:
                    await asyncio.sleep(0)
                home = affinity_worker(digest, snapshots)
                if home is not None and home != old:
                    moved.setdefault(home, []).append(digest)
                if digest in self._recent:  # not dropped by note() meanwhile
                    self._recent[digest] = home
            self._send_batches(moved)

    def _send_batches(self, by_home: dict[str, list[str]]) -> None:
        """A ``Prefetch`` for each worker's digests, ``MAX_PREFETCH`` a call."""
        for address, digests in by_home.items():
            for i in range(0, len(digests), MAX_PREFETCH):
                self._spawn(self._prefetch(address, tuple(digests[i:i + MAX_PREFETCH])))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    async def _prefetch(self, address: str, digests: tuple[str, ...]) -> None:
        try:
            started = await self._stub(address).prefetch(digests, timeout=WARM_TIMEOUT_SECONDS)
        except (ServiceError, KeyError) as exc:  # KeyError: the worker was removed meanwhile
            logger.info("worker %s: prefetch of %d adapter(s) refused: %s", address,
                        len(digests), exc)
            self._metrics.adapter_warms.labels(result="refused").inc(len(digests))
            return
        self._metrics.adapter_warms.labels(result="started").inc(started)
        self._metrics.adapter_warms.labels(result="cached").inc(len(digests) - started)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
