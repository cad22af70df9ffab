"""The gateway's view of its workers: one channel each, ``Status`` polled every
``status_interval`` (<= 250 ms), in-flight counts, and DNS names re-resolved so that a
Kubernetes headless service's pods come and go.

The router (``router.route``) sees only ``WorkerSnapshot``s made here. A worker leaves routing
only on its own word (Status says not serving, or it refuses all work) or when it cannot be
reached (a failed Status poll, a call that failed at the transport); a request's own error,
such as an adapter that cannot be loaded, never takes it out. Each loss is counted by reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import socket
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence

import grpc

from loraplex.server.api import GenerateChunk, ServiceError, WorkerRequest, WorkerStatus
from loraplex.server.gateway_warm import Warmer
from loraplex.server.metrics import GatewayMetrics
from loraplex.server.router import Route, WorkerSnapshot, route
from loraplex.server.wire.stubs import WorkerStub
from loraplex.server.worker import MAX_MESSAGE_BYTES, format_address

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    # A restarted worker is found again within about a second, not after minutes of backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.enable_retries", 0),  # the gateway retries itself, and only before the first token
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
MISSED_POLLS_UNHEALTHY = 3  # Status timeouts in a row before a slow worker counts as down


def split_target(target: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port). Raises ``ValueError``."""
    host, sep, port = target.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"workers: {target!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class WorkerHandle:
    """One worker: its channel, its last status and the requests in flight to it."""

    def __init__(self, address: str, metrics: GatewayMetrics) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = WorkerStub(self.channel)
        self.status: WorkerStatus | None = None
        self.healthy = False
        # The last Status is corrected by what happened since it was asked for: requests sent
        # after it are not in its counts yet, and requests that ended after it still are.
        self._sent: dict[int, float] = {}  # in flight: start times
        self._ended: deque[tuple[float, float]] = deque()  # (start, end) since the Status
        self._ids = itertools.count()
        self._status_sent = 0.0
        self.removed = False
        self._missed = 0
        self._metrics = metrics
        self._poller: asyncio.Task[None] | None = None

    def snapshot(self) -> WorkerSnapshot:
        """The router's view: the last Status, plus the requests sent since it was asked for,
        minus those it counted that have ended since (a stale count of finished requests
        would push adapters off their worker at low load)."""
        since = self._status_sent
        unseen = sum(1 for t in self._sent.values() if t >= since)
        ended = sum(1 for start, _ in self._ended if start < since)
        s = self.status
        if s is None:
            return WorkerSnapshot(self.address, healthy=False, inflight=unseen)
        return WorkerSnapshot(self.address, healthy=self.healthy, worker_id=s.worker_id,
                              queue_depth=s.queue_depth,
                              num_running=s.num_running, max_queue=s.max_queue,
                              inflight=unseen, ended=ended,
                              resident=frozenset(s.resident_adapters),
                              host_cached=frozenset(s.host_adapters))

    async def generate(self, request: WorkerRequest, timeout: float | None
                       ) -> AsyncGenerator[GenerateChunk, None]:
        """Proxy one request, counting it in flight while its stream is open."""
        token = next(self._ids)
        self._sent[token] = time.monotonic()
        self._set_gauge()
        try:
            async with contextlib.aclosing(self.stub.generate(request, timeout=timeout)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._ended.append((self._sent.pop(token), time.monotonic()))
            self._set_gauge()
            if self.removed and not self._sent:
                await self.channel.close()

    @property
    def inflight(self) -> int:
        return len(self._sent)

    def _set_gauge(self) -> None:
        self._metrics.inflight.labels(worker=self.address).set(len(self._sent))

    def set_healthy(self, healthy: bool, reason: str = "") -> bool:
        """Mark the worker up or down (True: that changed it); a fall from up counts as lost
        by ``reason``."""
        changed = healthy != self.healthy
        if changed:
            logger.info("worker %s is %s%s", self.address, "up" if healthy else "down",
                        f" ({reason})" if reason and not healthy else "")
            if not healthy:
                self._metrics.workers_lost.labels(reason=reason or "unreachable").inc()
        self.healthy = healthy
        self._metrics.worker_up.labels(worker=self.address).set(1 if healthy else 0)
        return changed

    async def poll_once(self, timeout: float) -> bool:
        """Ask the worker's ``Status``; True when the answer (or its failure) changed whether
        the worker is up."""
        sent = time.monotonic()
        try:
            self.status = await self.stub.status(None, timeout=timeout)
            self._status_sent = sent
            while self._ended and self._ended[0][1] < sent:
                self._ended.popleft()
        except ServiceError as exc:
            if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._missed += 1
                if self._missed < MISSED_POLLS_UNHEALTHY:
                    return False
            return self.set_healthy(False, "unreachable")
        self._missed = 0
        return self.set_healthy(self.status.serving, "not_serving")

    async def poll(self, interval: float, on_change: Callable[[], None]) -> None:
        while not self.removed:
            start = time.monotonic()
            # the change this poll made, not a comparison with before it: a call that marked
            # the worker down while the poll was in flight (mark_unhealthy, which says so
            # itself) would hide the poll's bringing it back up
            if await self.poll_once(timeout=max(1.0, 4 * interval)):
                on_change()
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - start)))

    def start_polling(self, interval: float, on_change: Callable[[], None]) -> None:
        self._poller = asyncio.create_task(self.poll(interval, on_change))

    async def close(self) -> None:
        self.removed = True
        if self._poller is not None:
            self._poller.cancel()
        if self.inflight == 0:
            await self.channel.close()


