"""Iteration-level continuous batching with chunked prefill and preemption by recompute.

There is no prefill phase and no decode phase: every request has ``num_tokens`` known tokens
and ``num_computed_tokens`` of them in its KV pages, and each step closes part of that gap
under a token budget. Running requests go first (so decodes never wait behind a long prompt),
then waiting requests are admitted while the budget, the running cap and the pager allow.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from loraplex.server.config import SchedulerConfig
from loraplex.server.engine.fairness import VirtualTokenCounter
from loraplex.server.engine.pager import Pager
from loraplex.server.engine.prefix_cache import PrefixCache
from loraplex.server.engine.request import Request, RequestStatus


class AdmissionGate(Protocol):
    """What the scheduler asks before admitting a request beyond its KV pages (the adapter
    cache implements it: an adapter must be loaded and its pages held while a request runs)."""

    def ready(self, request: Request) -> bool: ...

    def pages_needed(self, request: Request) -> int: ...

    def acquire(self, request: Request) -> None: ...

    def release(self, request: Request) -> None: ...


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work: ``requests[i]`` computes its next ``num_new_tokens[i]`` tokens."""

    requests: list[Request]
    num_new_tokens: list[int]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    """Decides, each step, which requests advance by how many tokens."""

    def __init__(self, config: SchedulerConfig, pager: Pager,
                 gate: AdmissionGate | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.config = config
        self.pager = pager
        self.gate = gate
        self.prefix_cache = prefix_cache
        self.vtc: VirtualTokenCounter | None = None
        if config.scheduling == "vtc":
            self.vtc = VirtualTokenCounter(config.vtc_input_weight, config.vtc_output_weight,
                                           dict(config.tenant_weights))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        if self.vtc is not None:
            active = {r.tenant for r in self.running} | {r.tenant for r in self.waiting}
            self.vtc.on_arrival(request.tenant, active)
        self.waiting.append(request)

    def _next_waiting(self, passed: set[str]) -> Request | None:
        candidates = (r for r in self.waiting if r.request_id not in passed)
        if self.vtc is not None:
            return self.vtc.pick(candidates)
        return next(candidates, None)

    def _charge(self, request: Request, num_new_tokens: int) -> None:
        # Service counts once per position: recomputing after preemption is not new service.
        if self.vtc is None:
            return
        end = request.num_computed_tokens + num_new_tokens
        start = max(request.num_charged_tokens, request.num_computed_tokens)
        if end <= start:
            return
        prompt = request.num_prompt_tokens
        num_input = max(min(end, prompt) - start, 0)
        self.vtc.charge(request.tenant, num_input, end - start - num_input)
        request.num_charged_tokens = end

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _pages_for(self, request: Request, num_tokens: int) -> int:
        return max(-(-num_tokens // self.config.page_size) - len(request.page_ids), 0)

    def _chunk(self, request: Request, budget: int) -> int:
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def schedule(self) -> ScheduledBatch:
        """Pick this step's batch, allocating the pages it needs."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[Request] = []
        counts: list[int] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            need = self._pages_for(req, req.num_computed_tokens + n)
            while not self.pager.can_allocate(need):
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            req.page_ids.extend(self.pager.allocate(need))
            self._charge(req, n)
            scheduled.append(req)
            counts.append(n)
            budget -= n
            i += 1

        passed: set[str] = set()  # waiting requests passed over this step, keeping their place
        cap = self.config.max_adapters_per_step
        active = {r.adapter_digest for r in self.running if r.adapter_digest} if cap else set()
        while not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._next_waiting(passed)
            if req is None:
                break
            if self.gate is not None and not self.gate.ready(req):
                passed.add(req.request_id)  # its adapter is still loading
                continue
            if req.grammar is not None and not req.grammar.ready:
                passed.add(req.request_id)  # its grammar is still compiling
                continue
            digest = req.adapter_digest
            if cap and digest and digest not in active and len(active) >= cap:
                passed.add(req.request_id)  # over the distinct-adapter cap
                continue
            matched = self.prefix_cache.match(req) if self.prefix_cache is not None else []
            req.page_ids = matched
            req.num_computed_tokens = len(matched) * self.config.page_size
            n = self._chunk(req, budget)
            need = self._pages_for(req, req.num_computed_tokens + n)
            extra = self.gate.pages_needed(req) if self.gate is not None else 0
            if not self.pager.can_allocate(need + extra):
                if matched:
                    self.pager.free(matched[::-1])  # last first, as _release does
                    req.page_ids, req.num_computed_tokens = [], 0
                break
            if self.prefix_cache is not None:
                self.prefix_cache.record_admission(req, req.num_computed_tokens)
            self.waiting.remove(req)
            if self.gate is not None:
                self.gate.acquire(req)
            req.page_ids.extend(self.pager.allocate(need))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if cap and digest:
                active.add(digest)
            self._charge(req, n)  # at once, so the next pick sees this admission
            scheduled.append(req)
            counts.append(n)
            budget -= n
        return ScheduledBatch(scheduled, counts, preempted)

    def _preempt(self, request: Request) -> None:
        # Recompute: drop the KV, keep the tokens; the request re-enters at the queue's head.
        self._release(request, finished=False)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request, finished: bool) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.forget(request, finished)
        if request.page_ids:
            # Last page first: a cached prefix's deepest page becomes the oldest in the LRU and
            # is evicted first, so the pages that stay keep forming a matchable prefix (freed
            # front to back, the first page went first and orphaned all the rest).
            self.pager.free(request.page_ids[::-1])
            request.page_ids = []
        if self.gate is not None and request.status is RequestStatus.RUNNING:
            self.gate.release(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (finished, aborted or failed) and return its pages at once."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request, finished=True)
        request.status = status

    def finish_many(self, requests: Iterable[Request], status: RequestStatus) -> None:
        for req in list(requests):
            self.finish(req, status)
