"""The Speculator without a model: who drafts, how long, the cost gate, verification and the
roll-back of rejected slots."""

from __future__ import annotations

import torch

from loraplex.server.config import SchedulerConfig
from loraplex.server.engine.batch import Accepted
from loraplex.server.engine.pager import Pager
from loraplex.server.engine.request import Request, RequestStatus, SamplingParams
from loraplex.server.engine.scheduler import Scheduler
from loraplex.server.engine.spec.speculator import Speculator, roll_back
from loraplex.server.engine.step_cost import StepShape

REPEAT = [5, 6, 7, 8, 9, 10, 11, 12]


def _decoding(prompt: list[int], outputs: list[int], **params) -> Request:
    params.setdefault("max_tokens", 64)
    req = Request(f"r{len(prompt)}", list(prompt), SamplingParams(**params))
    req.output_token_ids = list(outputs)
    req.num_computed_tokens = req.num_tokens - 1
    return req


def test_draft_proposes_the_repeated_continuation():
    spec = Speculator(4, 2, 3, max_model_len=256)
    req = _decoding(REPEAT + [1] + REPEAT[:3], [])
    spec.draft([req], None)
    assert req.draft_token_ids == REPEAT[3:7]
    miss = _decoding([1, 2, 3, 4], [])
    spec.draft([miss], None)
    assert miss.draft_token_ids == []


def test_ineligible_requests_do_not_draft():
    spec = Speculator(4, 2, 3, max_model_len=256)
    prompt = REPEAT + REPEAT[:3]
    for params in (dict(repetition_penalty=1.2), dict(frequency_penalty=0.5),
                   dict(presence_penalty=0.5), dict(min_tokens=2)):
        req = _decoding(prompt, [], **params)
        spec.draft([req], None)
        assert req.draft_token_ids == [], params
    assert spec.eligible(_decoding(prompt, [0, 0], min_tokens=2))


def test_draft_stops_at_max_tokens_and_the_context():
    spec = Speculator(4, 2, 3, max_model_len=256)
    prompt = REPEAT + REPEAT[:3]
    req = _decoding(prompt, [], max_tokens=3)  # 3 tokens left: a draft of 2 plus one
    spec.draft([req], None)
    assert req.draft_token_ids == REPEAT[3:5]
    spec = Speculator(4, 2, 3, max_model_len=len(prompt) + 2)
    req = _decoding(prompt, [])
    spec.draft([req], None)
    assert req.draft_token_ids == REPEAT[3:4]


def _cost(shape: StepShape) -> float:
    # A synthetic step: 100 ms of weights plus 10 ms per token.
    return 0.1 + 0.01 * shape.num_tokens


def test_cost_gate_drafts_at_small_batches_only():
    spec = Speculator(4, 2, 3, max_model_len=256)
    prompt = REPEAT + REPEAT[:3]
    one = [_decoding(prompt, [])]
    spec.draft(one, _cost)
    # No history: the first token is a probe, token j is priced at 0.5^j; the third no
    # longer pays (1.875 tokens in 140 ms against 1.75 in 130 ms).
    assert one[0].draft_token_ids == REPEAT[3:5]
    assert one[0].spec is not None
    one[0].spec.update(4, 4)  # a request whose drafts were all accepted drafts them whole
    spec.draft(one, _cost)
    assert len(one[0].draft_token_ids) == 4
    many = [_decoding([100 + i] + prompt, []) for i in range(64)]
    spec.draft(many, _cost)
    # A token costs its share of a big step: only each request's one probe token goes.
    assert all(len(r.draft_token_ids) == 1 for r in many)
    assert spec.stats().num_gated_tokens > 0
    for r in many[:32]:
        assert r.spec is not None
        r.spec.update(1, 1)  # their probes were accepted: they copy
    for r in many[32:]:
        assert r.spec is not None
        r.spec.update(1, 0)
        r.spec.pause = 0
    spec.draft(many, _cost)
    assert all(len(r.draft_token_ids) == 4 for r in many[:32])  # a = 1: every token pays
    assert all(not r.draft_token_ids for r in many[32:])  # a = 0: nothing does


def test_verify_counts_and_adapts():
    spec = Speculator(4, 2, 3, max_model_len=256)
    req = _decoding(REPEAT + REPEAT[:3], [])
    spec.draft([req], None)
    verdict = spec.verify(req, [8, 9, 0, 0, 0], None)
    assert verdict == ([8, 9, 0], 2)
    assert req.draft_token_ids == REPEAT[3:7]  # Scheduler.update rolls back by it
    assert req.spec is not None and req.spec.k == 3
    s = spec.stats()
    assert (s.num_proposed_tokens, s.num_accepted_tokens, s.num_verifications,
            s.num_emitted_tokens) == (4, 2, 1, 3)
    assert s.acceptance_rate == 0.5 and s.tokens_per_verification == 3.0


