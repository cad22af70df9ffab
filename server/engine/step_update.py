"""The scheduler's post-step phase: ``update`` records what a step computed and appends the
tokens each request accepted (a verified draft's accepted prefix keeping only its KV), finishing
what needs no text. A base class of ``Scheduler`` (``scheduler.py`` holds admission and the
step's batch), split by phase; it reads the scheduler's state named below."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from loraplex.server.config import SchedulerConfig
from loraplex.server.engine.batch import Accepted, ScheduledBatch, StepUpdate, TokenUpdate
from loraplex.server.engine.pager import Pager
from loraplex.server.engine.prefix_cache import PrefixCache
from loraplex.server.engine.request import Request, RequestStatus, TokenLogprob
from loraplex.server.engine.spec.speculator import roll_back

logger = logging.getLogger(__name__)


class StepUpdater:
    """``update`` / ``accept`` over the scheduler's pages, prefix cache and finish rules."""

    config: SchedulerConfig
    pager: Pager
    prefix_cache: PrefixCache | None
    eos_token_ids: frozenset[int]
    max_model_len: int | None
    _unforked: dict[str, list[Request]]

    def fork(self, parent: Request, children: Iterable[Request]) -> None:
        raise NotImplementedError

    def finish(self, request: Request, status: RequestStatus) -> None:
        raise NotImplementedError

    def update(self, batch: ScheduledBatch, accepted: Sequence[Accepted],
               prompt_logprobs: Iterable[tuple[Request, list[TokenLogprob]]] = (),
               now: float | None = None) -> StepUpdate:
        """Record a step's results: what the batch computed, then the tokens accepted.

        Every scheduled request advances ``num_computed_tokens`` by its chunk (stamped
        ``first_scheduled_time = now`` on its first step) and offers its newly filled pages to
        the prefix cache; a sequence 0 that accepts its first token forks its siblings onto
        its pages (``fork``); then each request appends its accepted tokens (``accept``).
        Requests that finish (by a stop token, EOS, length or grammar completion: every
        finish that needs no text) return their pages now. A failure here is one request's:
        it finishes that request with the error, and the rest go on. A request that verified
        a draft advances by its last known token only, then by the draft tokens it accepted
        (``_accept_verified``), and the rest of its chunk is rolled back.

        Args:
            batch: what ``schedule`` returned for this step.
            accepted: per request, the tokens it accepts, in order (a forked sibling after
                its sequence 0).
            prompt_logprobs: the prompt logprobs the step computed, continuing each list.
            now: the caller's clock.
        """
        failed: list[Request] = []
        for req, entries in prompt_logprobs:
            req.prompt_logprobs.extend(entries)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            try:
                # A draft's positions count once verified (``_accept_verified``).
                req.num_computed_tokens += n - len(req.draft_token_ids)
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                if self.prefix_cache is not None:
                    self.prefix_cache.register(req)
            except Exception as exc:
                failed.append(self._fail(req, f"internal error after the model step: {exc}"))
        tokens: list[TokenUpdate] = []
        for entry in accepted:
            req = entry.request
            if req.status is not RequestStatus.RUNNING:
                continue  # failed above, or a sibling whose sequence 0 did not accept
            try:
                children = self._unforked.pop(req.request_id, None)
                if children:
                    self.fork(req, children)
                if req.draft_token_ids:
                    tokens.append(self._accept_verified(req, entry.token_ids, entry.logprobs))
                else:
                    tokens.append(self.accept(req, entry.token_ids, entry.logprobs))
            except Exception as exc:
                failed.append(self._fail(req, f"internal error in postprocessing: {exc}"))
        for req in batch.requests:
            req.draft_token_ids = []
        return StepUpdate(tokens, failed)

    def _accept_verified(self, request: Request, token_ids: Sequence[int],
                         logprobs: Sequence[TokenLogprob | None]) -> TokenUpdate:
        """``accept`` for the tokens of a verified draft (its accepted prefix, then the
        target's own token: ``Speculator.verify``), keeping the KV of accepted positions only.

        Invariant: before token ``j`` is appended, ``num_computed_tokens`` counts the known
        positions whose KV this step left valid (the last known token, then ``j`` accepted
        draft tokens) and the prefix cache has seen each newly full page, so pages and cache
        entries are those of decoding without speculation; what only the rejected tail used
        goes back to the pager (``roll_back``)."""
        base = request.num_computed_tokens
        status = None
        taken = 0
        for j, (token, lp) in enumerate(zip(token_ids, logprobs)):
            if j:
                request.num_computed_tokens = base + j
                if self.prefix_cache is not None:
                    self.prefix_cache.register(request)
            request.append_token(token, lp)
            taken += 1
            status = request.stop_status(token, self.eos_token_ids, self.max_model_len)
            if status is not None:
                self.finish(request, status)
                break
        if status is None:
            roll_back(request, base + len(token_ids) - 1, self.config.page_size, self.pager)
        return TokenUpdate(request, list(token_ids[:taken]), list(logprobs[:taken]), status)

    def accept(self, request: Request, token_ids: Sequence[int],
               logprobs: Sequence[TokenLogprob | None]) -> TokenUpdate:
        """Append tokens to a running request up to the first that finishes it (grammar
        complete, a stop token, EOS unless ``ignore_eos``, ``max_tokens``, the model's
        length); a finished request returns its pages at once."""
        status = None
        taken = 0
        for token, lp in zip(token_ids, logprobs):
            request.append_token(token, lp)
            taken += 1
            status = request.stop_status(token, self.eos_token_ids, self.max_model_len)
            if status is not None:
                self.finish(request, status)
                break
        return TokenUpdate(request, list(token_ids[:taken]), list(logprobs[:taken]), status)

    def _fail(self, request: Request, error: str) -> Request:
        logger.exception("request %s failed: %s", request.request_id, error)
        request.error = error
        self.finish(request, RequestStatus.FINISHED_ERROR)
        return request

