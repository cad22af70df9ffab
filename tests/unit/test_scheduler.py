"""The scheduler, with no model: budgets, chunked prefill, preemption, pages back to zero."""

from __future__ import annotations

from loraplex.server.config import SchedulerConfig
from loraplex.server.engine.batch import Accepted, AdapterLoad, TokenUpdate
from loraplex.server.engine.pager import Pager
from loraplex.server.engine.request import Request, RequestStatus, SamplingParams
from loraplex.server.engine.scheduler import Scheduler


def make_request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))


def fake_step(sched: Scheduler) -> tuple[list[tuple[str, int]], list[Request]]:
    """Schedule, pretend the model ran, append a token where the gap closed."""
    batch = sched.schedule()
    done = []
    for req, n in zip(batch.requests, batch.num_new_tokens):
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(1)
            if req.num_output_tokens >= req.params.max_tokens:
                done.append(req)
    for req in done:
        sched.finish(req, RequestStatus.FINISHED_LENGTH)
    return list(zip([r.request_id for r in batch.requests], batch.num_new_tokens)), done


def run_all(sched: Scheduler, check=None, limit=10_000) -> int:
    steps = 0
    while sched.has_unfinished():
        scheduled, _ = fake_step(sched)
        if check:
            check(scheduled)
        steps += 1
        assert steps < limit, "scheduler made no progress"
    return steps


def test_budgets_respected_and_pages_return():
    cfg = SchedulerConfig(page_size=4, max_num_seqs=3, max_num_batched_tokens=10)
    pager = Pager(64)
    sched = Scheduler(cfg, pager)
    for i in range(8):
        sched.add(make_request(f"r{i}", 3 + 5 * i, 4 + i))

    def check(scheduled):
        assert sum(n for _, n in scheduled) <= 10
        assert len(scheduled) <= 3
        assert sched.num_running <= 3

    run_all(sched, check)
    assert pager.num_free == 64


def test_decodes_keep_running_while_a_long_prompt_prefills():
    cfg = SchedulerConfig(page_size=4, max_num_batched_tokens=8)
    sched = Scheduler(cfg, Pager(128))
    decoders = [make_request(f"d{i}", 2, 50) for i in range(3)]
    for r in decoders:
        sched.add(r)
    fake_step(sched)
    fake_step(sched)  # all three are decoding now
    sched.add(make_request("long", 100, 1))
    prefill_steps = 0
    while any(r.request_id == "long" for r in sched.running + list(sched.waiting)):
        scheduled, _ = fake_step(sched)
        names = dict(scheduled)
        assert all(names.get(r.request_id) == 1 for r in decoders), scheduled
        if "long" in names:
            prefill_steps += 1
            assert names["long"] <= 5
    assert prefill_steps >= 20  # 100 tokens in chunks of at most 5


def test_long_prefill_threshold_chunks_a_prompt():
    cfg = SchedulerConfig(page_size=4, max_num_batched_tokens=100,
                          long_prefill_token_threshold=7)
    sched = Scheduler(cfg, Pager(64))
    sched.add(make_request("p", 30, 1))
    chunks = []
    while sched.has_unfinished():
        scheduled, _ = fake_step(sched)
        chunks.extend(n for _, n in scheduled)
    assert chunks == [7, 7, 7, 7, 2]


def test_preemption_takes_the_newest_and_everyone_finishes():
    cfg = SchedulerConfig(page_size=2, max_num_batched_tokens=64)
    pager = Pager(12)  # 24 token slots for 3 requests that each grow to 12 tokens
    sched = Scheduler(cfg, pager)
    reqs = [make_request(f"r{i}", 4, 8) for i in range(3)]
    for r in reqs:
        sched.add(r)
    first_preempted = []

    def check(scheduled):
        if sched.num_preemptions and not first_preempted:
            first_preempted.append([r.request_id for r in reqs if r.num_preemptions])

    run_all(sched, check)
    assert sched.num_preemptions > 0
    assert first_preempted[0] == ["r2"]
    assert all(r.num_output_tokens == 8 for r in reqs)
    assert pager.num_free == 12


def test_admission_waits_for_pages():
    cfg = SchedulerConfig(page_size=4, max_num_batched_tokens=100)
    pager = Pager(4)
    sched = Scheduler(cfg, pager)
    sched.add(make_request("big", 14, 2))
    sched.add(make_request("next", 8, 1))
    scheduled, _ = fake_step(sched)
    assert [r for r, _ in scheduled] == ["big"]  # 4 pages taken, "next" must wait
    run_all(sched)
    assert pager.num_free == 4


