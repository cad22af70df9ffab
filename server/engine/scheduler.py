"""Iteration-level continuous batching with chunked prefill and preemption by recompute.

There is no prefill phase and no decode phase: every request has ``num_tokens`` known tokens
and ``num_computed_tokens`` of them in its KV pages, and each step closes part of that gap
under a token budget. Running requests go first (so decodes never wait behind a long prompt),
then waiting requests are admitted while the budget, the running cap and the pager allow.

With an inter-token latency target (``target_itl_ms``) the budget is also one of time: each
step's prefill is sized so that the step's predicted time (a cost model passed in as a
function, ``step_cost.py``) stays within the target, or within ``decode_floor_ratio`` times
the decode rows' own time when they alone exceed it, and paced at the prompts' arrival rate
(``pacing.py``) so that steps stay even: stall-free batching as in Sarathi-Serve.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from loraplex.server.config import SchedulerConfig
from loraplex.server.engine.batch import (
    AdapterLoad,
    AdmissionGate,
    ScheduledBatch,
)
from loraplex.server.engine.fairness import VirtualTokenCounter
from loraplex.server.engine.pacing import PrefillPacer
from loraplex.server.engine.pager import Pager
from loraplex.server.engine.prefix_cache import PrefixCache
from loraplex.server.engine.request import Request, RequestStatus
from loraplex.server.engine.spec.speculator import Speculator
from loraplex.server.engine.step_cost import StepShape, StepShapeBuilder
from loraplex.server.engine.step_update import StepUpdater

logger = logging.getLogger(__name__)

StepCost = Callable[[StepShape], float]  # predicted seconds of a step of that shape


class Scheduler(StepUpdater):
    """Decides, each step, which requests advance by how many tokens."""

    def __init__(self, config: SchedulerConfig, pager: Pager,
                 gate: AdmissionGate | None = None,
                 prefix_cache: PrefixCache | None = None, cost: StepCost | None = None,
                 eos_token_ids: Iterable[int] = (), max_model_len: int | None = None,
                 speculator: Speculator | None = None) -> None:
        """An empty scheduler (nothing waiting, nothing running).

        Args:
            config: the limits (and ``target_itl_ms``).
            pager: the page pool requests' KV comes from.
            gate: what admission asks about adapters (the adapter manager), if any.
            prefix_cache: full KV pages reused across requests, if any.
            cost: predicted seconds of a step of a given shape (``StepCostModel.predict``);
                with ``target_itl_ms`` it sizes each step's prefill. The scheduler itself
                reads no clock.
            eos_token_ids: the model's end-of-sequence tokens (a request stops at one
                unless ``ignore_eos``).
            max_model_len: a request stops, ``length``, when it reaches this many tokens.
            speculator: speculative decoding, if on: each step's decode requests get their
                drafts first, and compute ``1 + d`` tokens (``Request.draft_token_ids``).
        """
        self.config = config
        self._cost = cost
        self._target = (config.target_itl_ms / 1000.0
                        if config.target_itl_ms > 0 and cost is not None else None)
        self._pacer = (PrefillPacer(config.prefill_pacing, config.min_prefill_chunk)
                       if self._target is not None and config.prefill_pacing > 0 else None)
        self.pager = pager
        self.gate = gate
        self.prefix_cache = prefix_cache
        self.vtc: VirtualTokenCounter | None = None
        if config.scheduling == "vtc":
            self.vtc = VirtualTokenCounter(config.vtc_input_weight, config.vtc_output_weight,
                                           dict(config.tenant_weights))
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.speculator = speculator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # A prompt's sequences 1..n-1, by its sequence 0's id, until that one has prefilled
        # the prompt once: they then fork off it (``update``), on its pages.
        self._unforked: dict[str, list[Request]] = {}
        self._orphans: list[Request] = []  # siblings that ended with their unforked parent

    def add(self, request: Request, siblings: Sequence[Request] = ()) -> None:
        """Queue ``request``; ``siblings`` (the other sequences of an ``n > 1`` prompt) fork
        off it once it has computed the prompt, and count against ``max_num_seqs`` with it
        from its admission on."""
        if self.vtc is not None:
            active = {r.tenant for r in self.running} | {r.tenant for r in self.waiting}
            self.vtc.on_arrival(request.tenant, active)
        if siblings:
            self._unforked[request.request_id] = list(siblings)
        if self._pacer is not None:
            self._pacer.arrived(request.num_tokens - request.num_computed_tokens)
        self.waiting.append(request)

    def pending_forks(self, request: Request) -> tuple[Request, ...]:
        """The siblings that fork off ``request`` when it next samples (they sample from its
        logits row in that step)."""
        return tuple(self._unforked.get(request.request_id, ()))

    def take_orphans(self) -> list[Request]:
        """Siblings finished because their sequence 0 ended before forking them (each with
        its status and error), since the last call."""
        orphans, self._orphans = self._orphans, []
        return orphans

    def _num_slots(self, request: Request) -> int:
        # A sequence 0 holds running slots for its unforked siblings too: forking them must
        # never take the running count past max_num_seqs.
        return 1 + len(self._unforked.get(request.request_id, ()))

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
        draft = request.draft_token_ids
        n = min(request.num_tokens + len(draft) - request.num_computed_tokens, budget)
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        if draft:
            del draft[max(n - 1, 0):]  # a draft cut by the budget verifies what fits
        return n

    def _decoding(self, request: Request) -> bool:
        # Past its prompt: a decode row (one token, or verification / n > 1 rows), which the
        # target always lets advance; everything before is prefill, which it sizes.
        return request.num_computed_tokens >= request.num_prompt_tokens

    def _step_limit(self, decode_shape: StepShapeBuilder) -> float | None:
        """The step's time budget: the target, or ``decode_floor_ratio`` times the decode
        rows' own predicted time when that is larger (None: no target)."""
        if self._target is None or self._cost is None:
            return None
        decodes = decode_shape.shape()
        if decodes.num_decode_tokens == 0:  # no decode rows, no floor: the prediction of an
            return self._target  # empty step is the fastest one measured, not a budget
        floor = self._cost(decodes)
        return max(self._target, self.config.decode_floor_ratio * floor)

    def _fit(self, shape: StepShapeBuilder, req: Request, n: int, prefilled: bool,
             pages_loaded: int, limit: float | None) -> int:
        """The largest chunk of at most ``n`` tokens that keeps the step's predicted time
        within ``limit`` (``_step_limit``); the step's first prefill chunk gets at least the
        minimum chunk, a later one that minimum or nothing."""
        if limit is None or self._cost is None or n <= 0:
            return n
        cost, target = self._cost, limit
        num_computed, digest = req.num_computed_tokens, req.adapter_digest

        def fits(k: int) -> bool:
            return cost(shape.with_row(num_computed, k, False, digest, pages_loaded)) <= target

        if fits(n):
            return n
        lo, hi = 0, n  # the prediction grows with the chunk: bisect for the last that fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        floor = min(n, self.config.min_prefill_chunk)
        if not prefilled:
            return max(lo, floor)
        return lo if lo >= floor else 0

    def schedule(self, now: float | None = None) -> ScheduledBatch:
        """Pick this step's batch, allocating the pages it needs (and reserving adapters'
        pages, whose copies the batch carries: ``adapter_loads``).

        First, waiting requests that can never run are finished and reported in ``refused``
        (``_refusal``); ``now`` (the caller's clock: the scheduler reads none) times out
        grammars still compiling, and without it only failed compiles are refused.

        Running requests go first, in admission order, each its next chunk under the token
        budget (``max_num_batched_tokens``); then waiting requests are admitted while the
        budget, ``max_num_seqs`` and the pager allow. Under page pressure the newest running
        request is preempted (recompute), and nothing is admitted that step.

        With ``target_itl_ms`` (and a cost model), every decode row (a running request past
        its prompt) advances as above, its tokens held out of the budget for it; prefill
        chunks (running prompts, then admissions) get only the tokens for which the step's
        predicted time stays within the step's limit ``L = max(target, r * D)``: ``D`` is
        the predicted time of the step's decode rows alone (those running at its start) and
        ``r = decode_floor_ratio``. The step's first prefill chunk always gets at least
        ``min_prefill_chunk`` tokens (or its remainder), so a step exceeds ``L`` only by that
        one minimum chunk. With ``prefill_pacing`` the step's prompt tokens are also at most
        ``PrefillPacer.quota`` (never below that minimum): even steps, not alternating ones.

        Why ``r * D``: when the decodes alone are predicted over the target (a CPU at high
        concurrency), the target alone leaves prefill only the minimum chunk, so the queue
        refills slowly and fewer requests decode at once (throughput and TTFT collapse for
        a target nobody can meet); ``r * D`` leaves prefill ``(r - 1) / r`` of such a step.
        Keeping ``C`` requests decoding (prompts of ``P``, outputs of ``O`` tokens) needs
        ``C * P / O`` prompt tokens a step: ``r - 1 >= (P / O) * (p / d)`` suffices, with
        ``p`` and ``d`` the model's cost of a prompt token and of a decode row; ``r = 2``
        covers prompts up to ``O * d / p`` (about 2.2x the output on the CPU's live fit).
        And a stream's gap stays within ``r`` times its decode floor: ``r = 2`` is the
        issue's ITL p99 <= 2x p50 when the median gap is that floor. ``r = 1`` is the
        target alone; a feasible target (``r * D <= target``) is untouched.

        The TTFT bound: while prompts wait, every step computes at least ``m =
        min_prefill_chunk`` prompt tokens, first of the running prompts then of the queue's
        head (FCFS), so a request reaches its first token within ``sum over j of
        ceil(P_j / m)`` steps, ``P_j`` being the prompt tokens still to compute of itself and
        of every request ahead of it, as long as the decodes leave room in the token budget
        and the pager and ``max_num_seqs`` admit it (preemption restarts the count).

        ``max_num_seqs`` counts a sequence 0 with its unforked siblings: a request of n
        sequences is admitted only when n running slots are free.
        """
        refused = self._refuse(now)
        if self.gate is not None:
            self.gate.begin_step()
        if self.speculator is not None:
            # Drafts first (they size the decode rows); a request whose draft was dropped
            # below (pages, budget) verifies less or nothing, and decodes one token.
            decoding = [r for r in self.running
                        if r.num_output_tokens and r.num_computed_tokens == r.num_tokens - 1]
            try:
                self.speculator.draft(decoding, self._cost)
            except Exception:  # a bug in a proposer: this step decodes without drafts
                logger.exception("speculative drafts failed; decoding without them")
                for req in decoding:
                    req.draft_token_ids = []
        budget = self.config.max_num_batched_tokens
        scheduled: list[Request] = []
        counts: list[int] = []
        preempted: list[Request] = []
        copies: list[tuple[int, int]] = []
        loads: list[AdapterLoad] = []
        shape = StepShapeBuilder()
        sizing = self._target is not None
        # decode rows not visited yet, with the tokens held for them (target only)
        held: dict[str, tuple[Request, int]] = {}
        if sizing:
            for req in self.running:
                if self._decoding(req):
                    n = self._chunk(req, budget)
                    held[req.request_id] = (req, n)
                    shape.add(req.num_computed_tokens, n, True, req.adapter_digest)
        # shape holds the decode rows alone here: their predicted time is the step's floor
        limit = self._step_limit(shape) if sizing else None
        reserved = sum(n for _, n in held.values())
        prefilled = False
        paced = budget
        if self._pacer is not None:
            quota = self._pacer.quota(self.running, self.waiting)  # folds in the arrivals
            paced = quota if held else budget  # no decode rows: nothing to keep even

        def unhold(req: Request) -> int:
            nonlocal reserved
            _, n = held.pop(req.request_id)
            reserved -= n
            shape.remove(req.num_computed_tokens, n, True, req.adapter_digest)
            return n

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            decode = self._decoding(req)
            if req.request_id in held:
                n = min(unhold(req), budget)
            else:
                n = self._fit(shape, req, min(self._chunk(req, budget - reserved), paced),
                              prefilled, 0, limit)
                if n <= 0:
                    i += 1  # no room for this prompt's chunk; the decodes behind it still go
                    continue
            del req.draft_token_ids[max(n - 1, 0):]  # what the budget left of a draft
            need = self._pages_for(req, req.num_computed_tokens + n)
            shared = self._shared_tail(req)
            if req.draft_token_ids and not self.pager.can_allocate(need + (shared is not None)):
                # A draft never preempts anyone: without room for it, decode one token.
                req.draft_token_ids = []
                n = 1
                need = self._pages_for(req, req.num_computed_tokens + n)
            while not self.pager.can_allocate(need + (shared is not None)):
                victim = self.running.pop()  # the newest running request
                if victim.request_id in held:
                    unhold(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            if shared is not None:
                fresh = self.pager.copy_on_write(req.page_ids[shared])
                if fresh is not None:  # else its siblings left it the page
                    copies.append((req.page_ids[shared], fresh))
                    req.page_ids[shared] = fresh
            req.page_ids.extend(self.pager.allocate(need))
            shape.add(req.num_computed_tokens, n, decode, req.adapter_digest)
            prefilled = prefilled or not decode
            paced -= 0 if decode else n
            self._charge(req, n)
            scheduled.append(req)
            counts.append(n)
            budget -= n
            i += 1
        for req, _ in list(held.values()):
            unhold(req)  # the budget ran out before them
        if self.speculator is not None:
            # A draft is verified in the step it was made for, or dropped: a running request
            # the budget never reached (or one preempted) must not carry it into a later step.
            chosen = {id(r) for r in scheduled}
            for req in (*self.running, *preempted):
                if id(req) not in chosen:
                    req.draft_token_ids = []

        passed: set[str] = set()  # waiting requests passed over this step, keeping their place
        cap = self.config.max_adapters_per_step
        active = {r.adapter_digest for r in self.running if r.adapter_digest} if cap else set()
        slots = sum(self._num_slots(r) for r in self.running)
        while not preempted and budget > 0 and slots < self.config.max_num_seqs:
            req = self._next_waiting(passed)
            if req is None or slots + self._num_slots(req) > self.config.max_num_seqs:
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
            loaded = self.gate.pages_to_load(req) if self.gate is not None else 0
            n = self._fit(shape, req, min(self._chunk(req, budget), paced), prefilled, loaded,
                          limit)
            need = self._pages_for(req, req.num_computed_tokens + n)
            extra = self.gate.pages_needed(req) if self.gate is not None else 0
            if n <= 0 or not self.pager.can_allocate(need + extra):
                if matched and self.prefix_cache is not None:
                    self.prefix_cache.unmatch(req, matched)
                    req.page_ids, req.num_computed_tokens = [], 0
                break
            if self.prefix_cache is not None:
                self.prefix_cache.record_admission(req, req.num_computed_tokens)
            self.waiting.remove(req)
            if self.gate is not None:
                load = self.gate.acquire(req)
                if load is not None:
                    loads.append(load)
            req.page_ids.extend(self.pager.allocate(need))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            slots += self._num_slots(req)
            if cap and digest:
                active.add(digest)
            decode = self._decoding(req)
            shape.add(req.num_computed_tokens, n, decode, digest, loaded)
            prefilled = prefilled or not decode
            paced -= 0 if decode else n
            self._charge(req, n)  # at once, so the next pick sees this admission
            scheduled.append(req)
            counts.append(n)
            budget -= n
        return ScheduledBatch(scheduled, counts, preempted, copies, shape.shape(), loads,
                              refused)

    def _refuse(self, now: float | None) -> list[tuple[Request, str]]:
        failures = self.gate.take_failures() if self.gate is not None else {}
        refused = []
        for req in list(self.waiting):
            error = self._refusal(req, failures, now)
            if error is not None:
                req.error = error
                self.finish(req, RequestStatus.FINISHED_ERROR)
                refused.append((req, error))
        return refused

    def _refusal(self, req: Request, failures: dict[str, str], now: float | None
                 ) -> str | None:
        """Why a waiting request can never run, or None: its adapter failed to load, its
        adapter and KV pages cannot fit the pool together, its grammar failed to compile or
        compiles for too long (``structured.*``), or its sequences exceed ``max_num_seqs``."""
        digest = req.adapter_digest
        if digest is not None and self.gate is not None:
            if digest in failures:
                return failures[digest]
            pages = self.gate.host_pages(digest)
            kv_pages = -(-req.max_total_tokens // self.config.page_size)
            if pages is not None and pages + kv_pages > self.pager.num_pages:
                return (f"adapter: {digest[:12]} needs {pages} pages beside {kv_pages} KV "
                        f"pages; the pool has {self.pager.num_pages}")
        if req.grammar is not None:
            error = req.grammar.poll(now if now is not None else -math.inf)
            if error is not None:
                return error
        num_seqs = self._num_slots(req)
        if num_seqs > self.config.max_num_seqs:
            return (f"n: {num_seqs} sequences exceed the engine's max_num_seqs "
                    f"({self.config.max_num_seqs})")
        return None

    def _shared_tail(self, request: Request) -> int | None:
        """The index of the partly filled page the request writes next, when siblings share
        it (only a forked sequence's last prompt page: cached prefix pages are full)."""
        if request.num_computed_tokens % self.config.page_size == 0:
            return None
        index = request.num_computed_tokens // self.config.page_size
        return index if self.pager.is_shared(request.page_ids[index]) else None

    def fork(self, parent: Request, children: Iterable[Request]) -> None:
        """Start ``children`` (the other sequences of ``parent``'s prompt) running on its
        pages: each holds every one of them once more (no page is allocated or computed),
        and the first write into the shared last page copies it (``_shared_tail``). The
        prompt was charged to ``parent`` for fairness; the children are charged their own
        output tokens only."""
        for child in children:
            child.page_ids = list(parent.page_ids)
            self.pager.share(child.page_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_charged_tokens = parent.num_charged_tokens
            child.status = RequestStatus.RUNNING
            if self.gate is not None:
                # The parent runs with the adapter pinned: resident, so nothing to copy.
                self.gate.acquire(child)
            self.running.append(child)

    def _preempt(self, request: Request) -> None:
        # Recompute: drop the KV, keep the tokens; the request re-enters at the queue's head.
        request.draft_token_ids = []
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
        """End a request (finished, aborted or failed) and return its pages at once; its
        unforked siblings end with it (``take_orphans``). Finishing a finished request again
        sets only its status (a stop string found after a length finish is a stop)."""
        if request.finished:
            request.status = status
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request, finished=True)
        request.status = status
        for child in self._unforked.pop(request.request_id, []):
            child.error = request.error
            child.status = status
            self._orphans.append(child)
