"""Greedy float32 output token-identical to transformers' generate."""

from __future__ import annotations

import pytest

from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.request import SamplingParams
from tests.helpers import assert_pages_idle, hf_greedy, make_model, random_prompts


def run_staggered(engine: Engine, prompts, max_tokens, arrivals):
    """Add prompt i at step arrivals[i]; run to completion; tokens per prompt."""
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    step = 0
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompts[i],
                               SamplingParams(max_tokens=max_tokens[i], ignore_eos=True))
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        step += 1
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}}),
    ("mistral", {}),
    ("qwen2", {}),
])
def test_single_request_matches_transformers(tmp_path, arch, overrides):
    model = make_model(tmp_path / arch, arch, **overrides)
    prompts = random_prompts(1, seed=1, low=20, high=20)
    expected = hf_greedy(model, prompts, 12)
    engine = Engine(EngineConfig(model=str(model), num_pages=64,
                                 scheduler=SchedulerConfig(page_size=4)))
    assert run_staggered(engine, prompts, [12], [0]) == expected


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("llama") / "m", "llama", seed=3)


@pytest.fixture(scope="module")
def sixteen(llama):
    prompts = random_prompts(16, seed=7, low=3, high=60)
    max_tokens = [4 + (i * 5) % 17 for i in range(16)]
    return prompts, max_tokens, hf_greedy(llama, prompts, max_tokens)


def test_sixteen_staggered_requests(llama, sixteen):
    prompts, max_tokens, expected = sixteen
    engine = Engine(EngineConfig(model=str(llama), num_pages=256,
                                 scheduler=SchedulerConfig(page_size=4,
                                                           max_num_batched_tokens=96)))
    arrivals = [(i * 3) % 11 for i in range(16)]
    assert run_staggered(engine, prompts, max_tokens, arrivals) == expected
    assert_pages_idle(engine)


def test_prefill_chunks_smaller_than_prompt(llama, sixteen):
    prompts, max_tokens, expected = sixteen
    engine = Engine(EngineConfig(model=str(llama), num_pages=256, scheduler=SchedulerConfig(
        page_size=4, max_num_batched_tokens=16, long_prefill_token_threshold=7)))
    assert run_staggered(engine, prompts, max_tokens, [0] * 16) == expected


def test_preemption_keeps_outputs(llama, sixteen):
    prompts, max_tokens, expected = sixteen
    engine = Engine(EngineConfig(model=str(llama), num_pages=40,
                                 scheduler=SchedulerConfig(page_size=4,
                                                           max_num_batched_tokens=128)))
    assert run_staggered(engine, prompts, max_tokens, [0] * 16) == expected
    assert engine.stats().num_preemptions > 0
    assert_pages_idle(engine)
