"""A trace replayed against an in-process ``Engine``, stepped on the wall clock.

No gRPC, tokenizer round trips or threads: the loop adds every request whose arrival time has
passed, runs one ``step()``, and timestamps the tokens it produced, sleeping only when the
engine is idle until the next arrival. Latencies count from each request's scheduled arrival,
so the time it waits while a step runs is charged to the engine. This is what the
prefix-cache and fairness benchmarks use (``EngineConfig.enable_prefix_caching``,
``SchedulerConfig.scheduling``), and the engine side of the baseline comparison.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping

from tqdm import tqdm

from loraplex.loadtest.records import OK, RequestRecord, RunLog
from loraplex.loadtest.runner import RunConfig, trace_rate
from loraplex.loadtest.trace import Trace, TraceRequest
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.request import SamplingParams

_STATUS = {"stop": OK, "length": OK, "abort": "CANCELLED", "error": "INTERNAL"}


def replay_engine(engine: Engine, trace: Trace, config: RunConfig,
                  adapter_digests: Mapping[str, str] | None = None) -> RunLog:
    """Serve ``trace`` with ``engine`` in this thread.

    Args:
        engine: an idle engine (its adapter source must know every digest used).
        trace: the requests; ``config`` bounds and rescales it as for the gRPC runner
            (``request_timeout_s`` and API keys do not apply).
        adapter_digests: adapter name -> digest (a request naming another adapter fails with
            ``NOT_FOUND``, as the gateway would answer).

    Returns:
        the run's records; a request refused at ``add_request`` is ``INVALID_ARGUMENT``.
    """
    digests = dict(adapter_digests or {})
    trace = config.bounded(trace)
    pending = deque(enumerate(trace.requests))
    records: dict[str, RequestRecord] = {}
    closed = config.mode == "closed"
    bar = tqdm(total=len(trace), unit="req", disable=not config.progress, leave=False)
    start = time.perf_counter()
    deadline = config.max_duration_s
    drain_deadline = deadline + config.drain_timeout_s

    def now() -> float:
        return time.perf_counter() - start

    def admit(index: int, req: TraceRequest, t: float) -> bool:
        """Queue ``req``; False when it failed at once."""
        arrival = None if closed else req.arrival_time
        rec = RequestRecord(req.request_id, req.tenant, req.adapter, arrival,
                            t if closed else req.arrival_time, num_prompt_tokens=req.prompt_len
                            or 0, warmup=index < config.warmup_requests)
        records[req.request_id] = rec
        digest = None
        if req.adapter:
            digest = digests.get(req.adapter)
            if digest is None:
                rec.status, rec.error, rec.end_time = "NOT_FOUND", req.adapter, t
                bar.update(1)
                return False
        prompt = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
        try:
            engine.add_request(req.request_id, prompt,
                               SamplingParams(max_tokens=req.output_len, ignore_eos=True),
                               adapter_digest=digest, tenant=req.tenant)
        except ValueError as exc:
            rec.status, rec.error, rec.end_time = "INVALID_ARGUMENT", str(exc), t
            bar.update(1)
            return False
        return True

    in_flight = 0
    aborted = False
    while True:
        t = now()
        if t < deadline:
            while pending and (in_flight < config.concurrency if closed
                               else pending[0][1].arrival_time <= t):
                index, req = pending.popleft()
                in_flight += admit(index, req, t)
        else:
            pending.clear()
        if not engine.has_unfinished():
            if not pending:
                break
            if not closed:
                time.sleep(max(0.0, min(pending[0][1].arrival_time, deadline) - now()))
            continue
        if t > drain_deadline and not aborted:
            aborted = True
            for rid, rec in records.items():
                if not _done(rec):
                    engine.abort(rid)
        t0 = time.perf_counter()
        outputs = engine.step()
        t = now()
        for out in outputs:
            rec = records.get(out.request_id)
            if rec is None:
                continue
            rec.token_times.extend([t] * len(out.new_token_ids))
            if out.finished:
                rec.end_time = t
                rec.num_prompt_tokens = out.num_prompt_tokens
                rec.num_cached_tokens = out.num_cached_tokens
                rec.status = _STATUS.get(out.finish_reason or "error", "INTERNAL")
                rec.error = out.error or ""
                if rec.status == "CANCELLED":
                    rec.error = "cut off by the run's time bound"
                in_flight -= 1
                bar.update(1)
        if not outputs and time.perf_counter() - t0 < 1e-3:
            time.sleep(1e-3)  # waiting on an adapter load: do not spin
    bar.close()
    meta = {"system": "loraplex-engine", "target": "in-process", "mode": config.mode,
            "rate": None if closed else (config.rate or trace_rate(trace)),
            "concurrency": config.concurrency if closed else None,
            "warmup_requests": config.warmup_requests,
            "scheduling": engine.config.scheduler.scheduling,
            "enable_prefix_caching": engine.config.enable_prefix_caching, **config.meta}
    return RunLog(sorted(records.values(), key=lambda r: r.send_time), meta)


def _done(rec: RequestRecord) -> bool:
    return not math.isnan(rec.end_time)
