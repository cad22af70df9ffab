"""Sampling: seeds reproducible regardless of batch, top_k=1 is greedy, distributions."""

from __future__ import annotations

import collections

import pytest
import torch

from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.llm import LLM
from loraplex.server.engine.request import Request, SamplingParams
from loraplex.server.engine.sampler import SamplingMetadata, sample
from tests.helpers import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(engine=Engine(EngineConfig(model=str(tiny_llama), num_pages=128,
                                          scheduler=SchedulerConfig(page_size=4))))


def test_same_seed_same_tokens_alone_and_in_a_batch(llm):
    prompts = random_prompts(6, seed=2)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234,
                            ignore_eos=True)
    alone = llm.generate([prompts[0]], params)[0].token_ids
    others = [SamplingParams(max_tokens=9, temperature=0.7, seed=i, ignore_eos=True)
              for i in range(5)]
    batch = llm.generate(prompts, [params] + others)
    assert batch[0].token_ids == alone
    different_seed = llm.generate([prompts[0]], SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True))[0].token_ids
    assert different_seed != alone


def test_top_k_one_equals_greedy(llm):
    prompts = random_prompts(3, seed=5)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    top1 = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=1.5, top_k=1,
                                                seed=3, ignore_eos=True))
    assert [r.token_ids for r in greedy] == [r.token_ids for r in top1]


def _draw(logits: torch.Tensor, params: SamplingParams, n: int) -> collections.Counter:
    req = Request("x", [0], params, generator=torch.Generator().manual_seed(0))
    counts: collections.Counter = collections.Counter()
    for _ in range(n):
        tokens = sample(logits[None, :], SamplingMetadata.from_requests([req])).token_ids
        counts[tokens[0]] += 1
    return counts


def test_temperature_matches_softmax_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 4000
    counts = _draw(logits, SamplingParams(temperature=2.0), n)
    expected = torch.softmax(logits / 2.0, -1)
    for token in range(5):
        observed = counts[token] / n
        sigma = (expected[token] * (1 - expected[token]) / n) ** 0.5
        assert abs(observed - float(expected[token])) < 5 * sigma + 1e-3


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    counts = _draw(logits, SamplingParams(temperature=1.0, top_p=0.75), 3000)
    assert set(counts) == {0, 1}  # 0.5 + 0.3 reaches 0.75; tokens 2 and 3 are never drawn
    assert abs(counts[0] / 3000 - 0.5 / 0.8) < 0.04


def test_logprobs_of_chosen_and_top_tokens(llm):
    out = llm.generate(random_prompts(1, seed=8), SamplingParams(max_tokens=3, logprobs=2,
                                                                  ignore_eos=True))[0]
    assert len(out.logprobs) == 3
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token and lp.logprob <= 0.0
        assert len(lp.top) == 2 and lp.top[0][0] == token  # greedy: the top token is chosen
        assert lp.top[0][1] == pytest.approx(lp.logprob)


def _unseeded_tokens(model, seed):
    engine = Engine(EngineConfig(model=str(model), num_pages=64, seed=seed,
                                 scheduler=SchedulerConfig(page_size=4)))
    params = SamplingParams(max_tokens=16, temperature=1.5, ignore_eos=True)
    return [c.token_ids for c in LLM(engine=engine).generate(random_prompts(3, seed=4), params)]


def test_unseeded_requests_draw_from_the_os_unless_the_operator_sets_a_seed(tiny_llama):
    from loraplex.server.cli import build_parser, engine_config_from_args

    assert EngineConfig().seed is None
    # Two replicas (or restarts) without --seed: different draws for unseeded requests.
    assert _unseeded_tokens(tiny_llama, None) != _unseeded_tokens(tiny_llama, None)
    # The same --seed: the same draws, as before.
    args = build_parser().parse_args(["worker", "--model", str(tiny_llama), "--seed", "5"])
    seed = engine_config_from_args(args).seed
    assert seed == 5
    assert _unseeded_tokens(tiny_llama, seed) == _unseeded_tokens(tiny_llama, seed)
    unset = build_parser().parse_args(["worker", "--model", str(tiny_llama)])
    assert engine_config_from_args(unset).seed is None


