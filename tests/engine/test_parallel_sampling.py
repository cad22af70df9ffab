"""n > 1: one prompt, n sequences on shared pages, equal to n single requests."""

from __future__ import annotations

import dataclasses

import pytest

from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.llm import LLM
from loraplex.server.engine.request import RequestStatus, SamplingParams
from tests.engine.test_lora_parity import LoadedSource
from tests.helpers import assert_pages_idle, random_prompts

PAGE = 4


def _engine(model, num_pages=256, prefix=False, source=None, **sched) -> Engine:
    return Engine(EngineConfig(model=str(model), num_pages=num_pages,
                               enable_prefix_caching=prefix,
                               scheduler=SchedulerConfig(page_size=PAGE, **sched)),
                  adapter_source=source)


def _singles(llm, prompt, params, adapter=None):
    """The n sequences as n separate requests (seed + i when seeded)."""
    out = []
    for i in range(params.n):
        seed = None if params.seed is None else params.seed + i
        single = dataclasses.replace(params, n=1, seed=seed)
        out.append(llm.generate([prompt], single, adapters=[adapter])[0].token_ids)
    return out


GREEDY = SamplingParams(max_tokens=9, ignore_eos=True, n=4)
SAMPLED = SamplingParams(max_tokens=9, ignore_eos=True, n=8, temperature=1.0, top_p=0.9,
                         seed=123, presence_penalty=0.3)


def test_n_greedy_and_seeded_equal_single_requests(tiny_llama):
    llm = LLM(engine=_engine(tiny_llama))
    prompt = random_prompts(1, seed=50, low=10, high=10)[0]
    for params in (GREEDY, SAMPLED):
        together = llm.generate([prompt], params)
        assert [c.token_ids for c in together] == _singles(llm, prompt, params)
        assert all(c.finish_reason == "length" for c in together)
    sampled = [tuple(c.token_ids) for c in llm.generate([prompt], SAMPLED)]
    assert len(set(sampled)) > 1  # their own seeds: not n copies of one sequence
    assert_pages_idle(llm.engine)


def test_the_prompt_is_prefilled_once_on_pages_held_once(tiny_llama):
    engine = _engine(tiny_llama)
    prompt = random_prompts(1, seed=51, low=10, high=10)[0]  # 2 full pages + 2 tokens
    engine.add_request("g", prompt, dataclasses.replace(GREEDY, max_tokens=6))
    first = engine.step()  # prefill once, four first tokens
    assert sorted(o.index for o in first) == [0, 1, 2, 3]
    assert all(o.request_id == "g" and len(o.new_token_ids) == 1 for o in first)
    assert engine.pager.stats().num_kv == 3  # the prompt's 3 pages, once for all four
    engine.step()  # each writes position 10: three copy the shared last page, one keeps it
    assert engine.pager.stats().num_kv == 3 + 3
    while engine.has_unfinished():
        engine.step()
    assert_pages_idle(engine)
    assert engine.stats().pages.num_free == engine.pager.num_pages


def test_a_page_aligned_prompt_needs_no_copy(tiny_llama):
    engine = _engine(tiny_llama)
    prompt = random_prompts(1, seed=52, low=8, high=8)[0]  # exactly 2 pages
    engine.add_request("g", prompt, dataclasses.replace(GREEDY, max_tokens=3))
    engine.step()
    assert engine.pager.stats().num_kv == 2
    engine.step()  # each sequence's next token opens its own page: nothing to copy
    assert engine.pager.stats().num_kv == 2 + 4
    while engine.has_unfinished():
        engine.step()
    assert_pages_idle(engine)


def test_preemption_and_prefix_cache_keep_every_sequence(tiny_llama):
    prompts = random_prompts(4, seed=53, low=9, high=22)
    params = [SAMPLED, GREEDY, dataclasses.replace(SAMPLED, n=3, seed=7), GREEDY]
    reference = LLM(engine=_engine(tiny_llama))
    want = [seq for p, sp in zip(prompts, params) for seq in _singles(reference, p, sp)]
    for engine in (_engine(tiny_llama, num_pages=40, max_num_batched_tokens=64),
                   _engine(tiny_llama, prefix=True),
                   _engine(tiny_llama, num_pages=40, prefix=True, max_num_batched_tokens=64)):
        llm = LLM(engine=engine)
        got = [c.token_ids for c in llm.generate(prompts, params)]
        assert got == want
        if engine.pager.num_pages == 40:
            assert engine.stats().num_preemptions > 0
        assert_pages_idle(engine)
        if engine.prefix_cache is not None:  # again, from the cache
            assert [c.token_ids for c in llm.generate(prompts, params)] == want
            assert_pages_idle(engine)


