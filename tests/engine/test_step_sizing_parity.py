"""Step sizing keeps outputs right: with a target no step meets (so every step's prefill is
one minimum chunk beside the decodes), eight adapters of mixed ranks and base-model requests
in one batch, under preemption and adapter eviction, give peft's greedy tokens."""

from __future__ import annotations

from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from tests.engine.test_lora_parity import LoadedSource, digests_for, run, setup  # noqa: F401
from tests.helpers import warm_host_tier


def test_min_chunk_steps_with_preemption_match_peft(setup):  # noqa: F811
    model, adapters, names, prompts, max_tokens, expected = setup
    engine = Engine(EngineConfig(model=str(model), num_pages=124, scheduler=SchedulerConfig(
        page_size=4, max_num_batched_tokens=16, target_itl_ms=0.001, min_prefill_chunk=3)),
        adapter_source=LoadedSource(adapters.values()))
    arrivals = [i % 5 for i in range(len(names))]
    digests = digests_for(adapters, names)
    warm_host_tier(engine, digests)  # the same schedule (and preemption) on any machine
    assert run(engine, prompts, digests, max_tokens, arrivals) == expected
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.adapter_evictions > 0
    assert stats.step_times.num_over_target == stats.num_steps  # nothing meets 1 microsecond
    assert stats.pages.num_kv == 0
