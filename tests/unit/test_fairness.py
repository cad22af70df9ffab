"""The Virtual Token Counter in a scheduler simulation with no model, counted in steps."""

from __future__ import annotations

from loraplex.server.config import SchedulerConfig
from loraplex.server.engine.fairness import VirtualTokenCounter
from loraplex.server.engine.pager import Pager
from loraplex.server.engine.request import Request, SamplingParams
from loraplex.server.engine.scheduler import Scheduler
from tests.unit.test_scheduler import fake_step

BUDGET = 32
PROMPT, OUTPUT = 12, 8


def make(tenant: str, i: int) -> Request:
    return Request(f"{tenant}-{i}", list(range(PROMPT)), SamplingParams(max_tokens=OUTPUT),
                   tenant=tenant)


def scheduler(policy: str) -> Scheduler:
    cfg = SchedulerConfig(page_size=4, max_num_seqs=4, max_num_batched_tokens=BUDGET,
                          scheduling=policy)
    return Scheduler(cfg, Pager(4096))


def served(req: Request) -> float:
    # service as VTC counts it: w_in = 1 per prompt token, w_out = 2 per output token
    return min(req.num_computed_tokens, PROMPT) + 2 * max(req.num_computed_tokens - PROMPT, 0)


def test_backlogged_tenants_stay_within_the_bound():
    sched = scheduler("vtc")
    # heavy sends ten times light's load; both stay backlogged for the whole run
    for i in range(1000):
        sched.add(make("heavy", i))
    for i in range(100):
        sched.add(make("light", i))
    u = BUDGET * 2  # the most service one step can add (every token an output token)
    totals = {"heavy": 0.0, "light": 0.0}
    done = {"heavy": 0, "light": 0}
    for _ in range(300):
        before = {r.request_id: served(r) for r in sched.running}
        _, finished = fake_step(sched)
        for r in sched.running + finished:
            totals[r.tenant] += served(r) - before.get(r.request_id, 0.0)
        for r in finished:
            done[r.tenant] += 1
        assert abs(totals["heavy"] - totals["light"]) <= 2 * u, totals
        counters = sched.vtc.counters
        assert abs(counters["heavy"] - counters["light"]) <= 2 * u
        assert any(r.tenant == "light" for r in sched.waiting)  # still backlogged
    assert done["light"] > 20
    assert abs(done["heavy"] - done["light"]) <= 2


def light_waiting_steps(policy: str | None) -> list[int]:
    """Steps each light request waits for its first token while heavy floods (or alone)."""
    sched = scheduler(policy or "fcfs")
    if policy is not None:
        for i in range(200):
            sched.add(make("heavy", i))
    arrivals: dict[str, int] = {}
    waits: list[int] = []
    for step in range(400):
        if step % 10 == 0 and step < 200:
            req = make("light", step)
            arrivals[req.request_id] = step
            sched.add(req)
        scheduled, _ = fake_step(sched)
        for rid, _ in scheduled:
            if rid in arrivals:
                waits.append(step - arrivals.pop(rid))
    return waits + [400 - arrived for arrived in arrivals.values()]  # never scheduled


def test_light_tenant_waits_near_its_solo_value_under_vtc_only():
    solo = light_waiting_steps(None)
    vtc = light_waiting_steps("vtc")
    fcfs = light_waiting_steps("fcfs")
    assert max(solo) == 0
    # VTC: a light request waits at most for one running request to finish (about
    # OUTPUT + 1 steps); FCFS: behind the whole flood.
    assert len(vtc) == 20 and max(vtc) <= OUTPUT + 1
    assert sum(fcfs) / len(fcfs) > 10 * (sum(vtc) / len(vtc) + 1)


def test_idle_tenant_is_lifted_not_credited():
    vtc = VirtualTokenCounter()
    vtc.charge("a", 100, 50)
    vtc.on_arrival("b", active_tenants=["a"])
    assert vtc.counters["b"] == vtc.counters["a"] == 200.0
    vtc.charge("b", 10, 0)
    vtc.on_arrival("a", active_tenants=["a", "b"])  # already active: unchanged
    assert vtc.counters["a"] == 200.0


def test_tenant_weights_scale_service():
    vtc = VirtualTokenCounter(tenant_weights={"gold": 2.0})
    vtc.charge("gold", 100, 0)
    vtc.charge("free", 100, 0)
    assert vtc.counters == {"gold": 50.0, "free": 100.0}
