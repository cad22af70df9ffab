"""String jump-forward re-cuts the boundary as SGLang does: the last sampled token, not yet sent,
is taken back and cut together with the forced string as the tokenizer cuts their text (``"``
then ``, "key": "`` becomes ``",`` `` "`` ...). Outputs still validate (mixed batches with
adapters, preemption, n > 1), and no token the client saw is ever taken back: the streamed
tokens are the request's final tokens, the streamed text their text."""

from __future__ import annotations

import time

import pytest
import torch
import xgrammar as xgr

from loraplex.server.params import SamplingParams, StructuredOutput
from tests.engine.test_structured import (
    check_valid,
    compile_all,
    constraint_mix,
    make_engine,
)
from tests.engine.test_structured import merging_model as merging_model  # noqa: F401
from tests.engine.test_structured import setup as setup  # noqa: F401  (the fixtures)
from tests.engine.test_structured_n import SPECS, N, the_mix
from tests.helpers import assert_pages_idle

QUOTE = 34  # the byte-level demo tokenizer: token id = byte
# After a sampled `"`, the grammar forces the rest: the boundary the re-cut is about.
BOUNDARY_REGEX = r'[ab]{0,3}", "key": "z"'
BOUNDARY_TEXT = '", "key": "z"'


def boundary_requests(adapters, temperature, n=1, bias=100.0, seed0=0):
    """Requests whose model is pushed to sample `"` alone where the merged `",` would do
    (a random model seldom stops a string itself), one per adapter and the base model: each
    has a boundary to re-cut."""
    spec = StructuredOutput("regex", BOUNDARY_REGEX)
    digests = [a.digest for a in adapters] + [None]
    return [(f"b{i}", f"boundary {i}", SamplingParams(
        max_tokens=40, temperature=temperature, seed=seed0 + i, n=n, structured=spec,
        logit_bias=((QUOTE, bias),)), digest) for i, digest in enumerate(digests)]


def run_streamed(engine, requests, deadline_s=300):
    """Like ``test_structured.run``, per sequence, and checks what streaming needs: the tokens
    streamed are the sequence's final tokens (none taken back after it was sent) and, for a
    constrained one that stopped (well-formed UTF-8), the text streamed is their text.
    Returns (id, index) -> (tokens, text, last output)."""
    seqs = {}
    for rid, prompt, params, digest in requests:
        engine.add_request(rid, prompt, params, adapter_digest=digest)
        seqs.update({(rid, s.index): s for s in engine.sequences(rid)})
    got: dict[tuple[str, int], tuple[list[int], list[str]]] = {k: ([], []) for k in seqs}
    final = {}
    deadline = time.monotonic() + deadline_s
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "engine did not finish"
        for out in engine.step():
            tokens, texts = got[out.request_id, out.index]
            tokens.extend(out.new_token_ids)
            texts.append(out.new_text)
            if out.finished:
                final[out.request_id, out.index] = out
    tokenizer = engine.tokenizer
    results = {}
    for key, (tokens, texts) in got.items():
        text = "".join(texts)
        assert tokens == seqs[key].output_token_ids, key
        if seqs[key].grammar is not None and final[key].finish_reason == "stop":
            assert text == tokenizer.decode(tokens), (key, text)
        results[key] = (tokens, text, final[key])
    return results


@pytest.mark.parametrize("stop", [(), ("zz!",)])
def test_string_mode_recuts_the_sampled_token_with_the_forced_string(setup, merging_model,  # noqa: F811
                                                                     stop):
    _, adapters = setup
    engine = make_engine(merging_model, adapters, jump_forward="string")
    # The bias makes the model sample `"` alone (not the merged `",`); the grammar then
    # forces `, "key": "z"`, which cut alone starts with `,`. A stop string (never matched)
    # makes the detokenizer hold text back: the take-back restores what it held too.
    params = SamplingParams(max_tokens=40, structured=StructuredOutput("regex", BOUNDARY_REGEX),
                            logit_bias=((QUOTE, 100.0),), stop=stop)
    results = run_streamed(engine, [("r", "prompt", params, adapters[0].digest)])
    tokens, text, out = results["r", 0]
    assert (text, out.finish_reason) == (BOUNDARY_TEXT, "stop"), out.error
    hf = engine.tokenizer.for_this_thread()
    recut = hf.encode(BOUNDARY_TEXT, add_special_tokens=False)
    alone = [QUOTE] + hf.encode(BOUNDARY_TEXT[1:], add_special_tokens=False)
    assert recut != alone  # the merging vocabulary cuts `",` together
    assert tokens[:-1] == recut  # the tokenizer's own cut, then the stop token
    assert engine.grammars.num_retokenized == 1
    assert engine.stats().jump_forward_retokenized == 1
    # The taken-back `"` is not counted as jumped: every token but the re-cut's first.
    assert engine.grammars.num_jumped_tokens == len(recut) - 1
    assert_pages_idle(engine)


