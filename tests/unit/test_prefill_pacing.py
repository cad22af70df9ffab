"""Prefill pacing (``prefill_pacing``, server/engine/pacing.py) with no model and no clock: a
closed loop of clients on a synthetic step cost, counted steps. Under a loose target, unpaced
steps alternate decode-only and target-filling ones (predicted ITL p99 several times p50);
paced, they stay even, for a few percent more steps, and every guarantee of the target holds."""

from __future__ import annotations

import random

import pytest

from loraplex.server.config import SchedulerConfig
from loraplex.server.engine.pacing import PrefillPacer
from loraplex.server.engine.pager import Pager
from loraplex.server.engine.request import RequestStatus
from loraplex.server.engine.scheduler import Scheduler
from tests.unit.test_step_sizing import Driver, check_within_target, linear_cost, make_request


def closed_loop(pacing: float, c0: float, clients: int = 8, total: int = 96,
                output: int = 48, target_ms: float = 250, seed: int = 0):
    """``clients`` closed-loop clients (one new request as one finishes), prompts of 64-192
    tokens. Returns the driver, the predicted gap of every decode token (each decode row of
    a step waits that step's predicted time), each request's TTFT in steps, the cost."""
    cost = linear_cost(c0=c0, prefill=2.5e-3, decode=5.5e-3, context=1e-6, adapters=0.0)
    cfg = SchedulerConfig(page_size=16, target_itl_ms=target_ms, min_prefill_chunk=32,
                          prefill_pacing=pacing)
    sched = Scheduler(cfg, Pager(4000), cost=cost)
    driver = Driver(sched)
    rng = random.Random(seed)
    arrived: dict[str, int] = {}
    live = []

    def arrive(step: int) -> None:
        req = make_request(f"r{len(arrived)}", rng.randint(64, 192), output)
        arrived[req.request_id] = step
        sched.add(req)
        live.append(req)

    for _ in range(clients):
        arrive(0)
    gaps: list[float] = []
    step = 0
    while sched.has_unfinished():
        driver.step()
        shape = driver.steps[-1][2]
        gaps += [cost(shape)] * shape.num_decode_tokens
        step += 1
        for req in [r for r in live if r.status is RequestStatus.FINISHED_LENGTH]:
            live.remove(req)
            if len(arrived) < total:
                arrive(step)
        assert step < 5000, "no progress"
    ttft = [driver.first_token[rid] - arrived[rid] for rid in arrived]
    return driver, sorted(gaps), ttft, cost


def p99_over_p50(gaps: list[float]) -> float:
    return gaps[int(len(gaps) * 0.99)] / gaps[len(gaps) // 2]


@pytest.mark.parametrize("c0", [0.02, 0.15])
def test_pacing_evens_the_steps_of_a_closed_loop(c0):
    """c0 = 0.02: the target is 4x the decode floor (a GPU-like case); 0.15: the CPU-like one,
    where the floor rule (2 x the decode rows' time) sets the limit."""
    unpaced, gaps_off, ttft_off, _ = closed_loop(0.0, c0)
    paced, gaps_on, ttft_on, cost = closed_loop(1.25, c0)
    assert p99_over_p50(gaps_off) > 1.8  # the bimodal gaps pacing exists for
    assert p99_over_p50(gaps_on) < 1.25
    # the same work in a few percent more steps (prompts start decoding a few steps later)
    assert len(paced.steps) <= 1.1 * len(unpaced.steps)
    assert sorted(ttft_on)[len(ttft_on) // 2] <= 6
    assert check_within_target(paced, cost, 0.250, 32) == 0
    assert len(ttft_on) == 96 and not paced.sched.has_unfinished()


def test_an_idle_server_is_not_paced():
    """No decode rows to keep even: a lone prompt gets all the target allows at once."""
    cost = linear_cost(c0=0.0, prefill=1e-3, decode=1e-3, context=0.0, adapters=0.0)
    cfg = SchedulerConfig(page_size=4, target_itl_ms=200, min_prefill_chunk=8)
    driver = Driver(Scheduler(cfg, Pager(400), cost=cost))
    driver.run({0: [make_request("lone", 150, 3)]})
    assert driver.steps[0][0] == [("lone", 150)]


def test_the_first_token_bound_holds_paced():
    """Paced, every step while prompts wait still computes min_prefill_chunk prompt tokens:
    the TTFT bound of ``Scheduler.schedule``'s docstring stands, with decodes running."""
    m = 16
    cost = linear_cost(decode=5e-4)
    cfg = SchedulerConfig(page_size=4, max_num_batched_tokens=512, target_itl_ms=15,
                          min_prefill_chunk=m, prefill_pacing=1.25)
    rng = random.Random(5)
    streams = [make_request(f"s{i}", 4, 400) for i in range(4)]
    prompts = [rng.randint(1, 120) for _ in range(12)]
    reqs = [make_request(f"r{i}", p, 30) for i, p in enumerate(prompts)]
    driver = Driver(Scheduler(cfg, Pager(4000), cost=cost))
    driver.run({0: streams, 3: reqs})
    bound = 3
    for req, p in zip(reqs, prompts):
        bound += -(-p // m)
        assert driver.first_token[req.request_id] < bound, (req.request_id, bound)
    for step in range(4, max(driver.first_token[r.request_id] for r in reqs)):
        assert driver.steps[step][2].num_prefill_tokens >= m, step


def test_the_quota_follows_the_arrival_rate_and_the_backlog():
    pacer = PrefillPacer(1.25, 32)
    assert pacer.quota([], []) == 32  # nothing arrives: the minimum chunk
    for _ in range(400):  # 100 prompt tokens a step, nothing left over
        pacer.arrived(100)
        quota = pacer.quota([], [])
    assert quota == 125
    waiting = [make_request("w", 640, 1)]
    assert pacer.quota([], waiting) == 125 + 640 // 32 - 2  # the rate decays by 1/64 a step
    with pytest.raises(ValueError, match="prefill_pacing"):
        PrefillPacer(0.5, 32)