def test_min_tokens_holds_off_eos_even_when_the_model_wants_it(llm):
    eos = min(llm.engine.eos_token_ids)
    prompts = random_prompts(3, seed=9)
    # +100 on EOS: without min_tokens every request ends at its first token.
    eager = llm.generate(prompts, SamplingParams(max_tokens=12, logit_bias={eos: 100.0}))
    assert all(c.token_ids == [eos] and c.finish_reason == "stop" for c in eager)
    for min_tokens in (1, 5, 11):
        held = llm.generate(prompts, [SamplingParams(
            max_tokens=12, min_tokens=min_tokens, logit_bias={eos: 100.0},
            temperature=t, seed=3) for t in (0.0, 1.0, 0.7)])
        for c in held:
            assert eos not in c.token_ids[:min_tokens]
            assert c.token_ids[min_tokens:] == [eos] and c.finish_reason == "stop"
    stop_token = 7
    held = llm.generate(prompts[:1], SamplingParams(
        max_tokens=6, min_tokens=4, stop_token_ids=(stop_token,), ignore_eos=True,
        logit_bias={stop_token: 100.0}))[0]
    assert held.token_ids == [t for t in held.token_ids[:4] if t != stop_token] + [stop_token]


def test_logit_bias_forces_a_token_and_unknown_ids_are_refused(llm):
    prompts = random_prompts(2, seed=10)
    forced = llm.generate(prompts, [
        SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={42: 100.0}),
        SamplingParams(max_tokens=5, ignore_eos=True, temperature=1.0, seed=1,
                       logit_bias={42: 100.0})])
    assert [c.token_ids for c in forced] == [[42] * 5, [42] * 5]
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"^logit_bias: token ids \[{vocab}\]"):
        llm.engine.add_request("bad-bias", [1, 2], SamplingParams(logit_bias={vocab: 1.0}))


def test_penalties_and_min_p_keep_seeds_reproducible_alone_and_batched(llm):
    prompts = random_prompts(5, seed=11)
    params = SamplingParams(max_tokens=14, temperature=1.0, seed=77, ignore_eos=True,
                            repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=0.4, min_p=0.05, min_tokens=3,
                            logit_bias={5: 2.0})
    alone = llm.generate(prompts[:1], params)[0].token_ids
    others = [SamplingParams(max_tokens=9, temperature=0.8, seed=i, ignore_eos=True,
                             frequency_penalty=1.0 * i / 4) for i in range(4)]
    assert llm.generate(prompts, [params] + others)[0].token_ids == alone
    # Greedy on this model repeats itself; a strong repetition penalty (prompt and output
    # tokens) makes it repeat nothing, not even the prompt's token.
    repeat = [9, 9, 9, 9, 9, 9]
    plain = llm.generate([repeat], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    penalized = llm.generate([repeat], SamplingParams(max_tokens=8, ignore_eos=True,
                                                      repetition_penalty=10.0))[0].token_ids
    assert len(set(plain)) < len(plain)
    assert len(set(penalized)) == len(penalized) and 9 not in penalized


def test_stop_strings_are_matched_only_from_min_tokens_on(llm):
    prompt = random_prompts(1, seed=12)
    free = llm.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True))[0]
    stop = free.text[-1]
    early = llm.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True,
                                                stop=(stop,)))[0]
    k = len(early.token_ids)
    assert early.finish_reason == "stop" and k < 10 and stop not in early.text
    held = llm.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True, stop=(stop,),
                                               min_tokens=k + 1))[0]
    assert held.token_ids[:k] == early.token_ids and len(held.token_ids) > k
    assert stop in held.text  # its first occurrence came before min_tokens: not a stop
