"""The asyncio gRPC load generator: a trace against a gateway, open or closed loop.

* Open loop (``mode="open"``): each request is sent at its arrival time (optionally rescaled
  to ``rate``), whether or not earlier ones have finished: the offered load does not bend to
  the server's speed.
* Closed loop (``mode="closed"``): ``concurrency`` clients each send the trace's next request
  as soon as their previous one ends (arrival times are ignored).

Every request streams (``GenerateStream``, ``max_tokens`` = the trace's output length, EOS
ignored) and each chunk's arrival is timestamped. A run is bounded in count
(``max_requests``) and time (``max_duration_s`` for sending, then ``drain_timeout_s`` for the
requests in flight, which are then cancelled and recorded ``CANCELLED``); each request has its
own deadline. Tenants map to API keys (``api_keys``); a keyless server serves everything as
tenant ``default``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tqdm import tqdm

from loraplex.loadtest.records import RequestRecord, RunLog
from loraplex.loadtest.trace import Trace, TraceRequest
from loraplex.server.api import GenerateChunk, ServiceError
from loraplex.server.client import AsyncClient
from loraplex.server.engine.request import SamplingParams

logger = logging.getLogger(__name__)

StreamFn = Callable[[TraceRequest, float | None], AsyncIterator[GenerateChunk]]


@dataclass(frozen=True)
class RunConfig:
    """How to drive a trace. Validated at construction.

    Attributes:
        mode: ``open`` (send at arrival times) or ``closed`` (``concurrency`` in flight).
        rate: open loop: rescale the trace's arrivals to this mean rate (None: as recorded).
        concurrency: closed loop: requests in flight at once.
        max_requests: send at most this many (None: the whole trace).
        max_duration_s: stop sending after this many seconds.
        drain_timeout_s: then wait this long for requests in flight before cancelling them.
        request_timeout_s: each request's deadline (None: none).
        warmup_requests: the first this many requests are marked warm-up.
        api_keys: (tenant, key) pairs; tenants not listed use ``default_api_key``.
        default_api_key: key for other tenants (None: ``$LORAPLEX_API_KEY`` or keyless).
        progress: show a progress bar.
        meta: extra entries for the run log's ``meta``.
    """

    mode: str = "open"
    rate: float | None = None
    concurrency: int = 8
    max_requests: int | None = None
    max_duration_s: float = 600.0
    drain_timeout_s: float = 60.0
    request_timeout_s: float | None = 300.0
    warmup_requests: int = 0
    api_keys: tuple[tuple[str, str], ...] = ()
    default_api_key: str | None = None
    progress: bool = True
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in ("open", "closed"):
            raise ValueError(f"mode: {self.mode!r} is not open or closed")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate: must be > 0, got {self.rate}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {self.concurrency}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests: must be >= 1, got {self.max_requests}")
        if not self.max_duration_s > 0 or self.drain_timeout_s < 0:
            raise ValueError("max_duration_s must be > 0 and drain_timeout_s >= 0")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s: must be > 0, got {self.request_timeout_s}")
        if self.warmup_requests < 0:
            raise ValueError("warmup_requests: must be >= 0")

    def bounded(self, trace: Trace) -> Trace:
        """The part of ``trace`` this run may send: count-bounded, rate-rescaled."""
        if self.max_requests is not None:
            trace = trace.head(self.max_requests)
        if self.mode == "open" and self.rate is not None:
            trace = trace.scaled(self.rate)
        return trace


class _Run:
    """One run's shared state: the clock, the records, the progress bar."""

    def __init__(self, stream: StreamFn, config: RunConfig, total: int) -> None:
        self.stream = stream
        self.config = config
        self.records: list[RequestRecord] = []
        self.start = time.perf_counter()
        self.deadline = self.start + config.max_duration_s
        self.bar = tqdm(total=total, unit="req", disable=not config.progress, leave=False)
        self.num_errors = 0

    def now(self) -> float:
        return time.perf_counter() - self.start

    async def send(self, index: int, req: TraceRequest, arrival: float | None) -> None:
        rec = RequestRecord(req.request_id, req.tenant, req.adapter, arrival, self.now(),
                            num_prompt_tokens=req.prompt_len or 0,
                            warmup=index < self.config.warmup_requests)
        self.records.append(rec)
        try:
            async for chunk in self.stream(req, self.config.request_timeout_s):
                t = self.now()
                rec.token_times.extend([t] * len(chunk.token_ids))
                if chunk.usage is not None:
                    rec.num_prompt_tokens = chunk.usage.prompt_tokens
                    rec.num_cached_tokens = chunk.usage.cached_tokens
        except ServiceError as exc:
            rec.status, rec.error = exc.code.name, exc.message
        except asyncio.CancelledError:
            rec.status, rec.error = "CANCELLED", "cut off by the run's time bound"
            raise
        except Exception as exc:  # a client-side failure is a result too, not a crash
            logger.warning("request %s failed in the client: %r", req.request_id, exc)
            rec.status, rec.error = "CLIENT_ERROR", repr(exc)
        finally:
            rec.end_time = self.now()
            if not rec.ok:
                self.num_errors += 1
            self.bar.update(1)
            if self.num_errors:
                self.bar.set_postfix(errors=self.num_errors, refresh=False)

    async def open_loop(self, trace: Trace) -> list[asyncio.Task]:
        tasks = []
        for i, req in enumerate(trace.requests):
            delay = self.start + req.arrival_time - time.perf_counter()
            if self.start + req.arrival_time > self.deadline:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.send(i, req, req.arrival_time)))
        return tasks

    async def closed_loop(self, trace: Trace) -> list[asyncio.Task]:
        queue = list(enumerate(trace.requests))
        queue.reverse()

        async def client() -> None:
            while queue and time.perf_counter() < self.deadline:
                i, req = queue.pop()
                await self.send(i, req, None)

        return [asyncio.create_task(client()) for _ in range(self.config.concurrency)]

    async def finish(self, tasks: list[asyncio.Task]) -> None:
        """Wait for ``tasks`` until the time bound plus the drain timeout, then cancel."""
        limit = max(self.deadline - time.perf_counter(), 0.0) + self.config.drain_timeout_s
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=limit)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self.bar.close()


