"""Traces: deterministic for a seed, saved and loaded exactly, and drawn from the
distributions they claim (seeded statistical tests at a 0.1% level, each with a check that
the same test rejects a wrong distribution)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from loraplex.loadtest.distributions import LengthDist, Popularity, arrival_times
from loraplex.loadtest.scenarios import SCENARIOS, scenario_trace
from loraplex.loadtest.trace import (
    Trace,
    TraceConfig,
    adapter_name,
    generate_trace,
    merge_traces,
)

Z_999 = 3.090  # standard normal 0.999 quantile
KS_999 = 1.949  # Kolmogorov distribution: P(sqrt(n) D > 1.949) = 0.001


def ks_exponential(samples: np.ndarray, mean: float) -> float:
    """sqrt(n) * the Kolmogorov-Smirnov distance to Exp(mean)."""
    x = np.sort(samples)
    n = x.size
    cdf = 1.0 - np.exp(-x / mean)
    d = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
    return math.sqrt(n) * d


def chi2_critical(dof: int, z: float = Z_999) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    expected = probs * counts.sum()
    keep = expected > 0
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


# -- determinism and files ------------------------------------------------------------------
def test_same_seed_same_file_other_seed_other_file(tmp_path):
    cfg = TraceConfig(num_requests=300, rate=5, num_adapters=16, base_fraction=0.1,
                      tenants=(("a", 3), ("b", 1)), prefix_len=20, num_prefixes=2, seed=7)
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    generate_trace(cfg).save(a)
    generate_trace(cfg).save(b)
    generate_trace(replace(cfg, seed=8)).save(c)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_save_load_round_trip_keeps_everything(tmp_path):
    cfg = TraceConfig(num_requests=50, rate=3, num_adapters=4, prefix_len=16, num_prefixes=3,
                      tenants=(("x", 1), ("y", 2)), seed=1)
    trace = generate_trace(cfg)
    path = tmp_path / "t.jsonl"
    trace.save(path)
    loaded = Trace.load(path)
    assert loaded == trace
    assert loaded.config == cfg
    # prefixes are stored once, in the header: a line holds only the suffix
    line = json.loads(path.read_text().splitlines()[1])
    assert len(line["prompt"]) == len(trace.requests[0].prompt) - 16


def test_load_refuses_other_files(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"format": "something-else"}\n')
    with pytest.raises(ValueError, match="not a loraplex-trace"):
        Trace.load(path)
    path.write_text('{"format": "loraplex-trace", "version": 1}\n{"id": "r0"}\n')
    with pytest.raises(ValueError, match=":2: malformed"):
        Trace.load(path)


def test_each_aspect_has_its_own_random_stream():
    base = generate_trace(TraceConfig(num_requests=200, rate=2, num_adapters=8, seed=3))
    faster = generate_trace(TraceConfig(num_requests=200, rate=8, num_adapters=8, seed=3))
    more = generate_trace(TraceConfig(num_requests=200, rate=2, num_adapters=512, seed=3))
    # a rate changes only the time scale: the same arrival pattern, four times as fast
    np.testing.assert_allclose([r.arrival_time for r in faster.requests],
                               [r.arrival_time / 4 for r in base.requests])
    # the adapter count changes only the adapters: arrivals, lengths, prompts stay
    for a, b in zip(base.requests, more.requests):
        assert (a.arrival_time, a.prompt, a.output_len, a.tenant) == (
            b.arrival_time, b.prompt, b.output_len, b.tenant)
    assert [r.adapter for r in base.requests] != [r.adapter for r in more.requests]
    # scaling a trace equals generating it at the other rate
    assert base.scaled(8).requests == faster.requests


# -- arrivals -------------------------------------------------------------------------------
def test_poisson_gaps_are_exponential_and_the_test_has_power():
    rng = np.random.default_rng(0)
    gaps = np.diff(arrival_times(rng, 5000, rate=4.0), prepend=0.0)
    assert ks_exponential(gaps, 0.25) < KS_999
    assert abs(gaps.mean() - 0.25) < Z_999 * 0.25 / math.sqrt(gaps.size)
    bursty = np.diff(arrival_times(np.random.default_rng(0), 5000, 4.0, burstiness=0.5),
                     prepend=0.0)
    assert ks_exponential(bursty, 0.25) > KS_999  # same mean, not exponential: rejected
    assert ks_exponential(gaps, 0.3) > KS_999  # the wrong rate: rejected


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_have_the_rate_and_the_burstiness(burstiness):
    gaps = np.diff(arrival_times(np.random.default_rng(1), 20000, 10.0, burstiness),
                   prepend=0.0)
    cv = 1 / math.sqrt(burstiness)
    # mean: standard error cv * mean / sqrt(n); CV: within 5% (its standard error is ~1%)
    assert abs(gaps.mean() - 0.1) < Z_999 * cv * 0.1 / math.sqrt(gaps.size)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_infinite_rate_sends_everything_at_once():
    trace = generate_trace(TraceConfig(num_requests=10, rate=math.inf))
    assert {r.arrival_time for r in trace.requests} == {0.0}


# -- adapters ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["zipf:1", "zipf:1.5", "uniform", "skewed:0.9"])
def test_popularity_matches_its_distribution(spec):
    n, num_adapters = 20000, 64
    pop = Popularity.parse(spec)
    idx = pop.sample(np.random.default_rng(2), n, num_adapters)
    counts = np.bincount(idx, minlength=num_adapters)
    stat, dof = chi2(counts, pop.probabilities(num_adapters))
    assert stat < chi2_critical(dof)
    # and the same test tells Zipf(1) from Zipf(1.2)
    if spec == "zipf:1":
        wrong, _ = chi2(counts, Popularity("zipf", 1.2).probabilities(num_adapters))
        assert wrong > chi2_critical(dof)


def test_zipf_probabilities():
    p = Popularity.parse("zipf:1").probabilities(4)
    np.testing.assert_allclose(p, np.array([1, 1 / 2, 1 / 3, 1 / 4]) / (25 / 12))


def test_identical_and_distinct_patterns():
    rng = np.random.default_rng(0)
    assert set(Popularity.parse("identical").sample(rng, 100, 8).tolist()) == {0}
    assert Popularity.parse("distinct").sample(rng, 10, 100).tolist() == list(range(10))
    trace = generate_trace(TraceConfig(num_requests=30, adapters="distinct", num_adapters=30))
    assert len({r.adapter for r in trace.requests}) == 30


def test_base_fraction_and_adapter_names():
    trace = generate_trace(TraceConfig(num_requests=4000, num_adapters=8, base_fraction=0.25))
    base = sum(r.adapter == "" for r in trace.requests) / 4000
    assert abs(base - 0.25) < Z_999 * math.sqrt(0.25 * 0.75 / 4000)
    assert {r.adapter for r in trace.requests} - {""} <= {adapter_name(k) for k in range(8)}
    none = generate_trace(TraceConfig(num_requests=20, num_adapters=0))
    assert {r.adapter for r in none.requests} == {""}


# -- tenants and lengths ----------------------------------------------------------------------
def test_tenants_follow_their_weights():
    trace = generate_trace(TraceConfig(num_requests=6000, tenants=(("a", 6), ("b", 3),
                                                                   ("c", 1))))
    counts = np.array([sum(r.tenant == t for r in trace.requests) for t in "abc"])
    stat, dof = chi2(counts, np.array([0.6, 0.3, 0.1]))
    assert stat < chi2_critical(dof)


@pytest.mark.parametrize("spec,mean,std", [
    ("uniform:16:256", 136.0, math.sqrt((241 ** 2 - 1) / 12)),
    ("normal:200:30", 200.0, 30.0),
    ("exponential:100", 100.0, 100.0),
    ("lognormal:100:0.5", 100 * math.exp(0.125), 100 * math.sqrt((math.e ** 0.25 - 1)
                                                                  * math.e ** 0.25)),
])
def test_lengths_have_their_mean(spec, mean, std):
    dist = LengthDist.parse(spec)
    x = dist.sample(np.random.default_rng(4), 20000, max_len=100000)
    assert dist.mean == pytest.approx(mean)
    # rounding to integers moves the mean by < 0.5 (and clipping at 1 a little more)
    assert abs(x.mean() - mean) < Z_999 * std / math.sqrt(x.size) + 0.6
    assert x.min() >= 1


def test_lengths_are_clipped_and_uniform_is_inclusive():
    x = LengthDist.parse("uniform:3:5").sample(np.random.default_rng(0), 3000)
    assert set(x.tolist()) == {3, 4, 5}
    y = LengthDist.parse("normal:100:80").sample(np.random.default_rng(0), 3000, max_len=120)
    assert y.min() >= 1 and y.max() == 120
    assert LengthDist.parse("64").sample(np.random.default_rng(0), 5).tolist() == [64] * 5
    assert str(LengthDist.parse("lognormal:128:0.5")) == "lognormal:128:0.5"


def test_trace_lengths_and_prompt_tokens():
    cfg = TraceConfig(num_requests=500, prompt_len="uniform:10:20", output_len="fixed:7",
                      vocab_size=50, prefix_len=30, num_prefixes=2)
    trace = generate_trace(cfg)
    prefixes = {r.prompt[:30] for r in trace.requests}
    assert prefixes == set(trace.prefixes) and len(prefixes) == 2
    for r in trace.requests:
        assert r.output_len == 7 and 40 <= r.prompt_len <= 50
        assert r.prompt[:30] == trace.prefixes[r.prefix_id]
        assert all(0 <= t < 50 for t in r.prompt)


def test_prompts_from_a_file(tmp_path):
    rows = tmp_path / "prompts.jsonl"
    rows.write_text('{"prompt": "hello there", "output_len": 5}\n'
                    '{"prompt_len": 12}\n{"prompt": [1, 2, 3]}\n')
    trace = generate_trace(TraceConfig(num_requests=300, prompts_file=str(rows),
                                       output_len="fixed:9", seed=5))
    kinds = {("text" if isinstance(r.prompt, str) else len(r.prompt), r.output_len)
             for r in trace.requests}
    assert kinds == {("text", 5), (12, 9), (3, 9)}
    text = tmp_path / "prompts.txt"
    text.write_text("one\n\ntwo\n")
    plain = generate_trace(TraceConfig(num_requests=50, prompts_file=str(text)))
    assert {r.prompt for r in plain.requests} == {"one", "two"}
    path = tmp_path / "t.jsonl"
    trace.save(path)
    assert Trace.load(path) == trace


def test_merge_keeps_order_and_prefixes():
    a = generate_trace(TraceConfig(num_requests=20, rate=1, tenants=(("a", 1),),
                                   prefix_len=8, seed=1))
    b = generate_trace(TraceConfig(num_requests=30, rate=3, tenants=(("b", 1),),
                                   prefix_len=8, seed=2))
    m = merge_traces([a, b], ["a", "b"])
    times = [r.arrival_time for r in m.requests]
    assert times == sorted(times) and len(m) == 50
    assert len({r.request_id for r in m.requests}) == 50
    for r in m.requests:
        assert r.prompt[:8] == m.prefixes[r.prefix_id]


def test_scenarios_generate():
    for name in SCENARIOS:
        trace = scenario_trace(name, num_requests=40, seed=1)
        assert len(trace) == 40
    nn = scenario_trace("noisy-neighbour", num_requests=330, rate=1.0)
    counts = {t: sum(r.tenant == t for r in nn.requests) for t in ("quiet", "noisy")}
    assert counts == {"quiet": 30, "noisy": 300}
    sp = scenario_trace("shared-prefix", num_requests=10)
    assert len(sp.prefixes) == 1 and len(sp.prefixes[0]) == 1000


@pytest.mark.parametrize("bad", [
    {"num_requests": 0}, {"rate": 0}, {"burstiness": -1}, {"adapters": "pareto"},
    {"adapters": "zipf:x"}, {"prompt_len": "uniform:9:3"}, {"output_len": "normal:1"},
    {"base_fraction": 1.5}, {"tenants": ()}, {"tenants": (("a", 1), ("a", 2))},
    {"tenants": (("a", 0),)}, {"prompts_file": "/nonexistent"}, {"num_adapters": -1},
])
def test_config_validation_names_the_field(bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field.split("_")[0]):
        TraceConfig(**bad)
