"""The sampler's one shape: batched parameters, per-row generators, failed rows reported."""

from __future__ import annotations

import dataclasses

import torch

from loraplex.server.engine.request import Request, SamplingParams
from loraplex.server.engine.sampler import SamplingMetadata, sample, unpack_bitmask

VOCAB = 50


def _request(i: int, **params) -> Request:
    return Request(f"r{i}", [0], SamplingParams(**params),
                   generator=torch.Generator().manual_seed(100 + i))


MIXED = [dict(), dict(temperature=0.7), dict(temperature=1.3, top_k=5),
         dict(temperature=1.0, top_p=0.6), dict(temperature=0.9, top_k=8, top_p=0.8),
         dict(temperature=2.0, top_k=1), dict(temperature=1.0, logprobs=3)]


def test_a_mixed_batch_draws_what_each_row_draws_alone():
    logits = torch.randn(len(MIXED), VOCAB, generator=torch.Generator().manual_seed(0))
    batch = sample(logits, SamplingMetadata.from_requests(
        [_request(i, **p) for i, p in enumerate(MIXED)]))
    assert batch.failed_rows == ()
    for i, p in enumerate(MIXED):
        alone = sample(logits[i:i + 1], SamplingMetadata.from_requests([_request(i, **p)]))
        assert alone.token_ids == [batch.token_ids[i]]
    assert batch.token_ids[0] == int(logits[0].argmax())  # greedy
    assert batch.token_ids[5] == int(logits[5].argmax())  # top_k=1 is greedy
    assert batch.token_ids[2] in logits[2].topk(5).indices.tolist()
    lp = batch.logprobs[6]
    assert lp is not None and lp.token_id == batch.token_ids[6] and len(lp.top) == 3
    assert all(batch.logprobs[i] is None for i in range(6))


def test_non_finite_rows_are_reported_not_raised():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    logits[1, 3] = float("nan")
    logits[2, 7] = float("inf")
    logits[4] = float("-inf")
    params = [dict(temperature=1.0), dict(temperature=1.0), dict(), dict(), dict(temperature=1.0),
              dict(temperature=1.0, top_p=0.5)]
    requests = [_request(i, **p) for i, p in enumerate(params)]
    out = sample(logits, SamplingMetadata.from_requests(requests))
    assert out.failed_rows == (1, 2, 4)
    assert out.token_ids[3] == int(logits[3].argmax())
    # A temperature that turns finite logits into inf fails its row alone, too.
    meta = SamplingMetadata.from_requests(requests)
    tiny = dataclasses.replace(meta, temperature=meta.temperature.clone().fill_(1e-300))
    assert sample(torch.randn(6, VOCAB), tiny).failed_rows == (0, 1, 4, 5)


def test_greedy_rows_take_the_first_maximum_and_fail_on_nan_or_inf():
    # All-greedy batches take the one-pass path (the maxima and their indices together):
    # ties go to the lowest token id, as argmax gives them; a NaN anywhere or a +inf, or a row
    # of -inf, fails the row, whatever its argmax.
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(2))
    logits[0, [4, 9, 30]] = 50.0  # a three-way tie at the top
    logits[1, [VOCAB - 1, 0]] = 60.0  # tie at both ends of the row
    logits[2, 11] = float("nan")
    logits[3, 5] = float("inf")
    logits[4] = float("-inf")
    logits[5, 17] = float("nan")
    logits[5, 18] = 1e30  # a huge finite value beside the NaN: still failed
    out = sample(logits, SamplingMetadata.from_requests([_request(i) for i in range(7)]))
    assert out.failed_rows == (2, 3, 4, 5)
    assert out.token_ids[0] == 4 and out.token_ids[1] == 0
    assert out.token_ids[6] == int(logits[6].argmax())
    # and beside drawn rows (the working copy's path), the same greedy tokens
    mixed = [_request(i, **({} if i % 2 == 0 else dict(temperature=0.8))) for i in range(7)]
    out2 = sample(logits, SamplingMetadata.from_requests(mixed))
    assert out2.failed_rows == (2, 3, 4, 5)
    assert out2.token_ids[0] == 4 and out2.token_ids[6] == out.token_ids[6]


def test_bitmask_allows_only_its_tokens_for_greedy_and_drawn_rows():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    allowed = [{3, 40}, {31, 32, 33}, set()]
    bitmask = torch.zeros(3, -(-VOCAB // 32), dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            word = int(bitmask[row, t // 32]) | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    assert unpack_bitmask(bitmask, VOCAB)[1].nonzero().flatten().tolist() == [31, 32, 33]
    requests = [_request(0), _request(1, temperature=1.5), _request(2, temperature=1.0)]
    meta = dataclasses.replace(SamplingMetadata.from_requests(requests),
                               allowed_token_bitmask=bitmask, return_probs=True)
    for _ in range(20):
        out = sample(logits, meta)
        assert out.token_ids[0] == max(allowed[0], key=lambda t: float(logits[0, t]))
        assert out.token_ids[1] in allowed[1]
        assert out.failed_rows == (2,)  # nothing allowed: reported
    assert out.probs is not None
    assert set(out.probs[1].nonzero().flatten().tolist()) == allowed[1]
    assert out.probs[0, out.token_ids[0]] == 1.0


def test_min_p_and_logit_bias():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    requests = [_request(0, temperature=1.0)]
    meta = dataclasses.replace(SamplingMetadata.from_requests(requests),
                               min_p=torch.tensor([0.5]))
    assert {sample(logits, meta).token_ids[0] for _ in range(200)} == {0, 1}
    bias = torch.tensor([[0.0, 0.0, 0.0, 100.0]])
    biased = dataclasses.replace(SamplingMetadata.from_requests([_request(1)]), logit_bias=bias)
    assert sample(logits, biased).token_ids == [3]
