"""Speculative decoding's pure parts: the n-gram proposer, adaptive k, the acceptance rule
(and the statistical test that sampled speculation keeps the target distribution), no model."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.server.engine.request import Request, SamplingParams
from loraplex.server.engine.sampler import SamplingMetadata, sample
from loraplex.server.engine.spec.accept import keep_draws, rejection_sample, verify
from loraplex.server.engine.spec.proposer import NgramIndex, NgramProposer
from loraplex.server.engine.spec.state import MAX_PAUSE, SpecState

# -- the n-gram proposer ---------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex(1, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # The suffix (2, 6, 7) never occurred before; (6, 7) did, at 1-2 and 5-6: the latest one
    # (followed by 9, 2, 6) wins.
    assert index.lookup(tokens, 3) == [9, 2, 6]
    index = NgramIndex(1, 3)
    assert index.lookup([1, 2, 3, 4, 2, 3], 2) == [4, 2]  # the 2-gram (2, 3) -> 4, 2


def test_lookup_prefers_longer_ngrams():
    index = NgramIndex(1, 2)
    # "3" alone last occurred before 9; "4 3" occurred before 5.
    tokens = [4, 3, 5, 0, 3, 9, 4, 3]
    assert index.lookup(tokens, 1) == [5]
    assert NgramIndex(1, 1).lookup(tokens, 1) == [9]


def test_lookup_without_match_proposes_nothing():
    assert NgramIndex(2, 4).lookup([1, 2, 3, 4, 5], 4) == []
    assert NgramIndex(1, 2).lookup([7], 3) == []
    assert NgramIndex(1, 2).lookup([1, 1, 2], 0) == []


def test_repeating_pattern_continues_past_the_suffix():
    # The latest "1 2" is two tokens back: its continuation runs into the proposal itself.
    assert NgramIndex(2, 2).lookup([1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert NgramIndex(1, 1).lookup([3, 3], 4) == [3, 3, 3, 3]


def test_incremental_index_equals_a_fresh_one():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (300,), generator=gen).tolist()
    grown = NgramIndex(2, 4)
    for end in range(1, len(tokens) + 1, 7):
        assert grown.lookup(tokens[:end], 4) == NgramIndex(2, 4).lookup(tokens[:end], 4)


def test_ngram_sizes_are_validated():
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramProposer(0, 2)
    proposer = NgramProposer(2, 3)
    contexts = [proposer.new_context(), proposer.new_context()]
    assert proposer.propose(contexts, [[1, 2, 3, 1, 2], [4, 5, 6]], [2, 2]) == [[3, 1], []]


# -- adaptive k --------------------------------------------------------------------------------


def test_k_grows_on_full_acceptance_and_shrinks_on_partial():
    s = SpecState(None, max_k=4, k=2)
    assert s.next_k() == 2
    s.update(2, 2)
    assert s.k == 3
    s.update(3, 3)
    s.update(4, 4)
    assert s.k == 4  # capped at max_k
    s.update(4, 1)
    assert s.k == 2
    assert (s.num_proposed, s.num_accepted, s.num_verifications) == (13, 10, 4)
    assert s.acceptance_rate == pytest.approx(10 / 13)


def test_repeated_rejections_pause_proposing_then_retry():
    s = SpecState(None, max_k=4)
    pauses = []
    for _ in range(8):
        assert s.next_k() >= 1
        s.update(s.k, 0)
        assert s.k == 1
        pauses.append(s.pause)
        for _ in range(s.pause):
            assert s.next_k() == 0
    assert pauses == [0, 1, 3, 7, 15, MAX_PAUSE, MAX_PAUSE, MAX_PAUSE]
    s.update(1, 1)  # one hit ends the run of rejections
    assert (s.num_rejected_in_row, s.k) == (0, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecState(None, max_k=0)


# -- the acceptance rule -------------------------------------------------------------------------


def test_verify_accepts_the_matching_prefix_then_the_target_token():
    assert verify([4, 5, 6], [4, 5, 9, 1]) == ([4, 5, 9], 2)
    assert verify([4, 5, 6], [3, 5, 6, 1]) == ([3], 0)
    assert verify([4, 5, 6], [4, 5, 6, 1]) == ([4, 5, 6, 1], 3)  # all accepted: the bonus
    assert verify([], [7]) == ([7], 0)
    with pytest.raises(ValueError, match="1 \\+ k"):
        verify([1, 2], [1, 2])


V = 4  # the synthetic model's vocabulary


def _table(seed: int = 3) -> torch.Tensor:
    # logits of the next token given the last two: [V, V, V], peaked enough that a good
    # proposal is often accepted and often not.
    return torch.randn(V, V, V, generator=torch.Generator().manual_seed(seed)) * 1.5


TABLE = _table()


def _logits(tokens: list[int]) -> torch.Tensor:
    return TABLE[tokens[-2], tokens[-1]]


def _target_probs(prefix: list[int], length: int) -> dict[tuple[int, ...], float]:
    """The exact distribution of the next ``length`` tokens after ``prefix``."""
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, p in out.items():
            probs = _logits(prefix + list(seq)).softmax(-1)
            for t in range(V):
                nxt[seq + (t,)] = p * float(probs[t])
        out = nxt
    return out


def _propose(tokens: list[int], k: int) -> list[int]:
    # A deterministic proposer that is sometimes right: the model's argmax path, with every
    # third position replaced by a fixed guess.
    out: list[int] = []
    for j in range(k):
        t = int(_logits(tokens + out).argmax()) if (len(tokens) + j) % 3 else 1
        out.append(t)
    return out


def _speculate(prompt: list[int], seed: int, num_tokens: int, k: int,
               rule: str = "verify") -> list[int]:
    """What the engine does for one sampled request: propose, sample 1 + k rows with the
    real sampler (the request's generator, one uniform per row), verify, rewind the draws."""
    gen = torch.Generator().manual_seed(seed)
    req = Request("r", list(prompt), SamplingParams(temperature=1.0, max_tokens=num_tokens),
                  generator=gen)
    out: list[int] = []
    while len(out) < num_tokens:
        tokens = prompt + out
        proposal = _propose(tokens, k)
        rows = torch.stack([_logits(tokens + proposal[:j]) for j in range(len(proposal) + 1)])
        if rule == "textbook":
            verdict = rejection_sample(rows.softmax(-1), proposal, gen)
        else:
            meta = SamplingMetadata.from_requests([req] * len(rows), V)
            state = gen.get_state()
            result = sample(rows, meta)
            assert not result.failed_rows
            verdict = verify(proposal, result.token_ids)
            if rule == "always":  # a wrong rule, to show the test can fail
                verdict = verify(proposal, [*proposal, result.token_ids[-1]])
            keep_draws(gen, state, len(verdict.token_ids))
        out.extend(verdict.token_ids)
    return out[:num_tokens]


def _chi_square(counts: dict[tuple[int, ...], int], expected: dict[tuple[int, ...], float],
                n: int) -> tuple[float, float]:
    """The statistic and its 99.9% critical value (Wilson-Hilferty, df = cells - 1)."""
    stat = sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in expected.items())
    df = len(expected) - 1
    z = 3.090  # the standard normal's 99.9% quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