def test_finish_frees_a_waiting_or_running_request():
    sched = Scheduler(SchedulerConfig(page_size=4), Pager(16))
    a, b = make_request("a", 10, 5), make_request("b", 10, 5)
    sched.add(a)
    fake_step(sched)
    sched.add(b)
    assert a.page_ids
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished() and sched.pager.num_free == 16
    assert a.status is RequestStatus.FINISHED_ABORTED


class StubGate:
    """Adapters as the scheduler sees them: ready or loading, and their page cost."""

    def __init__(self, loading=()):
        self.loading = set(loading)
        self.acquired = []

    def ready(self, request):
        return request.adapter_digest not in self.loading

    def pages_needed(self, request):
        return 0

    def pages_to_load(self, request):
        return 0

    def acquire(self, request):
        self.acquired.append(request.request_id)

    def release(self, request):
        pass

    def begin_step(self):
        pass

    def take_failures(self):
        return {}

    def host_pages(self, digest):
        return None


def test_a_loading_adapter_does_not_block_the_queue():
    gate = StubGate(loading={"slow"})
    sched = Scheduler(SchedulerConfig(page_size=4), Pager(64), gate)
    first = make_request("first", 4, 2)
    first.adapter_digest = "slow"
    sched.add(first)
    sched.add(make_request("second", 4, 2))
    scheduled, _ = fake_step(sched)
    assert [r for r, _ in scheduled] == ["second"]
    assert sched.waiting[0] is first  # keeps its place at the head
    gate.loading.clear()
    scheduled, _ = fake_step(sched)
    assert "first" in dict(scheduled)


def test_distinct_adapter_cap_per_step():
    sched = Scheduler(SchedulerConfig(page_size=4, max_adapters_per_step=2), Pager(64),
                      StubGate())
    for i, digest in enumerate(["a", "b", "c", "a", None]):
        req = make_request(f"r{i}", 4, 3)
        req.adapter_digest = digest
        sched.add(req)
    scheduled, _ = fake_step(sched)
    assert sorted(r for r, _ in scheduled) == ["r0", "r1", "r3", "r4"]  # "c" waits
    run_all(sched)
    assert sched.pager.num_free == 64


def test_forked_sequences_copy_the_shared_page_once_each_and_preempt_alone():
    pager = Pager(9)
    sched = Scheduler(SchedulerConfig(page_size=4, max_num_batched_tokens=64), pager)
    parent = make_request("p", 6, 10)  # one full page + 2 tokens
    children = [make_request(f"c{i}", 6, 10) for i in range(2)]
    sched.add(parent)
    fake_step(sched)  # prefill: 2 pages, the first token
    for c in children:
        c.output_token_ids.append(1)
    sched.fork(parent, children)
    assert pager.stats().num_kv == 2 and pager.num_free == 7
    shared = parent.page_ids[1]
    batch = sched.schedule()  # each writes position 6, in the shared second page
    assert len(batch.page_copies) == 2 and pager.stats().num_kv == 4
    assert {s for s, _ in batch.page_copies} == {shared}
    # In running order: the first two copy, the last holder keeps the page itself.
    assert [d for _, d in batch.page_copies] == [parent.page_ids[1], children[0].page_ids[1]]
    assert children[1].page_ids[1] == shared
    assert all(r.page_ids[0] == parent.page_ids[0] for r in children)  # full page: shared
    for req, n in zip(batch.requests, batch.num_new_tokens):
        req.num_computed_tokens += n
    sched._preempt(children[1])  # frees its private page only; the shared one stays
    assert pager.stats().num_kv == 3 and not pager.is_shared(children[0].page_ids[1])
    for req in (parent, children[0]):
        sched.finish(req, RequestStatus.FINISHED_LENGTH)
    sched.finish(children[1], RequestStatus.FINISHED_ABORTED)
    assert pager.num_free == 9 and pager.stats().num_kv == 0


def test_forked_sequences_are_charged_their_outputs_not_the_prompt_again():
    sched = Scheduler(SchedulerConfig(page_size=4, scheduling="vtc"), Pager(16))
    assert sched.vtc is not None
    parent = make_request("p", 6, 10)
    children = [make_request(f"c{i}", 6, 10) for i in range(2)]
    sched.add(parent)
    fake_step(sched)
    assert sched.vtc.counters["default"] == 6  # the prompt, once (input weight 1)
    for c in children:
        c.output_token_ids.append(1)
    sched.fork(parent, children)
    fake_step(sched)  # three decodes of one token each (output weight 2)
    assert sched.vtc.counters["default"] == 6 + 3 * 2