def test_mixed_adapter_batches(setup_small):
    model, adapters, names, prompts, _, _ = setup_small
    source = LoadedSource(adapters.values())
    digests = [adapters[n].digest if n else None for n in names]
    params = [dataclasses.replace(SAMPLED, n=3, seed=40 + i) if i % 2 else
              dataclasses.replace(GREEDY, n=2) for i in range(len(names))]
    single = LLM(engine=_engine(model, source=source))
    want = [seq for p, sp, d in zip(prompts, params, digests)
            for seq in _singles(single, p, sp, d)]
    llm = LLM(engine=_engine(model, source=source))
    assert [c.token_ids for c in llm.generate(prompts, params, adapters=digests)] == want
    assert_pages_idle(llm.engine)


def test_cancelling_ends_every_sequence_and_frees_each_page_once(tiny_llama):
    engine = _engine(tiny_llama)
    prompt = random_prompts(1, seed=54, low=10, high=10)[0]
    engine.add_request("g", prompt, dataclasses.replace(SAMPLED, max_tokens=50))
    engine.add_request("early", prompt, dataclasses.replace(GREEDY, max_tokens=50))
    sequences = engine.sequences("g")
    engine.step()
    engine.step()
    engine.abort("g")
    engine.abort("early")
    engine.abort("early")  # twice: still freed once
    outputs = engine.step()
    ended = sorted(o.index for o in outputs if o.request_id == "g" and o.finished)
    assert ended == list(range(8))
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in sequences)
    assert not engine.has_unfinished()
    assert_pages_idle(engine)
    assert engine.sequences("g") == ()


def test_sequences_end_with_their_parent_before_the_fork(tiny_llama):
    engine = _engine(tiny_llama)
    engine.add_request("g", [1, 2, 3], dataclasses.replace(GREEDY, n=5))
    engine.abort("g")  # before any step: only sequence 0 was ever queued
    outputs = engine.step()
    assert sorted(o.index for o in outputs if o.finished) == [0, 1, 2, 3, 4]
    assert not engine.has_unfinished()
    assert_pages_idle(engine)


def test_n_bounds():
    with pytest.raises(ValueError, match="^n:"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="^n:"):
        SamplingParams(n=65)


def test_siblings_count_against_max_num_seqs_from_admission(tiny_llama):
    # Issue 19: the n sequences of a prompt hold n running slots from sequence 0's admission
    # on, so forking never takes the running count past max_num_seqs.
    engine = _engine(tiny_llama, max_num_seqs=4)
    prompts = random_prompts(3, seed=52, low=6, high=9)
    engine.add_request("group", prompts[0], dataclasses.replace(GREEDY, max_tokens=4))
    engine.add_request("a", prompts[1], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("b", prompts[2], SamplingParams(max_tokens=4, ignore_eos=True))
    tokens: dict[tuple[str, int], list[int]] = {}
    most = 0
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        most = max(most, engine.stats().num_running)
    assert not engine.has_unfinished()
    assert most <= 4
    assert sorted(tokens) == [("a", 0), ("b", 0)] + [("group", i) for i in range(4)]
    assert all(len(t) == 4 for t in tokens.values())
    assert_pages_idle(engine)


def test_more_sequences_than_max_num_seqs_fail_with_a_reason(tiny_llama):
    engine = _engine(tiny_llama, max_num_seqs=2)
    engine.add_request("g", [1, 2, 3], dataclasses.replace(GREEDY, max_tokens=2))
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    assert sorted(o.index for o in outputs) == [0, 1, 2, 3]
    assert all(o.finish_reason == "error" for o in outputs)
    assert all(o.error == "n: 4 sequences exceed the engine's max_num_seqs (2)"
               for o in outputs)
    assert_pages_idle(engine)
