"""Speculative decoding in the engine: greedy tokens equal peft's (and speculation off's) for
mixed adapters and base requests with preemption and prefix caching; seeded sampled tokens
equal speculation off's and repeat; rejected slots roll back (pages and counts)."""

from __future__ import annotations

import json
import time

import pytest

from loraplex.adapter_store.format import load_adapter
from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.request import SamplingParams
from loraplex.server.params import StructuredOutput
from tests.engine.test_lora_parity import LoadedSource
from tests.helpers import (
    make_model,
    make_peft_adapters,
    peft_greedy,
    random_prompts,
    warm_host_tier,
)

PAGE = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    model = make_model(root / "model", "llama", seed=21)
    paths = make_peft_adapters(model, root / "adapters")
    config = ModelConfig.from_pretrained(model)
    adapters = {name: load_adapter(p, config) for name, p in paths.items()}
    names = list(paths) + [None, None, None, None]  # 8 adapters (ranks 1..64), 4 base
    spans = random_prompts(len(names), seed=31, low=4, high=14)
    # Even requests repeat a span (drafts hit the prompt); odd ones are random (they hit only
    # where the output repeats itself).
    prompts = [s + s + s[:3] if i % 2 == 0 else s for i, s in enumerate(spans)]
    max_tokens = [10 + (i * 3) % 7 for i in range(len(names))]
    expected = peft_greedy(model, paths, prompts, names, max_tokens)
    digests = [adapters[n].digest if n else None for n in names]
    return model, adapters, prompts, digests, max_tokens, expected


def _engine(model, adapters, method, num_pages=160, **kwargs):
    return Engine(EngineConfig(model=str(model), num_pages=num_pages, speculative_method=method,
                               speculative_cost_gate=False, **kwargs,
                               scheduler=SchedulerConfig(page_size=PAGE,
                                                         max_num_batched_tokens=16)),
                  adapter_source=LoadedSource(adapters.values()) if adapters else None)


def _run(engine, prompts, digests, params, arrivals, accepted=None):
    """Requests added at their arrival step; after every step, every running request holds
    exactly the pages its computed tokens fill (what it would hold without speculation).
    ``accepted``, if given, gets each request's accepted draft tokens (its final output)."""
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    drafted: dict[str, int] = {}  # accepted draft tokens, from each final output
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    step = 0
    deadline = time.monotonic() + 180
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompts[i], params[i], adapter_digest=digests[i])
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                assert 0 <= out.num_accepted_draft_tokens <= out.num_draft_tokens
                drafted[out.request_id] = out.num_accepted_draft_tokens
        for req in engine.scheduler.running:
            assert req.draft_token_ids == []
            assert req.num_computed_tokens <= req.num_tokens - 1
            assert len(req.page_ids) == -(-req.num_computed_tokens // PAGE), req.request_id
        step += 1
        assert time.monotonic() < deadline, "no progress in 180 s"
    if accepted is not None:
        accepted.update(drafted)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_greedy_with_speculation_equals_peft_and_off(setup):
    model, adapters, prompts, digests, max_tokens, expected = setup
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    arrivals = [(i * 2) % 5 for i in range(len(prompts))]
    results = {}
    for method in ("ngram", "off"):
        # A pool that the rank-64 adapter and the batch's KV overfill: preemption and
        # eviction; the second pass gets prefix-cache hits.
        engine = _engine(model, adapters, method, num_pages=124)
        warm_host_tier(engine, digests)  # the same schedule (and preemption) on any machine
        per_request: tuple[dict, dict] = ({}, {})
        first = _run(engine, prompts, digests, params, arrivals, per_request[0])
        second = _run(engine, prompts, digests, params, [0] * len(prompts), per_request[1])
        assert sum(sum(d.values()) for d in per_request) \
            == engine.stats().spec.num_accepted_tokens
        assert first == expected and second == expected, method
        stats = engine.stats()
        assert stats.num_preemptions > 0, method
        assert sum(stats.prefix_hit_tokens.values()) > 0, method
        results[method] = stats
        assert stats.pages.num_kv == 0
    spec = results["ngram"].spec
    assert spec.num_accepted_tokens > 0 and spec.num_proposed_tokens > spec.num_accepted_tokens
    assert spec.num_emitted_tokens == spec.num_accepted_tokens + spec.num_verifications
    assert results["off"].spec.num_proposed_tokens == 0


def test_rollback_leaves_the_pool_as_speculation_off(setup):
    """Without eviction pressure, the pool after a run holds exactly what it holds with
    speculation off: the same free pages, the same cached prefix pages."""
    model, _, prompts, _, max_tokens, _ = setup
    params = [SamplingParams(max_tokens=n + 8, ignore_eos=True) for n in max_tokens]
    pools = {}
    for method in ("ngram", "off"):
        engine = _engine(model, {}, method, num_pages=400)
        _run(engine, prompts, [None] * len(prompts), params, [i % 4 for i in range(12)])
        pools[method] = engine.stats().pages
    assert pools["ngram"] == pools["off"]
    assert pools["off"].num_prefix > 0 and pools["off"].num_evictions == 0


def test_sampled_with_speculation_repeats_and_equals_off(setup):
    model, _, prompts, _, max_tokens, _ = setup
    base = [None] * len(prompts)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0, top_k=2, seed=i,
                             logprobs=1 if i % 3 == 0 else None)
              for i, n in enumerate(max_tokens)]
    arrivals = [i % 3 for i in range(len(prompts))]
    on = _engine(model, {}, "ngram")
    first = _run(on, prompts, base, params, arrivals)
    again = _run(on, prompts, base, params, [0] * len(prompts))
    off = _run(_engine(model, {}, "off"), prompts, base, params, arrivals)
    assert first == again == off
    assert on.stats().spec.num_accepted_tokens > 0