class SizedGate(StubGate):
    """A gate whose adapters are ``pages`` pages, and some of whose loads failed."""

    def __init__(self, pages, failures=()):
        super().__init__()
        self.pages, self.failures = pages, dict(failures)

    def take_failures(self):
        failures, self.failures = self.failures, {}
        return failures

    def host_pages(self, digest):
        return self.pages

    def acquire(self, request):
        super().acquire(request)
        return AdapterLoad(request.adapter_digest, (0, 1)) if request.adapter_digest else None


def test_requests_that_can_never_run_are_refused_with_their_reason():
    sched = Scheduler(SchedulerConfig(page_size=4), Pager(16),
                      SizedGate(14, failures={"broken": "adapter broken failed to load: no"}))
    big = make_request("big", 8, 4)  # 3 KV pages beside 14 adapter pages: over 16
    big.adapter_digest = "huge"
    broken = make_request("broken", 4, 2)
    broken.adapter_digest = "broken"
    sched.add(big)
    sched.add(broken)
    sched.add(make_request("plain", 4, 2))
    batch = sched.schedule()
    assert [(r.request_id, why) for r, why in batch.refused] == [
        ("big", "adapter: huge needs 14 pages beside 3 KV pages; the pool has 16"),
        ("broken", "adapter broken failed to load: no")]
    assert big.status is RequestStatus.FINISHED_ERROR and big.error.startswith("adapter: huge")
    assert [r.request_id for r in batch.requests] == ["plain"]


def test_the_batch_carries_the_adapter_copies_admission_reserved():
    sched = Scheduler(SchedulerConfig(page_size=4), Pager(16), SizedGate(2))
    req = make_request("r", 4, 2)
    req.adapter_digest = "a"
    sched.add(req)
    sched.add(make_request("base", 4, 2))
    batch = sched.schedule()
    assert batch.adapter_loads == [AdapterLoad("a", (0, 1))]


def test_update_advances_and_accepts_tokens_up_to_the_first_that_finishes():
    pager = Pager(16)
    sched = Scheduler(SchedulerConfig(page_size=4), pager, eos_token_ids=[99])
    req = make_request("r", 5, 10)
    sched.add(req)
    batch = sched.schedule()
    # Several tokens per request (speculation's shape): EOS at the second ends it there.
    update = sched.update(batch, [Accepted(req, [7, 99, 8], [None, None, None])], now=3.0)
    assert req.num_computed_tokens == 5 and req.first_scheduled_time == 3.0
    assert update.tokens == [TokenUpdate(req, [7, 99], [None, None],
                                         RequestStatus.FINISHED_STOPPED)]
    assert req.output_token_ids == [7, 99] and req.finished
    assert not sched.has_unfinished() and pager.num_free == 16


def test_update_forks_the_siblings_when_sequence_zero_accepts():
    pager = Pager(16)
    sched = Scheduler(SchedulerConfig(page_size=4, max_num_seqs=3), pager)
    parent = make_request("p", 6, 4)
    children = [make_request(f"c{i}", 6, 4) for i in range(2)]
    sched.add(parent, children)
    assert sched.pending_forks(parent) == tuple(children)
    batch = sched.schedule()
    update = sched.update(batch, [Accepted(r, [i], [None]) for i, r in
                                  enumerate([parent, *children])])
    assert [u.token_ids for u in update.tokens] == [[0], [1], [2]]
    assert all(r.status is RequestStatus.RUNNING for r in children)
    assert sched.num_running == 3 and pager.stats().num_kv == 2  # the prompt's pages, once
    for r in (parent, *children):
        sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert pager.num_free == 16


def test_a_group_waits_for_all_its_running_slots():
    sched = Scheduler(SchedulerConfig(page_size=4, max_num_seqs=3), Pager(64))
    sched.add(make_request("solo", 4, 3))
    sched.add(make_request("p", 4, 3), [make_request(f"c{i}", 4, 3) for i in range(2)])
    scheduled, _ = fake_step(sched)
    assert [r for r, _ in scheduled] == ["solo"]  # the group needs 3 slots; 2 are free


def test_a_sequence_zero_ending_before_the_fork_ends_its_siblings():
    sched = Scheduler(SchedulerConfig(page_size=4), Pager(16))
    parent = make_request("p", 4, 3)
    children = [make_request(f"c{i}", 4, 3) for i in range(2)]
    sched.add(parent, children)
    parent.error = "gone"
    sched.finish(parent, RequestStatus.FINISHED_ERROR)
    orphans = sched.take_orphans()
    assert orphans == children and all(c.error == "gone" and c.finished for c in orphans)
    assert sched.take_orphans() == []
