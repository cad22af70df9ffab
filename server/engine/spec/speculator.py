"""The engine's speculative decoding: which requests propose, their drafts each step under a
cost gate, and the verification of their rows.

A speculating decode request computes ``1 + d`` query tokens in one step: its last known
token (not yet in its KV) and its draft ``x_1 .. x_d``, like a tiny prefill chunk through
paged attention and its own adapter's LoRA segment. The runner returns the logits of those
``1 + d`` positions, the sampler picks a token per row (greedy argmax, or a draw with the
request's next uniform), and ``verify`` (``accept.py``) keeps the longest agreeing prefix
plus one target token. What was computed for the rejected tail is rolled back
(``roll_back``): the computed-token count, and any page allocated only for it.

The tokens never depend on k, on the draft or on the batch (greedy: the argmax path;
sampled: one uniform per emitted token, ``accept.py``), so whether to speculate is a question
of speed only: ``draft`` asks the step cost model whether each draft pays in this step (a
decode row costs little next to the weights' read at small batches, as much as a token's
share at large ones).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from loraplex.server.engine.pager import Pager
from loraplex.server.engine.request import Request
from loraplex.server.engine.spec.accept import Verdict, keep_draws, verify
from loraplex.server.engine.spec.proposer import NgramProposer, Proposer
from loraplex.server.engine.spec.state import SpecState
from loraplex.server.engine.step_cost import StepShape, context_tokens

# Expected per-token acceptance of a request's first draft past its probe token (it has no
# verified draft yet): a guess, used only to decide whether the rest of that draft pays.
PRIOR_ACCEPTANCE = 0.5


@dataclass(frozen=True)
class SpecStats:
    """Totals since start, for ``EngineStats`` and metrics."""

    num_proposed_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of them, accepted
    num_verifications: int = 0  # request-steps that verified a draft
    num_emitted_tokens: int = 0  # tokens appended by those verifications (accepted + 1 each)
    num_gated_tokens: int = 0  # draft tokens proposed but not verified (the cost gate)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_proposed_tokens if self.num_proposed_tokens \
            else 0.0

    @property
    def tokens_per_verification(self) -> float:
        return self.num_emitted_tokens / self.num_verifications if self.num_verifications \
            else 0.0


class Speculator:
    """Drafts for the scheduler, verification for the step's update.

    Args:
        num_speculative_tokens: the most draft tokens per request and step.
        ngram_min / ngram_max: the prompt-lookup proposer's n-gram sizes.
        max_model_len: the context; a draft never reaches past it.
        cost_gate: weigh each draft token against the step cost model (``draft``); off,
            every draft is verified.
        proposer: another proposer (default: n-gram prompt lookup).
    """

    def __init__(self, num_speculative_tokens: int, ngram_min: int, ngram_max: int,
                 max_model_len: int, cost_gate: bool = True, proposer: Proposer | None = None
                 ) -> None:
        self.max_k = num_speculative_tokens
        self.cost_gate = cost_gate
        self.max_model_len = max_model_len
        self.proposer: Proposer = proposer or NgramProposer(ngram_min, ngram_max)
        self._stats = SpecStats()

    @staticmethod
    def eligible(req: Request) -> bool:
        """Whether ``req`` may speculate now. Not: one with repetition / frequency / presence
        penalties (each row's table would need the draft before it), one still under
        ``min_tokens`` (its rows' masks differ). A structured-output request does: its
        matcher fills each row's mask through the draft and rolls back
        (``GrammarState.fill_draft``)."""
        p = req.params
        return (p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
                and p.presence_penalty == 0.0 and req.num_output_tokens >= p.min_tokens)

    def draft(self, requests: Sequence[Request], cost: Callable[[StepShape], float] | None
              ) -> None:
        """Set each decode request's ``draft_token_ids`` for this step (possibly empty).

        Args:
            requests: the step's decode requests (``num_computed_tokens == num_tokens - 1``).
            cost: predicted seconds of a step's shape; drafts that do not pay in this step
                (expected accepted tokens per second below the step's own rate) are dropped.
                None, or a model that predicts nothing yet: every draft is kept.
        """
        wanted: list[Request] = []
        ks: list[int] = []
        for req in requests:
            req.draft_token_ids = []
            if not self.eligible(req):
                continue
            if req.spec is None:
                req.spec = SpecState(self.proposer.new_context(), self.max_k)
            room = min(req.params.max_tokens - req.num_output_tokens - 1,
                       self.max_model_len - 1 - req.num_tokens)
            k = min(req.spec.next_k(), room)
            if k > 0:
                wanted.append(req)
                ks.append(k)
        if not wanted:
            return
        drafts = self.proposer.propose([r.spec.context for r in wanted if r.spec is not None],
                                       [r.all_token_ids for r in wanted], ks)
        chosen = self._gate(requests, list(zip(wanted, drafts)),
                            cost if self.cost_gate else None)
        for req, draft in chosen:
            req.draft_token_ids = draft
        gated = sum(len(d) for _, d in zip(wanted, drafts)) - sum(len(d) for _, d in chosen)
        if gated:
            s = self._stats
            self._stats = SpecStats(s.num_proposed_tokens, s.num_accepted_tokens,
                                    s.num_verifications, s.num_emitted_tokens,
                                    s.num_gated_tokens + gated)

    def _gate(self, requests: Sequence[Request], drafts: list[tuple[Request, list[int]]],
              cost: Callable[[StepShape], float] | None) -> list[tuple[Request, list[int]]]:
        """The draft tokens worth verifying this step: token ``j`` of a draft is expected to
        be accepted with probability ``a^j`` (``a``: its request's per-token acceptance);
        tokens are added best first, across requests, while the step's expected tokens per
        predicted second keep growing (a draft is cut where its next token stops paying).

        A request with no verified draft yet has no ``a``: its first draft token is verified
        whatever the batch (a probe: one token, once), and the rest of that draft is priced
        at ``PRIOR_ACCEPTANCE``. Without the probe a large batch would never learn which of
        its requests copy; with a prior taken from other requests, requests that do not
        copy would each pay a whole first draft."""
        drafts = [(r, d) for r, d in drafts if d]
        if cost is None or not drafts:
            return drafts
        shape = StepShape(num_decode_tokens=len(requests),
                          num_context_tokens=sum(context_tokens(r.num_computed_tokens, 1)
                                                 for r in requests),
                          num_adapters=len({r.adapter_digest for r in requests
                                            if r.adapter_digest is not None}))
        seconds = cost(shape)
        if seconds <= 0.0:
            return drafts  # the model has seen no step yet: nothing to weigh
        tokens = float(len(requests))
        kept = [0] * len(drafts)
        items = []  # (expected gain, which draft, its context before the token); j ascending
        for i, (req, draft) in enumerate(drafts):
            state = req.spec
            known = state is not None and state.num_proposed > 0
            a = state.acceptance_rate if state is not None and known else PRIOR_ACCEPTANCE
            for j in range(1, len(draft) + 1):
                keys = req.num_computed_tokens + j + 1
                if j == 1 and not known:  # the probe
                    shape = StepShape(shape.num_prefill_tokens, shape.num_decode_tokens + 1,
                                      shape.num_context_tokens + keys, shape.num_adapters)
                    tokens += a
                    kept[i] = 1
                    continue
                items.append((a ** j, i, keys))
        seconds = cost(shape) if any(kept) else seconds
        items.sort(key=lambda item: -item[0])  # stable: a draft's tokens stay in order
        for gain, i, keys in items:
            after_shape = StepShape(shape.num_prefill_tokens, shape.num_decode_tokens + 1,
                                    shape.num_context_tokens + keys, shape.num_adapters)
            after = cost(after_shape)
            if after > 0 and (tokens + gain) / after <= tokens / seconds:
                break  # the best remaining token does not pay: nor does any after it
            tokens, seconds, shape = tokens + gain, after, after_shape
            kept[i] += 1
        return [(req, draft[:n]) for (req, draft), n in zip(drafts, kept) if n]

    @staticmethod
    def generator_state(req: Request) -> torch.Tensor | None:
        """The generator state to rewind to after verification (a sampled request with a
        draft draws one uniform per row), else None."""
        if req.draft_token_ids and not req.params.greedy and req.generator is not None:
            return req.generator.get_state()
        return None

    def verify(self, req: Request, target_token_ids: Sequence[int],
               generator_state: torch.Tensor | None) -> Verdict:
        """Accept ``req``'s draft against its rows' tokens (``[1 + d]``), rewind its
        generator to one draw per emitted token, learn k and count. The draft stays on the
        request: ``Scheduler.update`` rolls back by it, then clears it."""
        draft = req.draft_token_ids
        verdict = verify(draft, target_token_ids)
        if generator_state is not None and req.generator is not None:
            keep_draws(req.generator, generator_state, len(verdict.token_ids))
        if draft and req.spec is not None:
            req.spec.update(len(draft), verdict.num_accepted)
            s = self._stats
            self._stats = SpecStats(s.num_proposed_tokens + len(draft),
                                    s.num_accepted_tokens + verdict.num_accepted,
                                    s.num_verifications + 1,
                                    s.num_emitted_tokens + len(verdict.token_ids),
                                    s.num_gated_tokens)
        return verdict

    def stats(self) -> SpecStats:
        return self._stats


def roll_back(req: Request, num_computed_tokens: int, page_size: int, pager: Pager) -> None:
    """Keep only the KV of ``req``'s first ``num_computed_tokens`` positions: the count, and
    the pages beyond the ones those positions fill go back to the pager (last first). A
    rejected slot in a kept page is simply overwritten when its position is computed again.
    """
    req.num_computed_tokens = num_computed_tokens
    keep = -(-num_computed_tokens // page_size)
    extra = req.page_ids[keep:]
    if extra:
        pager.free(extra[::-1])
        del req.page_ids[keep:]
