"""n > 1 with a structured-output constraint: each of the n sequences has its own matcher,
forked off the prompt's first sequence, so n = 3 constrained equals three single constrained
requests (greedy, and seeded with seed..seed+2), and every output validates."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from loraplex.server.params import SamplingParams, StructuredOutput
from tests.engine.test_structured import SCHEMAS, check_valid, compile_all, make_engine
from tests.engine.test_structured import setup as setup  # noqa: F401  (the fixture)
from tests.helpers import assert_pages_idle

N = 3
SPECS = ([StructuredOutput("json_schema", json.dumps(s)) for s in SCHEMAS[:4]]
         + [StructuredOutput("regex", r"(yes|no) [0-9]{1,3}"),
            StructuredOutput("choice", choices=("alpha", "beta", "gamma"))])


def run_n(engine, requests, deadline_s=300):
    """requests: (id, prompt, params, digest). Returns (id, index) -> (tokens, text, last)."""
    for rid, prompt, params, digest in requests:
        engine.add_request(rid, prompt, params, adapter_digest=digest)
    got: dict[tuple[str, int], tuple[list[int], list[str]]] = {}
    final = {}
    deadline = time.monotonic() + deadline_s
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "engine did not finish"
        for out in engine.step():
            tokens, texts = got.setdefault((out.request_id, out.index), ([], []))
            tokens.extend(out.new_token_ids)
            texts.append(out.new_text)
            if out.finished:
                final[out.request_id, out.index] = out
    return {key: (tokens, "".join(texts), final[key]) for key, (tokens, texts) in got.items()}


def the_mix(adapters, temperature, n, seed0=40):
    """One n-sequence request per constraint (rotating over the adapters and the base model),
    each beside a free request."""
    digests = [a.digest for a in adapters] + [None]
    requests = []
    for i, spec in enumerate(SPECS):
        digest = digests[i % len(digests)]
        params = SamplingParams(max_tokens=200, temperature=temperature, seed=seed0 + 10 * i,
                                structured=spec, n=n)
        requests.append((f"c{i}", f"request {i}:", params, digest))
        requests.append((f"f{i}", f"free {i}", SamplingParams(max_tokens=8), digest))
    return requests


def as_singles(requests):
    """Each constrained request's n sequences as n single requests with seeds seed + i."""
    singles = []
    for rid, prompt, params, digest in requests:
        if params.structured is None:
            continue
        for i in range(params.n):
            single = dataclasses.replace(params, n=1, seed=params.seed + i)
            singles.append((f"{rid}.{i}", prompt, single, digest))
    return singles


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("jump_forward", ["exact", "off"])
def test_n_constrained_sequences_equal_single_constrained_requests(setup, temperature,  # noqa: F811
                                                                   jump_forward):
    model, adapters = setup
    engine = make_engine(model, adapters, jump_forward=jump_forward)
    requests = the_mix(adapters, temperature, N)
    together = run_n(engine, requests)
    singles = run_n(make_engine(model, adapters, jump_forward=jump_forward),
                    as_singles(requests))
    for i, spec in enumerate(SPECS):
        for index in range(N):
            tokens, text, out = together[f"c{i}", index]
            assert out.finish_reason == "stop", (i, index, out.error, text)
            check_valid(spec, text)
            assert tokens == singles[f"c{i}.{index}", 0][0], (spec, index)
        if temperature == 0.0:
            assert len({tuple(together[f"c{i}", k][0]) for k in range(N)}) == 1
    if temperature > 0:  # their own seeds and matchers: not n copies of one sequence
        assert any(len({tuple(together[f"c{i}", k][0]) for k in range(N)}) > 1
                   for i in range(len(SPECS)))
    assert all(together[f"f{i}", 0][2].finish_reason in ("stop", "length")
               for i in range(len(SPECS)))
    assert_pages_idle(engine)


def test_n_constrained_under_preemption_and_string_mode(setup):  # noqa: F811
    """Forked sequences keep their own grammar state through preemption (each replays its own
    tokens); in string mode every sequence's output still validates."""
    model, adapters = setup
    requests = the_mix(adapters, 1.0, N, seed0=90)
    roomy = run_n(make_engine(model, adapters), requests)
    tight_engine = make_engine(model, adapters, num_pages=90)
    compile_all(tight_engine, SPECS)  # all admitted at once: the most pressure
    tight = run_n(tight_engine, requests)
    assert tight_engine.scheduler.num_preemptions > 0
    string = run_n(make_engine(model, adapters, jump_forward="string"), requests)
    for i, spec in enumerate(SPECS):
        for index in range(N):
            assert tight[f"c{i}", index][0] == roomy[f"c{i}", index][0], (i, index)
            for got in (tight, string):
                _, text, out = got[f"c{i}", index]
                assert out.finish_reason == "stop", (i, index, out.error)
                check_valid(spec, text)
    assert_pages_idle(tight_engine)


def test_n_constrained_sequences_speculate_with_their_own_matchers(setup):  # noqa: F811
    """Speculation on: each forked sequence drafts and verifies against its own matcher, and
    the n sequences' tokens equal speculation off's (greedy and seeded)."""
    model, adapters = setup
    for temperature in (0.0, 1.0):
        requests = the_mix(adapters, temperature, N, seed0=70)
        off = run_n(make_engine(model, adapters), requests)
        spec_engine = make_engine(model, adapters, speculative_method="ngram",
                                  speculative_cost_gate=False)
        on = run_n(spec_engine, requests)
        assert {k: v[0] for k, v in on.items()} == {k: v[0] for k, v in off.items()}
        for i, spec in enumerate(SPECS):
            for index in range(N):
                _, text, out = on[f"c{i}", index]
                assert out.finish_reason == "stop", (i, index, out.error)
                check_valid(spec, text)
        assert spec_engine.stats().spec.num_proposed_tokens > 0
        assert_pages_idle(spec_engine)


def test_n_with_a_constraint_is_accepted():
    params = SamplingParams(n=3, structured=StructuredOutput("regex", "[a-z]{2}"))
    assert params.n == 3 and params.structured is not None
