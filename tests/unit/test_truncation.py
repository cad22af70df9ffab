"""The sampler's cuts from candidates (``truncation.py``) against a full stable sort of each
row, on vocabularies large enough that every search path runs: top-k from groups (and the
rows whose k-th value ties too widely, cut over the row), top-p from the top-k survivors,
from 64 groups, from the 1024 most likely tokens and from a whole sort, min-p on the
support, and logprobs' top n."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from loraplex.server.engine.request import Request, SamplingParams
from loraplex.server.engine.sampler import SamplingMetadata, sample
from loraplex.server.engine.truncation import top_n


def _request(i: int, **params) -> Request:
    return Request(f"t{i}", [1], SamplingParams(**params),
                   generator=torch.Generator().manual_seed(500 + i))


def _reference(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator
               ) -> tuple[int, torch.Tensor]:
    """One row ``[V]`` the slow way: each cut over the whole row, top-p by a stable sort
    (more likely first, the lower token id first among equal probabilities), then the
    inverse-CDF draw of one uniform number."""
    vocab = logits.shape[-1]
    if p.greedy:  # top_k=1 is greedy
        token = int(logits.argmax())
        return token, torch.nn.functional.one_hot(torch.tensor(token), vocab).float()
    x = logits[None].clone() / p.temperature  # [1, V]
    if 0 < p.top_k < vocab:
        x[x < x.topk(p.top_k).values[:, -1:]] = -math.inf
    if p.top_p < 1.0:
        probs = x.softmax(-1)
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        drop = order[sorted_p.cumsum(-1) - sorted_p >= p.top_p]
        x[0, drop] = -math.inf
    probs = x.softmax(-1)
    if p.min_p > 0:
        probs[probs < p.min_p * probs.amax(-1, keepdim=True)] = 0.0
        probs = probs / probs.sum(-1, keepdim=True)
    u = float(torch.rand(1, generator=generator, dtype=torch.float64))
    cdf = probs[0].double().cumsum(-1)
    token = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64),
                                   right=True))
    return token, probs[0]


def _rows(kind: str, vocab: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(vocab, generator=gen)
    if kind == "peaked":  # a nucleus of a few tokens: from the candidates of 64 groups
        return x * 8
    if kind == "flat":  # a nucleus of most of the row: from a whole sort
        return x * 0.1
    if kind == "plateau":  # ~500 likely tokens: from the 1024 most likely
        x = x * 0.1
        x[torch.randperm(vocab, generator=gen)[:500]] += 12.0
        return x
    if kind == "ties":  # equal values everywhere: the order among ties decides the cut
        return (x * 2).round() / 2
    if kind == "wide-tie":  # the k-th value shared by thousands of tokens: cut over the row
        x = torch.zeros(vocab)
        x[torch.randperm(vocab, generator=gen)[:3]] = torch.tensor([3.0, 2.0, 1.0])
        return x
    raise ValueError(kind)


KINDS = ["peaked", "flat", "plateau", "ties", "wide-tie"]
CUTS = [dict(top_k=50), dict(top_p=0.9), dict(top_k=50, top_p=0.9, min_p=0.05),
        dict(top_k=7, top_p=0.5), dict(top_p=0.95, min_p=0.1), dict(top_k=300, top_p=0.99),
        dict(min_p=0.2), dict(top_k=1), dict()]


@pytest.mark.parametrize("vocab", [49152, 5000, 1000])
@pytest.mark.parametrize("trial", range(3))
def test_batched_cuts_equal_a_full_stable_sort_per_row(vocab, trial):
    rng = random.Random(vocab + trial)
    gen = torch.Generator().manual_seed(trial)
    rows = [(rng.choice(KINDS), dict(rng.choice(CUTS), temperature=rng.choice([0.5, 1.0])))
            for _ in range(rng.randrange(4, 14))]
    logits = torch.stack([_rows(kind, vocab, gen) for kind, _ in rows])
    requests = [_request(i, **params) for i, (_, params) in enumerate(rows)]
    meta = dataclasses.replace(SamplingMetadata.from_requests(requests), return_probs=True)
    out = sample(logits, meta)
    assert out.failed_rows == () and out.probs is not None
    for i, (kind, params) in enumerate(rows):
        alone = _request(i, **params)
        token, probs = _reference(logits[i], alone.params, alone.generator)
        assert out.token_ids[i] == token, (kind, params)
        assert torch.equal(out.probs[i] > 0, probs > 0), (kind, params)
        torch.testing.assert_close(out.probs[i], probs, rtol=1e-5, atol=1e-7)
        # The same row alone, through the same batched code: bit for bit.
        single = sample(logits[i:i + 1], dataclasses.replace(
            SamplingMetadata.from_requests([_request(i, **params)]), return_probs=True))
        assert single.token_ids == [out.token_ids[i]]
        assert single.probs is not None and torch.equal(single.probs[0], out.probs[i])


def test_ties_at_the_nucleus_edge_keep_the_lower_token_ids():
    # 40 tokens of one probability hold the mass: top-p 0.5125 keeps the first 21 of them in
    # a stable sort (the 21 lowest ids), whatever order the search found them in.
    vocab = 49152
    gen = torch.Generator().manual_seed(3)
    tied = torch.randperm(vocab, generator=gen)[:40]
    logits = torch.randn(vocab, generator=gen) * 0.01 - 30.0
    logits[tied] = 10.0
    meta = dataclasses.replace(SamplingMetadata.from_requests(
        [_request(0, temperature=1.0, top_p=0.5125),
         _request(1, temperature=1.0, top_k=50, top_p=0.5125)]), return_probs=True)
    probs = sample(torch.stack([logits, logits]), meta).probs
    assert probs is not None
    want = sorted(tied.tolist())[:21]
    for row in range(2):
        assert probs[row].nonzero().flatten().tolist() == want


def test_fewer_finite_tokens_than_top_k_keeps_them_all():
    # A mask leaving 3 tokens under top_k=50: the k-th value is -inf, nothing more is cut.
    vocab = 4096
    logits = torch.full((1, vocab), -math.inf)
    logits[0, [5, 900, 4000]] = torch.tensor([1.0, 2.0, 0.5])
    meta = dataclasses.replace(SamplingMetadata.from_requests(
        [_request(0, temperature=1.0, top_k=50, top_p=0.99)]), return_probs=True)
    out = sample(logits, meta)
    assert out.failed_rows == () and out.probs is not None
    assert out.probs[0].nonzero().flatten().tolist() == [5, 900, 4000]


@pytest.mark.parametrize("vocab,n", [(49152, 5), (49152, 20), (3000, 1), (40, 7)])
def test_top_n_equals_a_stable_sort(vocab, n):
    gen = torch.Generator().manual_seed(vocab + n)
    values = torch.randn(6, vocab, generator=gen)
    values[1] = (values[1] * 2).round()  # ties, some at the n-th value
    values[2] = 0.0  # every value tied
    values[3, 7] = float("nan")  # NaN sorts first, as in a sort
    got_values, got_ids = top_n(values, n)
    want = values.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(got_ids, want.indices[:, :n])
    torch.testing.assert_close(got_values, want.values[:, :n], equal_nan=True)


def test_logprobs_top_n_in_stable_order_and_raw_logits_untouched():
    vocab = 49152
    logits = (torch.randn(3, vocab, generator=torch.Generator().manual_seed(9)) * 2).round()
    before = logits.clone()
    requests = [_request(0, temperature=1.0, top_k=40, top_p=0.8, logprobs=5,
                         repetition_penalty=1.3, logit_bias={11: 4.0}),
                _request(1, logprobs=2), _request(2, temperature=0.7, logprobs=0)]
    meta = SamplingMetadata.from_requests(requests, vocab)
    first = sample(logits, meta)
    assert torch.equal(logits, before)
    lp = logits.log_softmax(-1)
    for row, n in enumerate([5, 2, 0]):
        got = first.logprobs[row]
        assert got is not None and got.token_id == first.token_ids[row]
        assert got.logprob == float(lp[row, got.token_id])
        want = lp[row].sort(descending=True, stable=True)
        assert [t for t, _ in got.top] == want.indices[:n].tolist()
        assert [v for _, v in got.top] == want.values[:n].tolist()
    # The buffers a call reuses never show through what an earlier call returned.
    probs = sample(logits, dataclasses.replace(meta, return_probs=True)).probs
    assert probs is not None
    kept = probs.clone()
    sample(torch.randn(3, vocab), dataclasses.replace(meta, return_probs=True))
    assert torch.equal(probs, kept)
