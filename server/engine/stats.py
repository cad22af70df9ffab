"""What an engine reports: ``EngineStats``, a snapshot for metrics and status, and
``collect_stats``, which reads it off the engine's parts (any thread may read the result; the
engine thread builds it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.server.engine.adapter_cache import AdapterManager
from loraplex.server.engine.pager import Pager, PagerStats
from loraplex.server.engine.prefix_cache import PrefixCache
from loraplex.server.engine.scheduler import Scheduler
from loraplex.server.engine.spec.speculator import SpecStats
from loraplex.server.engine.step_cost import StepTimer, StepTimeStats
from loraplex.server.engine.structured import GrammarService


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics and status reports (counters are totals since start)."""

    num_waiting: int
    num_running: int
    num_preemptions: int
    pages: PagerStats  # pages by kind: free, kv, adapter, prefix
    num_steps: int
    resident_adapters: tuple[str, ...] = ()  # digests with pages in the pool
    host_adapters: tuple[str, ...] = ()  # digests in the host (CPU RAM) cache
    adapter_loads: int = 0
    adapter_load_seconds: float = 0.0
    adapter_load_failures: int = 0
    host_hits: int = 0
    host_misses: int = 0
    device_hits: int = 0
    device_misses: int = 0
    adapter_evictions: int = 0
    adapter_copies_in: int = 0  # host cache -> pool pages, in the steps
    adapter_copy_in_seconds: float = 0.0  # on CUDA: issuing the copies, not running them
    adapter_warm_loads: int = 0  # host-cache loads started ahead of any request (Prefetch)
    adapter_warm_dropped: int = 0  # warm loads dropped: no room without evicting
    prefix_queried_tokens: dict[str, int] = field(default_factory=dict)  # by tenant
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)  # by tenant
    step_times: StepTimeStats = StepTimeStats()  # measured against predicted step time
    grammar_compiles: int = 0  # structured output: compiles run (failed ones included)
    grammar_compile_failures: int = 0
    grammar_cache_hits: int = 0
    jump_forward_tokens: int = 0  # output tokens appended by jump-forward, no model step
    jump_forward_retokenized: int = 0  # string jump-forward boundaries re-cut (last token too)
    spec: SpecStats = SpecStats()  # speculative decoding: proposed, accepted, emitted tokens


def collect_stats(scheduler: Scheduler, pager: Pager, num_steps: int, step_timer: StepTimer,
                  adapters: AdapterManager | None, prefix_cache: PrefixCache | None,
                  grammars: GrammarService | None, spec: SpecStats | None = None
                  ) -> EngineStats:
    """The engine's snapshot (parts it does not have report their defaults)."""
    adapter_fields = {}
    if adapters is not None:
        c = adapters.counters
        adapter_fields = dict(
            resident_adapters=adapters.resident_digests(),
            host_adapters=adapters.host_digests(),
            adapter_loads=int(c["loads"]), adapter_load_seconds=float(c["load_seconds"]),
            adapter_load_failures=int(c["load_failures"]), host_hits=int(c["host_hits"]),
            host_misses=int(c["host_misses"]), device_hits=int(c["device_hits"]),
            device_misses=int(c["device_misses"]), adapter_evictions=int(c["evictions"]),
            adapter_copies_in=int(c["copies_in"]),
            adapter_copy_in_seconds=float(c["copy_in_seconds"]),
            adapter_warm_loads=int(c["warm_loads"]), adapter_warm_dropped=int(c["warm_dropped"]))
    prefix_fields = {}
    if prefix_cache is not None:
        p = prefix_cache.stats()
        prefix_fields = dict(prefix_queried_tokens=p.queried_tokens,
                             prefix_hit_tokens=p.hit_tokens)
    grammar_fields = {}
    if grammars is not None:
        g = grammars
        grammar_fields = dict(grammar_compiles=g.num_compiles,
                              grammar_compile_failures=g.num_compile_failures,
                              grammar_cache_hits=g.cache.hits,
                              jump_forward_tokens=g.num_jumped_tokens,
                              jump_forward_retokenized=g.num_retokenized)
    return EngineStats(scheduler.num_waiting, scheduler.num_running,
                       scheduler.num_preemptions, pager.stats(), num_steps,
                       **adapter_fields, **prefix_fields, **grammar_fields,
                       step_times=step_timer.stats(), spec=spec or SpecStats())