def test_stop_inside_an_accepted_run_ends_there(setup):
    """A stop token anywhere in the output ends the request there, also when it comes
    inside a verified run of several tokens: the tokens after it are never output."""
    model, _, prompts, _, _, _ = setup
    plain = _run(_engine(model, {}, "off"), prompts, [None] * len(prompts),
                 [SamplingParams(max_tokens=16, ignore_eos=True)] * len(prompts),
                 [0] * len(prompts))
    # every (prompt, token) where the token first occurs at position k >= 1
    cases = [(i, k) for i, full in enumerate(plain) for k in range(1, len(full))
             if full[k] not in full[:k]]
    engine = _engine(model, {}, "ngram")
    for n, (i, k) in enumerate(cases):
        engine.add_request(f"c{n}", prompts[i], SamplingParams(
            max_tokens=16, ignore_eos=True, stop_token_ids=(plain[i][k],)))
    tokens = {f"c{n}": [] for n in range(len(cases))}
    multi_token_finals = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason == "stop"
                multi_token_finals += len(out.new_token_ids) > 1
    for n, (i, k) in enumerate(cases):
        assert tokens[f"c{n}"] == plain[i][:k + 1], (i, k)
    assert multi_token_finals > 0  # some stops came in a run of accepted draft tokens
    assert engine.stats().pages.num_kv == 0


def test_no_page_leak_over_a_long_run(setup):
    model, _, prompts, _, _, _ = setup
    engine = _engine(model, {}, "ngram", num_pages=60, enable_prefix_caching=False)
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0 if i % 2 else 1.0,
                             top_k=2, seed=i) for i in range(len(prompts))]
    for _ in range(3):
        _run(engine, prompts, [None] * len(prompts), params, [i for i in range(len(prompts))])
        stats = engine.stats()
        assert stats.pages.num_free == stats.pages.num_pages
    assert stats.spec.num_proposed_tokens > stats.spec.num_accepted_tokens > 0
    assert stats.num_preemptions > 0


