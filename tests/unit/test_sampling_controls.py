"""The sampler's controls against references: transformers' logits processors where it has
one, a direct computation where it has none, and a per-row reference for random mixes."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from loraplex.server.engine.controls import apply_controls
from loraplex.server.engine.request import Request, SamplingParams
from loraplex.server.engine.sampler import SamplingMetadata, sample

VOCAB = 64
EOS = (2, 5)


def _request(i: int, prompt: list[int], output: list[int], **params) -> Request:
    req = Request(f"r{i}", list(prompt), SamplingParams(**params),
                  generator=torch.Generator().manual_seed(1000 + i))
    req.output_token_ids = list(output)
    return req


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def test_repetition_penalty_matches_transformers():
    rng = random.Random(0)
    penalties = [1.0, 1.3, 0.7, 2.0, 1.0, 5.0]
    requests = [_request(i, _tokens(rng, 9), _tokens(rng, 4), repetition_penalty=p)
                for i, p in enumerate(penalties)]
    logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    got = apply_controls(logits, SamplingMetadata.from_requests(requests, VOCAB))
    for i, (req, p) in enumerate(zip(requests, penalties)):
        ids = torch.tensor([req.all_token_ids])
        want = RepetitionPenaltyLogitsProcessor(p)(ids, logits[i:i + 1].clone())
        torch.testing.assert_close(got[i:i + 1], want, rtol=0, atol=0)


def test_presence_and_frequency_penalties_are_openais():
    # transformers has no such processors; OpenAI defines them as
    # logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty
    # over the generated tokens only (not the prompt).
    rng = random.Random(2)
    mixes = [(0.0, 0.0), (0.5, 0.0), (0.0, 1.5), (-1.0, 2.0), (2.0, -2.0)]
    requests = [_request(i, _tokens(rng, 6), _tokens(rng, 12), presence_penalty=pp,
                         frequency_penalty=fp) for i, (pp, fp) in enumerate(mixes)]
    logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(3))
    got = apply_controls(logits, SamplingMetadata.from_requests(requests, VOCAB))
    for i, (req, (pp, fp)) in enumerate(zip(requests, mixes)):
        want = logits[i].clone()
        for token in set(req.output_token_ids):
            count = req.output_token_ids.count(token)
            want[token] -= count * fp + pp
        torch.testing.assert_close(got[i], want)


def test_min_tokens_masks_eos_and_stop_tokens_like_transformers():
    requests = [_request(0, [1, 2, 3], [7, 8], min_tokens=4),  # below: EOS masked
                _request(1, [1, 2], [7, 8, 9, 10], min_tokens=4),  # reached: nothing masked
                _request(2, [4], [], min_tokens=1, stop_token_ids=(9,)),  # stop token too
                _request(3, [4], [], min_tokens=3, ignore_eos=True, stop_token_ids=(11,))]
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4))
    got = apply_controls(logits, SamplingMetadata.from_requests(requests, VOCAB, EOS))
    for i, req in enumerate(requests):
        stops = list(req.params.stop_token_ids) + ([] if req.params.ignore_eos else list(EOS))
        processor = MinNewTokensLengthLogitsProcessor(req.num_prompt_tokens,
                                                      req.params.min_tokens, stops)
        want = processor(torch.tensor([req.all_token_ids]), logits[i:i + 1].clone())
        assert torch.equal(got[i:i + 1], want)
    assert got[0, 2] == -math.inf and got[1, 2] == logits[1, 2]
    assert got[3, 11] == -math.inf and got[3, 2] == logits[3, 2]  # ignore_eos: EOS not masked
    # Greedy rows never pick a masked token, even one the model prefers.
    logits[:, 2] = 50.0
    out = sample(logits, SamplingMetadata.from_requests(requests, VOCAB, EOS))
    assert out.token_ids[0] != 2 and out.token_ids[1] == 2


def test_logit_bias_of_100_forces_its_token_for_greedy_and_sampled_rows():
    requests = [_request(0, [1], [], logit_bias={17: 100.0}),
                _request(1, [1], [], temperature=1.0, logit_bias={(40): 100.0, 3: -100.0}),
                _request(2, [1], [], temperature=1.0, top_p=0.5, logit_bias={9: 100.0})]
    for seed in range(20):
        logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(seed)) * 5
        out = sample(logits, SamplingMetadata.from_requests(requests, VOCAB))
        assert out.token_ids == [17, 40, 9]


@pytest.mark.parametrize("min_p,temperature", [(0.05, 1.0), (0.2, 0.7), (0.5, 1.5)])
def test_min_p_matches_a_direct_computation_and_transformers(min_p, temperature):
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    meta = SamplingMetadata.from_requests(
        [_request(0, [1], [], temperature=temperature, min_p=min_p)], VOCAB)

    probs = sample(logits, dataclasses.replace(meta, return_probs=True)).probs
    assert probs is not None
    direct = torch.softmax(logits / temperature, -1)
    direct = torch.where(direct >= min_p * direct.max(), direct, torch.zeros(()))
    direct = direct / direct.sum()
    torch.testing.assert_close(probs, direct)
    kept = MinPLogitsWarper(min_p)(torch.zeros(1, 1, dtype=torch.long), logits / temperature)
    assert torch.equal(probs > 0, kept.isfinite())


def _reference_row(logits: torch.Tensor, req: Request, eos: tuple[int, ...]
                   ) -> tuple[int, torch.Tensor]:
    """One row, the slow way: each control as its definition says, then one draw."""
    p = req.params
    x = logits.clone()
    for token in set(req.all_token_ids):
        if p.repetition_penalty != 1.0:
            x[token] = (x[token] * p.repetition_penalty if x[token] < 0
                        else x[token] / p.repetition_penalty)
    for token in set(req.output_token_ids):
        x[token] -= req.output_token_ids.count(token) * p.frequency_penalty + p.presence_penalty
    for token, bias in p.logit_bias:
        x[token] += bias
    if req.num_output_tokens < p.min_tokens:
        for token in p.stop_token_ids + (() if p.ignore_eos else eos):
            x[token] = -math.inf
    if p.greedy:
        token = int(x.argmax())
        return token, torch.nn.functional.one_hot(torch.tensor(token), VOCAB).float()
    x = x / p.temperature
    if 0 < p.top_k < VOCAB:
        x[x < x.topk(p.top_k).values[-1]] = -math.inf
    if p.top_p < 1.0:
        values, order = x.sort(descending=True)
        probs = values.softmax(-1)
        before = probs.cumsum(-1) - probs
        x[order[before >= p.top_p]] = -math.inf
    probs = x.softmax(-1)
    if p.min_p > 0:
        probs[probs < p.min_p * probs.max()] = 0.0
        probs = probs / probs.sum()
    # Inverse CDF on one uniform number of the row's generator, as the sampler draws.
    u = float(torch.rand(1, generator=req.generator, dtype=torch.float64))
    cdf = probs.double().cumsum(-1)
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])],
                                                   dtype=torch.float64), right=True)), probs


def _random_params(rng: random.Random) -> dict:
    params: dict = {"max_tokens": 32}
    if rng.random() < 0.7:
        params["temperature"] = rng.choice([0.5, 1.0, 1.7])
        if rng.random() < 0.4:
            params["top_k"] = rng.choice([1, 3, 20])
        if rng.random() < 0.4:
            params["top_p"] = rng.choice([0.3, 0.8, 0.95])
        if rng.random() < 0.4:
            params["min_p"] = rng.choice([0.01, 0.1, 0.3])
    if rng.random() < 0.4:
        params["repetition_penalty"] = rng.choice([0.8, 1.2, 2.0])
    if rng.random() < 0.4:
        params["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.4:
        params["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.3:
        params["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-100, 100)
                                for _ in range(rng.randrange(1, 6))}
    if rng.random() < 0.3:
        params["min_tokens"] = rng.randrange(0, 8)
        params["stop_token_ids"] = tuple(rng.sample(range(VOCAB), 2))
        params["ignore_eos"] = rng.random() < 0.3
    if rng.random() < 0.3:
        params["seed"] = rng.randrange(1000)
    return params


@pytest.mark.parametrize("trial", range(12))
def test_random_mixes_batched_equal_the_per_row_reference(trial):
    rng = random.Random(trial)
    num_rows = rng.randrange(1, 12)
    rows = [_random_params(rng) for _ in range(num_rows)]
    prompts = [_tokens(rng, rng.randrange(1, 10)) for _ in range(num_rows)]
    outputs = [_tokens(rng, rng.randrange(0, 10)) for _ in range(num_rows)]
    logits = torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(trial)) * 3
    batch = [_request(i, prompts[i], outputs[i], **rows[i]) for i in range(num_rows)]
    meta = SamplingMetadata.from_requests(batch, VOCAB, EOS)

    out = sample(logits, dataclasses.replace(meta, return_probs=True))
    assert out.failed_rows == ()
    assert out.probs is not None
    for i in range(num_rows):
        alone = _request(i, prompts[i], outputs[i], **rows[i])
        token, probs = _reference_row(logits[i], alone, EOS)
        assert out.token_ids[i] == token, (i, rows[i])
        torch.testing.assert_close(out.probs[i], probs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kwargs,field", [
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"repetition_penalty": 11.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": float("nan")}, "min_p"),
    ({"logit_bias": {3: 101.0}}, "logit_bias"),
    ({"logit_bias": {3: float("nan")}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": ((1, 1.0), (1, 2.0))}, "logit_bias"),
    ({"logit_bias": 7}, "logit_bias"),
])
def test_bad_controls_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_a_batch_asking_for_no_control_builds_no_vocab_tensors():
    meta = SamplingMetadata.from_requests([_request(0, [1], [3], temperature=1.0)])
    assert meta.logit_bias is None and meta.seen_tokens is None
    assert meta.output_token_counts is None and meta.blocked_tokens is None
    with pytest.raises(ValueError, match="^vocab_size:"):
        SamplingMetadata.from_requests([_request(0, [1], [], logit_bias={1: 1.0})])


def test_top_p_beyond_the_candidates_falls_back_to_the_whole_row():
    # A flat row over 5000 tokens: its 0.9 nucleus holds ~4500 tokens, far past the 1024
    # candidates; a peaked row's nucleus lies inside them. Both cut as a full sort would.
    vocab = 5000
    gen = torch.Generator().manual_seed(6)
    logits = torch.stack([torch.randn(vocab, generator=gen) * 0.1,
                          torch.randn(vocab, generator=gen) * 8.0])
    requests = [Request(f"t{i}", [1], SamplingParams(temperature=1.0, top_p=0.9),
                        generator=torch.Generator().manual_seed(i)) for i in range(2)]
    meta = dataclasses.replace(SamplingMetadata.from_requests(requests), return_probs=True)
    probs = sample(logits, meta).probs
    assert probs is not None
    for row in range(2):
        full = logits[row].softmax(-1)
        sorted_p, order = full.sort(descending=True)
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[order] = sorted_p.cumsum(-1) - sorted_p < 0.9
        assert torch.equal(probs[row] > 0, keep)
    assert int((probs[0] > 0).sum()) > 1024 > int((probs[1] > 0).sum())