class WorkerPool:
    """Every worker the gateway routes to.

    Args:
        targets: ``HOST:PORT`` entries; a host name may resolve to many addresses (one worker
            each), re-resolved every ``dns_refresh``.
        status_interval: seconds between ``Status`` polls of each worker.
        on_change: called (on the event loop) when a worker comes up or goes down.
    """

    def __init__(self, targets: Sequence[str], metrics: GatewayMetrics,
                 status_interval: float = 0.2, dns_refresh: float = 5.0,
                 load_factor: float = 1.25, on_change: Callable[[], None] | None = None) -> None:
        self.targets = [split_target(t) for t in targets]
        if not self.targets:
            raise ValueError("workers: at least one HOST:PORT is needed")
        self.metrics = metrics
        self.status_interval = status_interval
        self.dns_refresh = dns_refresh
        self.load_factor = load_factor
        self._on_workers_change = on_change or (lambda: None)
        self._handles: dict[str, WorkerHandle] = {}
        self._resolved: dict[tuple[str, int], set[str]] = {}
        self._dns_task: asyncio.Task[None] | None = None
        self.warmer = Warmer(self.snapshots, lambda address: self._handles[address].stub,
                             metrics)

    async def start(self) -> None:
        """Resolve the targets, poll every worker once, then keep polling in the background."""
        await self._refresh()
        if any(not _is_ip(host) for host, _ in self.targets):
            self._dns_task = asyncio.create_task(self._dns_loop())

    async def close(self) -> None:
        if self._dns_task is not None:
            self._dns_task.cancel()
        self.warmer.close()
        for handle in list(self._handles.values()):
            await handle.close()
        self._handles.clear()

    @property
    def num_healthy(self) -> int:
        return sum(1 for h in self._handles.values() if h.healthy)

    def snapshots(self) -> list[WorkerSnapshot]:
        return [h.snapshot() for h in self._handles.values()]

    def route(self, digest: str | None, exclude: frozenset[str] = frozenset()) -> Route:
        """The router's pure policy over the current snapshots."""
        snapshots = self.snapshots()
        if digest:
            self.warmer.note(digest, snapshots)
        return route(digest, snapshots, self.load_factor, exclude)

    def _on_change(self) -> None:
        """A worker came up or went down: the gateway's hook, then the adapters whose
        affinity worker moved are warmed on their new one."""
        self._on_workers_change()
        self.warmer.workers_changed()

    def handle(self, address: str) -> WorkerHandle:
        return self._handles[address]

    def warm(self, digest: str) -> None:
        """An adapter was uploaded: warm it on the worker its requests will land on."""
        self.warmer.upload(digest)

    def warm_announced(self, digest: str) -> None:
        """The adapter store announced a put (perhaps this gateway's own upload): warm it
        there unless that was done just now."""
        self.warmer.announced(digest)

    def mark_unhealthy(self, address: str, reason: str) -> None:
        """A call found the worker gone (``reason`` ``transport``) or refusing all work
        (``not_serving``); skip it until a ``Status`` poll succeeds again."""
        handle = self._handles.get(address)
        if handle is not None and handle.healthy:
            handle.set_healthy(False, reason)
            self._on_change()

    async def wait_healthy(self, timeout: float) -> bool:
        """Wait until some worker is healthy (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        while self.num_healthy == 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(0.05, self.status_interval))
        return True

    async def _resolve(self) -> set[str]:
        loop = asyncio.get_running_loop()
        addresses: set[str] = set()
        for host, port in self.targets:
            if _is_ip(host):
                addresses.add(format_address(host, port))
                continue
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                logger.warning("workers: cannot resolve %s: %s", host, exc)
                # Keep what this name resolved to before rather than dropping its workers.
                addresses.update(self._resolved.get((host, port), set()))
                continue
            # One address family: dual-stack names would otherwise count each worker twice.
            v4 = [str(i[4][0]) for i in infos if i[0] == socket.AF_INET]
            ips = v4 or [str(i[4][0]) for i in infos]
            found = {format_address(ip, port) for ip in ips}
            self._resolved[(host, port)] = found
            addresses.update(found)
        return addresses

    async def _refresh(self) -> None:
        addresses = await self._resolve()
        new = [a for a in sorted(addresses) if a not in self._handles]
        for address in new:
            self._handles[address] = WorkerHandle(address, self.metrics)
            logger.info("worker %s added", address)
        for address in [a for a in self._handles if a not in addresses]:
            logger.info("worker %s removed (no longer in DNS)", address)
            handle = self._handles.pop(address)
            if handle.healthy:
                self.metrics.workers_lost.labels(reason="removed").inc()
            await handle.close()
        if new:
            await asyncio.gather(*(self._handles[a].poll_once(timeout=2.0) for a in new))
            for address in new:
                self._handles[address].start_polling(self.status_interval, self._on_change)
            self._on_change()

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.dns_refresh)
            try:
                await self._refresh()
            except Exception:
                logger.exception("workers: DNS refresh failed")