def test_recut_outputs_validate_in_mixed_batches(setup, merging_model):  # noqa: F811
    _, adapters = setup
    engine = make_engine(merging_model, adapters, jump_forward="string")
    for temperature in (0.0, 1.0):
        requests, checks = constraint_mix(adapters, temperature, seed0=11)
        boundary = boundary_requests(adapters, temperature, bias=3.0)
        checks.update({rid: params.structured for rid, _, params, _ in boundary})
        results = run_streamed(engine, requests + boundary)
        for rid, spec in checks.items():
            _, text, out = results[rid, 0]
            assert out.finish_reason == "stop", (temperature, rid, out.error, text)
            check_valid(spec, text)
        assert all(results[r, 0][2].finish_reason in ("stop", "length") for r, *_ in requests)
    assert engine.grammars.num_retokenized > 0
    assert_pages_idle(engine)


def test_recut_outputs_validate_under_preemption(setup, merging_model):  # noqa: F811
    _, adapters = setup
    requests, checks = constraint_mix(adapters, 0.0, max_tokens=100)
    requests += boundary_requests(adapters, 0.0)
    checks.update({rid: params.structured for rid, _, params, _ in requests[-3:]})
    roomy_engine = make_engine(merging_model, adapters, jump_forward="string")
    roomy = run_streamed(roomy_engine, requests)
    engine = make_engine(merging_model, adapters, num_pages=56, jump_forward="string")
    compile_all(engine, checks.values())  # all admitted at once: the most pressure
    tight = run_streamed(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for rid, spec in checks.items():
        tokens, text, out = tight[rid, 0]
        assert out.finish_reason == "stop", (rid, out.error, text)
        check_valid(spec, text)
        # A re-cut token list replays through a fresh matcher like any other.
        assert tokens == roomy[rid, 0][0], rid
    assert engine.grammars.num_retokenized > 0
    assert engine.grammars.num_retokenized == roomy_engine.grammars.num_retokenized
    assert_pages_idle(engine)


def test_recut_with_n_sequences_each_on_its_own(setup, merging_model):  # noqa: F811
    _, adapters = setup
    engine = make_engine(merging_model, adapters, jump_forward="string")
    requests = the_mix(adapters, 1.0, N, seed0=30) + boundary_requests(adapters, 1.0, n=N,
                                                                       bias=2.0)
    results = run_streamed(engine, requests)
    specs = {f"c{i}": spec for i, spec in enumerate(SPECS)}
    specs.update({rid: params.structured for rid, _, params, _ in requests[-3:]})
    for rid, spec in specs.items():
        texts = set()
        for index in range(N):
            _, text, out = results[rid, index]
            assert out.finish_reason == "stop", (rid, index, out.error, text)
            check_valid(spec, text)
            texts.add(text)
        if rid.startswith("b"):
            assert len(texts) > 1, texts  # sequences sampled (and re-cut) apart
    assert engine.grammars.num_retokenized > 0
    assert_pages_idle(engine)


def test_a_recut_the_grammar_refuses_changes_nothing(setup, merging_model):  # noqa: F811
    _, adapters = setup
    engine = make_engine(merging_model, adapters, jump_forward="string")
    engine.add_request("r", "x", SamplingParams(max_tokens=40, structured=StructuredOutput(
        "regex", BOUNDARY_REGEX)))
    req = engine.sequences("r")[0]
    deadline = time.monotonic() + 60
    while req.grammar is None or req.grammar.compiled is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    grammar, vocab = req.grammar, engine.model_config.vocab_size

    def allowed():
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        grammar.fill(req, bitmask, 0)
        return bitmask.clone()

    req.output_token_ids.append(ord("a"))
    assert not grammar.accept(req, ord("a"))
    before = allowed()
    assert not grammar.take_back(req, [ord("c")])  # `c` is no re-cut of anything here
    assert torch.equal(allowed(), before)  # matcher and UTF-8 state as they were
    assert grammar.take_back(req, [ord("b"), QUOTE])  # `b"` may stand in for `a`
    assert not grammar.take_back(req, [ord("b")])  # once per accepted token
    req.output_token_ids.pop()  # what the output processor does next
    for token in (ord("b"), QUOTE):
        req.output_token_ids.append(token)
        assert not grammar.accept(req, token)
    assert grammar.forced_string(req) == ', "key": "z"'
    engine.abort("r")
    engine.step()
    assert_pages_idle(engine)


def test_recut_with_speculation(setup, merging_model):  # noqa: F811
    """Speculation on: re-cuts beside drafts and verifications keep outputs valid (a verified
    draft's last token, the target's own, is not computed yet and may be re-cut; the n-gram
    index never saw it: it indexes at proposal time, before the step appends)."""
    _, adapters = setup
    engine = make_engine(merging_model, adapters, jump_forward="string",
                         speculative_method="ngram", speculative_cost_gate=False)
    requests, checks = constraint_mix(adapters, 0.0, seed0=21)
    boundary = boundary_requests(adapters, 0.0)
    checks.update({rid: params.structured for rid, _, params, _ in boundary})
    results = run_streamed(engine, requests + boundary)
    for rid, spec in checks.items():
        _, text, out = results[rid, 0]
        assert out.finish_reason == "stop", (rid, out.error, text)
        check_valid(spec, text)
    assert engine.grammars.num_retokenized > 0
    assert engine.stats().spec.num_proposed_tokens > 0
    assert_pages_idle(engine)
