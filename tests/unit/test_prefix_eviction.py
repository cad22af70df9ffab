"""Prefix pages freed last page first, so under pressure the longest cached prefixes survive
(issue 13, finding 8). Scheduler, pager and prefix cache only: no model, no tensors."""

from __future__ import annotations

from loraplex.server.config import SchedulerConfig
from loraplex.server.engine.pager import Pager
from loraplex.server.engine.prefix_cache import PrefixCache
from loraplex.server.engine.request import Request, RequestStatus, SamplingParams
from loraplex.server.engine.scheduler import Scheduler

PAGE = 4


def run_to_end(sched: Scheduler, cache: PrefixCache, req: Request) -> None:
    """Schedule ``req`` until its prompt is computed (pretending the model ran), register its
    full pages, then finish it."""
    sched.add(req)
    while req.num_computed_tokens < req.num_tokens:
        batch = sched.schedule()
        for r, n in zip(batch.requests, batch.num_new_tokens):
            r.num_computed_tokens += n
            cache.register(r)
    sched.finish(req, RequestStatus.FINISHED_LENGTH)


def matched_pages(cache: PrefixCache, prompt: list[int], rid: str) -> int:
    probe = Request(rid, prompt, SamplingParams(max_tokens=1))
    pages = cache.match(probe)
    cache.unmatch(probe, pages)
    return len(pages)


def test_the_longest_prefixes_survive_eviction():
    pager = Pager(12)
    cache = PrefixCache(pager, PAGE, "rev")
    sched = Scheduler(SchedulerConfig(page_size=PAGE), pager, prefix_cache=cache)
    prompts = [[i * 100 + t for t in range(4 * PAGE + 1)] for i in range(2)]  # 4 full pages
    for i, prompt in enumerate(prompts):
        run_to_end(sched, cache, Request(f"r{i}", prompt, SamplingParams(max_tokens=1)))
    assert [matched_pages(cache, p, f"probe{i}") for i, p in enumerate(prompts)] == [4, 4]
    assert pager.stats().num_prefix == 8
    # Pressure: a KV allocation takes 7 of the 8 cached pages (4 free pages first, then LRU).
    pages = pager.allocate(4 + 3)
    # The oldest request's deepest pages went first: its first page still matches. Freed
    # front to back, its first page would have gone first and nothing would match.
    assert matched_pages(cache, prompts[0], "after0") == 1
    assert matched_pages(cache, prompts[1], "after1") == 4
    pager.free(pages)
    pages = pager.allocate(len(pages) + 2)  # two more: r0's last page, then r1's deepest
    assert matched_pages(cache, prompts[0], "again0") == 0
    assert matched_pages(cache, prompts[1], "again1") == 3


def test_a_matched_prefix_not_admitted_goes_back_to_the_cache():
    """Admission matches a cached prefix, then finds no room for the rest: the matched pages
    go back through ``PrefixCache.unmatch`` (unpinned, still cached, still matching), and the
    request waits holding nothing (issue 15, item 5)."""
    pager = Pager(8)
    cache = PrefixCache(pager, PAGE, "rev")
    sched = Scheduler(SchedulerConfig(page_size=PAGE), pager, prefix_cache=cache)
    prompt = list(range(2 * PAGE + 1))  # 2 full pages cached when it ends
    run_to_end(sched, cache, Request("r0", prompt, SamplingParams(max_tokens=1)))
    assert pager.stats().num_prefix == 2
    held = pager.allocate(pager.num_free)  # every free page taken: only the cache's are left
    late = Request("r1", prompt + list(range(100, 100 + 4 * PAGE)), SamplingParams(max_tokens=1))
    sched.add(late)
    batch = sched.schedule()
    assert batch.requests == [] and late.page_ids == [] and late.num_computed_tokens == 0
    assert late.status is RequestStatus.WAITING
    assert pager.stats().num_prefix == 2  # back in the cache, evictable again
    assert matched_pages(cache, prompt, "probe") == 2
    pager.free(held)
    while late.num_computed_tokens < late.num_tokens:  # room again: admitted on its prefix
        batch = sched.schedule()
        for r, n in zip(batch.requests, batch.num_new_tokens):
            r.num_computed_tokens += n
    assert late.num_cached_tokens == 2 * PAGE
