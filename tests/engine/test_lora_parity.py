"""Greedy float32 tokens identical to peft, for many adapters of mixed ranks in one batch."""

from __future__ import annotations

import threading
import time

import pytest

from loraplex.adapter_store.format import load_adapter
from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.request import SamplingParams
from tests.engine.test_parity import run_staggered
from tests.helpers import (
    make_model,
    make_peft_adapters,
    peft_greedy,
    random_prompts,
    warm_host_tier,
)


class LoadedSource:
    """Adapters loaded from real PEFT directories by the store's validator, by digest."""

    def __init__(self, adapters):
        self.adapters = {a.digest: a for a in adapters}
        self.fetches = []

    def fetch(self, digest):
        self.fetches.append(digest)
        if digest not in self.adapters:
            raise KeyError(f"no adapter {digest}")
        return self.adapters[digest]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = make_model(root / "model", "llama", seed=21)
    paths = make_peft_adapters(model, root / "adapters")
    config = ModelConfig.from_pretrained(model)
    adapters = {name: load_adapter(p, config) for name, p in paths.items()}
    names = list(paths) + [None, None, None, None]  # 8 adapters and 4 base-model requests
    prompts = random_prompts(len(names), seed=31, low=4, high=30)
    max_tokens = [6 + (i * 3) % 7 for i in range(len(names))]
    expected = peft_greedy(model, paths, prompts, names, max_tokens)
    return model, adapters, names, prompts, max_tokens, expected


def digests_for(adapters, names):
    return [adapters[n].digest if n else None for n in names]


def run(engine, prompts, digests, max_tokens, arrivals):
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    step = 0
    deadline = time.monotonic() + 120
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompts[i],
                               SamplingParams(max_tokens=max_tokens[i], ignore_eos=True),
                               adapter_digest=digests[i])
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(out.new_token_ids)
        step += 1
        assert time.monotonic() < deadline, "no progress in 120 s"
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_mixed_adapters_staggered_match_peft(setup):
    model, adapters, names, prompts, max_tokens, expected = setup
    source = LoadedSource(adapters.values())
    engine = Engine(EngineConfig(model=str(model), num_pages=600, scheduler=SchedulerConfig(
        page_size=4, max_num_batched_tokens=64)), adapter_source=source)
    arrivals = [(i * 2) % 7 for i in range(len(names))]
    got = run(engine, prompts, digests_for(adapters, names), max_tokens, arrivals)
    assert got == expected
    stats = engine.stats()
    assert stats.adapter_loads == 8 and len(stats.resident_adapters) == 8
    assert stats.adapter_evictions == 0 and stats.num_preemptions == 0
    assert stats.num_running == 0 and stats.pages.num_kv == 0
    base_only = run_staggered(engine, [prompts[i] for i in range(8)], max_tokens[:8], [0] * 8)
    assert base_only != expected[:8]  # the adapters really change the output


def test_eviction_reload_and_preemption_keep_outputs(setup):
    model, adapters, names, prompts, max_tokens, expected = setup
    source = LoadedSource(adapters.values())
    # page_elems = 2 * 4 * 2 * 16 = 256: the rank-64 adapter alone takes 112 pages, so this
    # pool holds it and some KV but never every adapter next to the KV.
    engine = Engine(EngineConfig(model=str(model), num_pages=124, scheduler=SchedulerConfig(
        page_size=4, max_num_batched_tokens=16)), adapter_source=source)
    digests = digests_for(adapters, names)
    warm_host_tier(engine, digests)  # the same schedule (and preemption) on any machine
    assert run(engine, prompts, digests, max_tokens, [0] * len(names)) == expected
    # a second pass, staggered: evicted adapters come back from the host cache
    assert run(engine, prompts, digests, max_tokens, [i % 5 for i in range(len(names))]) \
        == expected
    stats = engine.stats()
    assert stats.adapter_evictions > 0
    assert stats.device_misses > len(adapters)  # evicted adapters came back into the pool
    assert stats.adapter_loads == len(adapters)  # ... from the host tier, not the source
    assert stats.num_preemptions > 0
    # idle: no KV, no pins; resident adapters stay cached but evictable
    assert stats.pages.num_kv == 0
    assert stats.pages.num_evictable == stats.pages.num_adapter + stats.pages.num_prefix
    assert stats.pages.num_adapter > 0