def test_sampled_verification_rewinds_the_generator():
    spec = Speculator(4, 2, 3, max_model_len=256)
    req = _decoding(REPEAT + REPEAT[:3], [], temperature=1.0)
    req.generator = torch.Generator().manual_seed(3)
    spec.draft([req], None)
    state = spec.generator_state(req)
    assert state is not None
    torch.rand(5, generator=req.generator, dtype=torch.float64)  # the sampler's 1 + 4 rows
    spec.verify(req, [8, 1, 0, 0, 0], state)  # two tokens emitted
    ref = torch.Generator().manual_seed(3)
    assert float(torch.rand(1, generator=req.generator, dtype=torch.float64)) == \
        float(torch.rand(3, generator=ref, dtype=torch.float64)[2])


def test_roll_back_returns_pages_only_the_rejected_tail_used():
    pager = Pager(16)
    req = _decoding(list(range(14)), [])
    req.page_ids = pager.allocate(4)  # 4 pages of 4 tokens: room for 16 positions
    roll_back(req, 9, 4, pager)
    assert req.num_computed_tokens == 9 and len(req.page_ids) == 3
    assert pager.num_free == 13
    roll_back(req, 12, 4, pager)
    assert len(req.page_ids) == 3 and pager.num_free == 13


# -- the scheduler with a speculator, no model ---------------------------------------------------


def _scheduler(num_pages: int) -> Scheduler:
    return Scheduler(SchedulerConfig(page_size=4, max_num_batched_tokens=64),
                     Pager(num_pages), speculator=Speculator(4, 2, 3, max_model_len=256,
                                                              cost_gate=False))


def _prefill(sched: Scheduler, prompts: list[list[int]]) -> list[Request]:
    """Admit and prefill every prompt in one step; each samples its first token (9)."""
    reqs = [Request(f"q{i}", list(p), SamplingParams(max_tokens=32))
            for i, p in enumerate(prompts)]
    for req in reqs:
        sched.add(req)
    batch = sched.schedule()
    assert batch.num_new_tokens == [len(p) for p in prompts]
    sched.update(batch, [Accepted(r, [9], [None]) for r in reqs])
    return reqs


LOOP = [5, 6, 7, 9, 5, 6, 7]  # after the first token (9), "7 9" -> "5 6 7 9 ..."


def test_a_draft_never_preempts():
    sched = _scheduler(num_pages=4)
    a, b = _prefill(sched, [LOOP, LOOP])  # 8 known tokens each: 2 pages each, pool full
    batch = sched.schedule()
    assert batch.preempted == []
    assert batch.num_new_tokens == [1, 1]  # drafts dropped: they needed a third page each
    assert a.draft_token_ids == [] and b.draft_token_ids == []
    assert sched.pager.num_free == 0


def test_the_budget_cuts_a_draft():
    sched = _scheduler(num_pages=16)
    (req,) = _prefill(sched, [LOOP])
    sched.config = SchedulerConfig(page_size=4, max_num_batched_tokens=3)
    batch = sched.schedule()
    assert batch.num_new_tokens == [3]
    assert req.draft_token_ids == [5, 6]  # 1 + 2: what the budget left of 5, 6, 7, 9


def test_a_request_the_budget_never_reaches_keeps_no_draft():
    sched = _scheduler(num_pages=16)
    a, b = _prefill(sched, [LOOP, LOOP])
    sched.config = SchedulerConfig(page_size=4, max_num_batched_tokens=5)
    batch = sched.schedule()
    assert batch.requests == [a] and batch.num_new_tokens == [5]  # a's 1 + 4 fill the budget
    assert b.draft_token_ids == []  # b's draft was for this step, which it is not in
    sched.update(batch, [Accepted(a, [5, 6, 7, 9, 5], [None] * 5)])
    assert b.num_computed_tokens == b.num_tokens - 1  # b still decodes from where it was


def test_update_keeps_the_accepted_positions_and_rolls_back_the_rest():
    sched = _scheduler(num_pages=16)
    (req,) = _prefill(sched, [LOOP])
    batch = sched.schedule()
    assert req.draft_token_ids == [5, 6, 7, 9] and batch.num_new_tokens == [5]
    assert len(req.page_ids) == 3  # positions 7..11: a third page for the draft
    # The model agreed with 5 and then said 8: tokens 5, 8; KV kept for 9 and 5.
    update = sched.update(batch, [Accepted(req, [5, 8], [None, None])])
    assert update.tokens[0].token_ids == [5, 8]
    assert req.output_token_ids == [9, 5, 8]
    assert req.num_computed_tokens == 9 == req.num_tokens - 1
    assert len(req.page_ids) == 3 and req.draft_token_ids == []
    batch = sched.schedule()  # "5 8" never occurred: no draft, one token
    assert batch.num_new_tokens == [1]
    sched.update(batch, [Accepted(req, [1], [None])])
    sched.finish(req, RequestStatus.FINISHED_ABORTED)
    assert sched.pager.num_free == 16


def test_rollback_frees_a_page_only_the_rejected_tail_used():
    sched = _scheduler(num_pages=16)
    (req,) = _prefill(sched, [LOOP])
    batch = sched.schedule()
    assert len(req.page_ids) == 3
    sched.update(batch, [Accepted(req, [1], [None])])  # nothing accepted
    assert req.num_computed_tokens == 8 and len(req.page_ids) == 2
    assert sched.pager.num_free == 14