async def run_stream(trace: Trace, stream: StreamFn, config: RunConfig) -> RunLog:
    """Drive ``trace`` through ``stream`` (one call per request, yielding chunks).

    Returns:
        the run's records in send order, with ``meta`` describing the run.
    """
    trace = config.bounded(trace)
    run = _Run(stream, config, len(trace))
    if config.mode == "open":
        tasks = await run.open_loop(trace)
    else:
        tasks = await run.closed_loop(trace)
    await run.finish(tasks)
    records = sorted(run.records, key=lambda r: r.send_time)
    meta = {"mode": config.mode, "num_trace_requests": len(trace),
            "rate": config.rate if config.rate is not None else trace_rate(trace),
            "concurrency": config.concurrency if config.mode == "closed" else None,
            "warmup_requests": config.warmup_requests, **config.meta}
    return RunLog(records, meta)


def trace_rate(trace: Trace) -> float | None:
    """The mean arrival rate a trace was generated at (measured for a merged trace)."""
    if trace.config is None:
        return len(trace) / trace.duration if trace.duration > 0 else None
    return None if math.isinf(trace.config.rate) else trace.config.rate


def grpc_stream(clients: dict[str, AsyncClient], default: AsyncClient) -> StreamFn:
    """A ``StreamFn`` over the loraplex client: each tenant's requests go through its own
    client (its API key), others through ``default``."""

    def stream(req: TraceRequest, timeout: float | None) -> AsyncIterator[GenerateChunk]:
        client = clients.get(req.tenant, default)
        prompt = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True)
        return client.generate_stream(prompt, req.adapter, params=params,
                                      request_id=req.request_id, timeout=timeout)

    return stream


async def run_grpc(trace: Trace, address: str, config: RunConfig) -> RunLog:
    """Run ``trace`` against the gateway at ``address`` (``host:port``)."""
    default = AsyncClient(address, api_key=config.default_api_key)
    clients = {tenant: AsyncClient(address, api_key=key) for tenant, key in config.api_keys}
    try:
        log = await run_stream(trace, grpc_stream(clients, default), config)
    finally:
        for client in [default, *clients.values()]:
            await client.close()
    log.meta.update(system="loraplex", target=address)
    return log


async def wait_ready(address: str, timeout_s: float = 60.0) -> None:
    """Wait until the gateway's health service says ``SERVING``.

    Raises:
        TimeoutError: it did not within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    async with AsyncClient(address, api_key="") as client:
        while True:
            try:
                if await client.health(timeout=2.0) == "SERVING":
                    return
            except ServiceError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address}: not serving after {timeout_s:.0f} s")
            await asyncio.sleep(0.2)
