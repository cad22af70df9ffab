"""Prompt logprobs: computed during prefill, equal to transformers' on the same prompt, whole
across chunked prefill, preemption and the prefix cache."""

from __future__ import annotations

import pytest
import torch

from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.llm import LLM
from loraplex.server.engine.request import SamplingParams
from tests.helpers import assert_pages_idle, random_prompts

TOP = 3


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, seed=41, low=9, high=30)


@pytest.fixture(scope="module")
def expected(tiny_llama, prompts):
    """transformers' log-softmax of each prompt position, scored on the next prompt token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
            out.append((lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0],
                        lp[:-1].topk(TOP, -1)))
    return out


def _check(completions, prompts, expected):
    for c, prompt, (chosen, top) in zip(completions, prompts, expected):
        assert [lp.token_id for lp in c.prompt_logprobs] == prompt[1:]
        got = torch.tensor([lp.logprob for lp in c.prompt_logprobs])
        torch.testing.assert_close(got, chosen, atol=1e-4, rtol=1e-4)
        for lp, ids, values in zip(c.prompt_logprobs, top.indices.tolist(), top.values):
            assert [t for t, _ in lp.top] == ids
            torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), values,
                                       atol=1e-4, rtol=1e-4)


def _engine(model, **sched) -> Engine:
    return Engine(EngineConfig(model=str(model), num_pages=sched.pop("num_pages", 256),
                               enable_prefix_caching=sched.pop("prefix", False),
                               scheduler=SchedulerConfig(page_size=4, **sched)))


PARAMS = SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=TOP)


def test_prompt_logprobs_equal_transformers_in_one_prefill(tiny_llama, prompts, expected):
    llm = LLM(engine=_engine(tiny_llama))
    mixed = [PARAMS if i % 2 == 0 else SamplingParams(max_tokens=5, ignore_eos=True)
             for i in range(len(prompts))]
    out = llm.generate(prompts, mixed)
    _check(out[::2], prompts[::2], expected[::2])
    assert all(c.prompt_logprobs == [] for c in out[1::2])
    plain = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]


def test_prompt_logprobs_across_chunks_and_preemption(tiny_llama, prompts, expected):
    chunked = _engine(tiny_llama, max_num_batched_tokens=16, long_prefill_token_threshold=5)
    _check(LLM(engine=chunked).generate(prompts, PARAMS), prompts, expected)
    small = _engine(tiny_llama, num_pages=24, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=30, ignore_eos=True, prompt_logprobs=TOP)
    _check(LLM(engine=small).generate(prompts, params), prompts, expected)
    assert small.stats().num_preemptions > 0
    assert_pages_idle(small)


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached(tiny_llama, prompts,
                                                                     expected):
    engine = _engine(tiny_llama, prefix=True)
    llm = LLM(engine=engine)
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))  # caches the prompts
    hits = sum(engine.stats().prefix_hit_tokens.values())
    _check(llm.generate(prompts, PARAMS), prompts, expected)
    assert sum(engine.stats().prefix_hit_tokens.values()) == hits  # nothing reused for them
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    assert sum(engine.stats().prefix_hit_tokens.values()) > hits  # others still hit


def test_prompt_logprobs_bounds():
    with pytest.raises(ValueError, match="^prompt_logprobs:"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="^prompt_logprobs:"):
        SamplingParams(prompt_logprobs=-1)
