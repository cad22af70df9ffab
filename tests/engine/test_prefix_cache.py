"""Prefix caching keyed by base revision, tenant and adapter digest."""

from __future__ import annotations

import time

import pytest

from loraplex.adapter_store.format import load_adapter
from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.request import SamplingParams
from tests.engine.test_lora_parity import LoadedSource
from tests.helpers import ADAPTER_SPECS, make_model, make_peft_adapters, random_prompts

SYSTEM = random_prompts(1, seed=100, low=40, high=40)[0]  # 10 pages of 4 tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    model = make_model(root / "model", "llama", seed=21)
    paths = make_peft_adapters(model, root / "adapters", specs=ADAPTER_SPECS[:4])
    config = ModelConfig.from_pretrained(model)
    return model, {name: load_adapter(p, config) for name, p in paths.items()}


def make_engine(model, adapters, num_pages=400, prefix=True, **kw):
    return Engine(EngineConfig(model=str(model), num_pages=num_pages, enable_prefix_caching=prefix,
                               scheduler=SchedulerConfig(page_size=4, max_num_batched_tokens=32),
                               **kw), adapter_source=LoadedSource(adapters.values()))


def drain(engine, requests, max_tokens=6):
    """requests: (id, prompt, digest, tenant), all added now; returns id -> (tokens, output)."""
    for rid, prompt, digest, tenant in requests:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                           adapter_digest=digest, tenant=tenant)
    tokens = {rid: [] for rid, *_ in requests}
    final = {}
    deadline = time.monotonic() + 120
    while engine.has_unfinished():
        assert time.monotonic() < deadline
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out
    return {rid: (tokens[rid], final[rid]) for rid in tokens}


def mixed_requests(adapters, n=12):
    digests = [a.digest for a in adapters.values()] + [None]
    questions = random_prompts(n, seed=5, low=3, high=12)
    return [(f"q{i}", SYSTEM + q, digests[i % len(digests)], "default")
            for i, q in enumerate(questions)]


def test_outputs_identical_with_and_without_prefix_caching(setup):
    model, adapters = setup
    reqs = mixed_requests(adapters)
    cold = drain(make_engine(model, adapters, prefix=False), reqs)
    # a pool small enough for preemption, run twice so the second pass hits the cache
    engine = make_engine(model, adapters, num_pages=150)
    first = drain(engine, reqs)
    second = drain(engine, [(r + "-again", *rest) for r, *rest in reqs])
    for rid, *_ in reqs:
        assert first[rid][0] == cold[rid][0]
        assert second[rid + "-again"][0] == cold[rid][0]
    assert engine.stats().num_preemptions > 0
    assert sum(out.num_cached_tokens for _, out in second.values()) > 0


def test_shared_system_prompt_hits(setup):
    model, adapters = setup
    engine = make_engine(model, {})
    first = drain(engine, [("a", SYSTEM + [1, 2, 3], None, "default")])
    assert first["a"][1].num_cached_tokens == 0
    out = drain(engine, [("b", SYSTEM + [7, 8], None, "default")])
    assert out["b"][1].num_cached_tokens == len(SYSTEM)  # all ten full pages of the prompt
    stats = engine.stats()
    assert stats.prefix_hit_tokens["default"] == len(SYSTEM)
    assert stats.prefix_queried_tokens["default"] == 2 * len(SYSTEM) + 5


def test_tenants_never_share_pages_unless_enabled(setup):
    model, adapters = setup
    engine = make_engine(model, {})
    drain(engine, [("a", SYSTEM + [1], None, "tenant-a")])
    out = drain(engine, [("b", SYSTEM + [1], None, "tenant-b")])
    assert out["b"][1].num_cached_tokens == 0
    assert engine.stats().prefix_hit_tokens.get("tenant-b", 0) == 0
    again = drain(engine, [("a2", SYSTEM + [1], None, "tenant-a")])
    assert again["a2"][1].num_cached_tokens == len(SYSTEM)

    shared = make_engine(model, {}, share_prefix_across_tenants=True)
    drain(shared, [("a", SYSTEM + [1], None, "tenant-a")])
    out = drain(shared, [("b", SYSTEM + [1], None, "tenant-b")])
    assert out["b"][1].num_cached_tokens == len(SYSTEM)


def test_new_adapter_version_never_reuses_old_pages(setup):
    model, adapters = setup
    # two versions of one name are two digests: the second must not see the first's pages
    old, new = adapters["b-r4-all"], adapters["d-r16-all"]
    engine = make_engine(model, adapters)
    drain(engine, [("v1", SYSTEM + [3], old.digest, "default")])
    out = drain(engine, [("v2", SYSTEM + [3], new.digest, "default")])
    assert out["v2"][1].num_cached_tokens == 0
    cold = drain(make_engine(model, adapters, prefix=False),
                 [("cold", SYSTEM + [3], new.digest, "default")])
    assert out["v2"][0] == cold["cold"][0]
    base = drain(engine, [("base", SYSTEM + [3], None, "default")])
    assert base["base"][1].num_cached_tokens == 0  # the base model's keys differ too


def test_cached_pages_are_evicted_for_new_work(setup):
    model, adapters = setup
    engine = make_engine(model, {}, num_pages=30)
    for i in range(5):
        drain(engine, [(f"r{i}", random_prompts(1, seed=50 + i, low=40, high=40)[0], None,
                        "default")])
    stats = engine.stats().pages
    assert stats.num_kv == 0 and stats.num_prefix > 0 and stats.num_evictions > 0
    assert stats.num_evictable == stats.num_prefix