PROMPT = [0, 2, 1, 3]
NUM_SEEDS = 3000  # fixed seeds 0..2999: the test is deterministic


@pytest.mark.parametrize("rule", ["verify", "textbook"])
def test_sampled_speculation_keeps_the_target_distribution(rule):
    """The first 3 tokens (64 outcomes) over 3000 seeds, against their exact probabilities:
    a chi-square test at the 99.9% level (stated tolerance), for the engine's coupled rule
    and the textbook rule; a rule that accepts every proposal fails the same test."""
    expected = _target_probs(PROMPT, 3)
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(NUM_SEEDS):
        seq = tuple(_speculate(PROMPT, seed, 3, k=3, rule=rule))
        counts[seq] = counts.get(seq, 0) + 1
    stat, critical = _chi_square(counts, expected, NUM_SEEDS)
    assert stat < critical, (stat, critical)


def test_a_wrong_rule_fails_the_distribution_test():
    expected = _target_probs(PROMPT, 3)
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(NUM_SEEDS // 3):
        seq = tuple(_speculate(PROMPT, seed, 3, k=3, rule="always"))
        counts[seq] = counts.get(seq, 0) + 1
    stat, critical = _chi_square(counts, expected, NUM_SEEDS // 3)
    assert stat > 10 * critical


def test_seeded_speculation_draws_the_tokens_of_plain_sampling():
    """One uniform per emitted token, rewound past the rows not used: a seeded request's
    tokens with speculation (any k) are those it samples without (k = 0)."""
    for seed in range(40):
        plain = _speculate(PROMPT, seed, 12, k=0)
        for k in (1, 2, 5):
            assert _speculate(PROMPT, seed, 12, k=k) == plain, (seed, k)


def test_keep_draws_rewinds_to_the_used_draws():
    gen = torch.Generator().manual_seed(7)
    state = gen.get_state()
    torch.rand(5, generator=gen, dtype=torch.float64)
    keep_draws(gen, state, 2)
    after = float(torch.rand(1, generator=gen, dtype=torch.float64))
    ref = torch.Generator().manual_seed(7)
    assert after == float(torch.rand(3, generator=ref, dtype=torch.float64)[2])


def test_rejection_sample_checks_shapes():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(torch.ones(2, 4) / 4, [1, 2], gen)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.ones(3, 4) / 4, [1, 2], gen, torch.ones(3, 4) / 4)


def test_rejection_sample_with_a_draft_distribution_keeps_the_target():
    """A proposer with its own distribution q (a draft model): the general rule."""
    gen = torch.Generator().manual_seed(11)
    p = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    q = torch.tensor([[0.1, 0.1, 0.8]])
    counts = [0, 0, 0]
    n = 6000
    for _ in range(n):
        x = int(torch.multinomial(q[0], 1, generator=gen))
        verdict = rejection_sample(p, [x], gen, q)
        counts[verdict.token_ids[0]] += 1
    expected = {(t,): float(p[0, t]) for t in range(3)}
    stat, critical = _chi_square({(t,): c for t, c in enumerate(counts)}, expected, n)
    assert stat < critical, (stat, critical)