def test_broken_adapter_fails_only_its_requests(setup):
    model, adapters, names, prompts, max_tokens, expected = setup
    good = adapters["b-r4-all"]
    source = LoadedSource([good])
    engine = Engine(EngineConfig(model=str(model), num_pages=128,
                                 scheduler=SchedulerConfig(page_size=4)), adapter_source=source)
    engine.add_request("good", prompts[1], SamplingParams(max_tokens=max_tokens[1],
                                                          ignore_eos=True), good.digest)
    engine.add_request("bad", prompts[0], SamplingParams(max_tokens=4), "0" * 64)
    engine.add_request("base", prompts[8], SamplingParams(max_tokens=max_tokens[8],
                                                          ignore_eos=True))
    tokens, errors = {"good": [], "base": [], "bad": []}, {}
    deadline = time.monotonic() + 120
    while engine.has_unfinished() and time.monotonic() < deadline:
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                errors[out.request_id] = (out.finish_reason, out.error)
    assert errors["bad"][0] == "error" and "failed to load" in errors["bad"][1]
    assert tokens["bad"] == []
    assert tokens["good"] == expected[1] and tokens["base"] == expected[8]
    assert engine.pager.stats().num_kv == 0


def test_adapter_that_can_never_fit_fails_with_a_reason(setup):
    model, adapters, names, prompts, max_tokens, expected = setup
    big = adapters["e-r64-attn"]
    engine = Engine(EngineConfig(model=str(model), num_pages=100,
                                 scheduler=SchedulerConfig(page_size=4)),
                    adapter_source=LoadedSource([big]))
    engine.add_request("big", prompts[4], SamplingParams(max_tokens=4), big.digest)
    engine.add_request("base", prompts[8], SamplingParams(max_tokens=4, ignore_eos=True))
    finished = {}
    deadline = time.monotonic() + 120
    while engine.has_unfinished() and time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["big"].finish_reason == "error"
    assert "needs 112 pages" in finished["big"].error
    assert finished["base"].finish_reason == "length"


def test_adapter_without_source_is_refused(setup):
    model = setup[0]
    engine = Engine(EngineConfig(model=str(model), num_pages=32))
    with pytest.raises(ValueError, match="^adapter:"):
        engine.add_request("x", [1, 2], SamplingParams(), adapter_digest="f" * 64)


def test_loading_never_stalls_the_engine(setup):
    model, adapters, names, prompts, max_tokens, expected = setup
    release = threading.Event()
    slow = adapters["d-r16-all"]

    class BlockingSource(LoadedSource):
        def fetch(self, digest):
            if digest == slow.digest:
                release.wait(timeout=60)
            return super().fetch(digest)

    engine = Engine(EngineConfig(model=str(model), num_pages=128,
                                 scheduler=SchedulerConfig(page_size=4)),
                    adapter_source=BlockingSource([slow]))
    engine.add_request("slow", prompts[3], SamplingParams(max_tokens=max_tokens[3],
                                                          ignore_eos=True), slow.digest)
    engine.add_request("base", prompts[9], SamplingParams(max_tokens=max_tokens[9],
                                                          ignore_eos=True))
    tokens = {"slow": [], "base": []}
    steps_while_blocked = 0
    while len(tokens["base"]) < max_tokens[9]:
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        steps_while_blocked += 1
        assert steps_while_blocked < 200
    # the base request finished while the adapter load was still blocked
    assert tokens["base"] == expected[9] and tokens["slow"] == []
    assert engine.adapters.is_loading(slow.digest)
    release.set()
    deadline = time.monotonic() + 120
    while engine.has_unfinished() and time.monotonic() < deadline:
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert tokens["slow"] == expected[3]