def test_parallel_sampling_speculates_per_sequence(setup):
    """n > 1: each forked sequence drafts and verifies on its own (its pages shared with its
    siblings until it writes); the tokens are speculation off's, and pages all return."""
    model, _, prompts, _, _, _ = setup
    outs = {}
    for method in ("ngram", "off"):
        engine = _engine(model, {}, method)
        for i in (0, 2, 4):
            engine.add_request(f"n{i}", prompts[i], SamplingParams(
                max_tokens=20, ignore_eos=True, n=3, temperature=1.0, top_k=2, seed=i))
        got: dict[tuple[str, int], list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None, out.error
                got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        outs[method] = (got, engine.stats())
    assert outs["ngram"][0] == outs["off"][0]
    assert len(outs["off"][0]) == 9
    stats = outs["ngram"][1]
    assert stats.spec.num_accepted_tokens > 0
    assert stats.pages.num_kv == 0


def test_tensor_parallel_verifies_drafts_on_every_rank(setup):
    """TP = 2 (gloo, two rank processes): a draft is tokens of the step's chunk, so the step
    message carries it to every rank; greedy tokens equal peft's with speculation on."""
    model, adapters, prompts, digests, max_tokens, expected = setup
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    engine = _engine(model, adapters, "ngram", num_pages=400, tensor_parallel_size=2,
                     tensor_parallel_timeout=60)
    try:
        got = _run(engine, prompts, digests, params, [i % 3 for i in range(len(prompts))])
        assert got == expected
        assert engine.stats().spec.num_accepted_tokens > 0
    finally:
        engine.close()


class _BrokenProposer:
    """A proposer with a bug: every proposal raises."""

    def new_context(self):
        return None

    def propose(self, contexts, token_lists, ks):
        raise RuntimeError("proposer bug")


def test_a_failing_proposer_never_ends_the_engine(setup):
    """A bug in drafting costs the step its drafts, not the engine or a request."""
    model, _, prompts, _, max_tokens, _ = setup
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    base = [None] * len(prompts)
    off = _run(_engine(model, {}, "off"), prompts, base, params, [0] * len(prompts))
    engine = _engine(model, {}, "ngram")
    assert engine.speculator is not None
    engine.speculator.proposer = _BrokenProposer()
    assert _run(engine, prompts, base, params, [0] * len(prompts)) == off
    assert engine.stats().spec.num_proposed_tokens == 0


@pytest.mark.parametrize("jump_forward", ["off", "exact"])
def test_structured_output_speculates_with_its_matcher(setup, jump_forward):
    """Constrained requests draft too: each verification row gets the grammar's mask after
    the draft prefix before it (the matcher advances through the draft and rolls back).
    Greedy and seeded tokens equal speculation off's, for JSON schemas, regexes and choices
    beside free requests."""
    from tests.engine.test_structured import CHOICES, REGEXES, SCHEMAS

    model, _, prompts, _, _, _ = setup
    specs = ([StructuredOutput("json_schema", json.dumps(s)) for s in SCHEMAS[:4]]
             + [StructuredOutput("regex", r) for r in REGEXES]
             + [StructuredOutput("choice", choices=c) for c in CHOICES] + [None] * 3)
    params = [SamplingParams(max_tokens=40, structured=spec, seed=i,
                             temperature=0.0 if i % 2 else 1.0, top_k=3)
              for i, spec in enumerate(specs)]
    results = {}
    for method in ("ngram", "off"):
        engine = _engine(model, {}, method, num_pages=400, jump_forward=jump_forward)
        results[method] = (_run(engine, [prompts[i % len(prompts)] for i in range(len(specs))],
                                [None] * len(specs), params, [0] * len(specs)), engine.stats())
    assert results["ngram"][0] == results["off"][0]
    if jump_forward == "off":  # forced runs are drafted (the grammar repeats its keys)
        assert results["ngram"][1].spec.num_accepted_tokens > 0
