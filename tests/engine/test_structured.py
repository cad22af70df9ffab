"""Structured output in the engine: every constrained output that finishes with reason stop
parses and validates, in batches mixing adapters, base and free requests, greedy and sampled,
under preemption; exact jump-forward gives the same tokens as decoding without it; a bad
grammar fails its request alone with a ``structured.`` error."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import jsonschema
import pytest

from loraplex.adapter_store.format import load_adapter
from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.models.demo import BOS, _byte_of, write_byte_tokenizer
from loraplex.server.params import SamplingParams, StructuredOutput
from tests.engine.test_lora_parity import LoadedSource
from tests.helpers import ADAPTER_SPECS, assert_pages_idle, make_model, make_peft_adapters

NAME = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                               "maximum": 150}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "tag": NAME},
        "required": ["id", "tag"]}}, "required": ["user"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}},
     "required": ["color", "ok"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -1,
                                                "maximum": 1}, "note": NAME},
     "required": ["score"]},  # "note" optional
    {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "y": {"type": "integer", "minimum": -9, "maximum": 9}}, "required": ["x", "y"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/point"},
                                      "b": {"$ref": "#/$defs/point"}},
     "required": ["a", "b"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
     "minItems": 1, "maxItems": 4},
]
REGEXES = [r"[a-c]{3}-\d{2}", r"(yes|no) [0-9]{1,3}", r"[A-Z][a-z]{0,5}@x\.org"]
CHOICES = [("alpha", "beta", "gamma"), ("ja", "nein", "vielleicht")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    model = make_model(root / "model", "llama", seed=5, max_position_embeddings=1024)
    paths = make_peft_adapters(model, root / "adapters", specs=[ADAPTER_SPECS[1],
                                                                 ADAPTER_SPECS[2]])
    config = ModelConfig.from_pretrained(model)
    adapters = [load_adapter(p, config) for p in paths.values()]
    return model, adapters


def make_engine(model, adapters, num_pages=512, jump_forward="exact", timeout=30.0,
                **config):
    return Engine(EngineConfig(model=str(model), num_pages=num_pages, jump_forward=jump_forward,
                               grammar_compile_timeout=timeout,
                               scheduler=SchedulerConfig(page_size=4), **config),
                  adapter_source=LoadedSource(list(adapters)))


def run(engine, requests, deadline_s=300):
    """requests: (id, prompt, params, digest). Returns id -> (token ids, text, last output)."""
    for rid, prompt, params, digest in requests:
        engine.add_request(rid, prompt, params, adapter_digest=digest)
    got = {rid: ([], []) for rid, *_ in requests}
    final = {}
    deadline = time.monotonic() + deadline_s
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "engine did not finish"
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].append(out.new_text)
            if out.finished:
                final[out.request_id] = out
    return {rid: (tokens, "".join(text), final[rid]) for rid, (tokens, text) in got.items()}


def constraint_mix(adapters, temperature, seed0=0, max_tokens=200):
    """One request per schema, regex and choice, rotating over the adapters and the base
    model, with a free request after every constrained one. Returns the requests and a
    checker per constrained request id."""
    specs = ([StructuredOutput("json_schema", json.dumps(s)) for s in SCHEMAS]
             + [StructuredOutput("regex", r) for r in REGEXES]
             + [StructuredOutput("choice", choices=c) for c in CHOICES])
    digests = [a.digest for a in adapters] + [None]
    requests, checks = [], {}
    for i, spec in enumerate(specs):
        digest = digests[i % len(digests)]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                seed=seed0 + i, structured=spec)
        requests.append((f"c{i}", f"request {i}:", params, digest))
        checks[f"c{i}"] = spec
        requests.append((f"f{i}", f"free {i}", SamplingParams(max_tokens=8), digest))
    return requests, checks


def compile_all(engine, specs, deadline_s=60):
    """Fill the engine's compile cache with ``specs`` (their requests are then ready at
    once, whatever the compile threads' timing)."""
    states = [engine.grammars.submit(spec) for spec in specs]
    deadline = time.monotonic() + deadline_s
    while any(s.compiled is None for s in states):
        assert time.monotonic() < deadline, "grammars did not compile"
        time.sleep(0.01)


def check_valid(spec: StructuredOutput, text: str) -> None:
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(spec.value))
    elif spec.kind == "regex":
        assert re.fullmatch(spec.value, text), (spec.value, text)
    elif spec.kind == "choice":
        assert text in spec.choices, text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_outputs_validate_in_a_mixed_batch(setup, temperature):
    model, adapters = setup
    engine = make_engine(model, adapters)
    requests, checks = constraint_mix(adapters, temperature)
    results = run(engine, requests)
    for rid, spec in checks.items():
        _, text, out = results[rid]
        assert out.finish_reason == "stop", (rid, out.finish_reason, out.error, text)
        check_valid(spec, text)
    for rid, (tokens, _, out) in results.items():
        if rid.startswith("f"):
            assert out.finish_reason in ("stop", "length") and tokens, (rid, out.error)
    assert engine.grammars is not None and engine.grammars.num_jumped_tokens > 0
    assert_pages_idle(engine)


def test_constrained_outputs_validate_under_preemption(setup):
    model, adapters = setup
    requests, checks = constraint_mix(adapters, 0.0, max_tokens=100)
    roomy = run(make_engine(model, adapters), requests)
    engine = make_engine(model, adapters, num_pages=56)  # too few pages for all at once
    compile_all(engine, checks.values())  # all admitted at once: the most pressure
    tight = run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for rid, spec in checks.items():
        tokens, text, out = tight[rid]
        assert out.finish_reason == "stop", (rid, out.error, text)
        check_valid(spec, text)
        assert tokens == roomy[rid][0], rid  # recompute replays through a fresh matcher
    assert_pages_idle(engine)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_exact_jump_forward_gives_the_same_tokens_as_none(setup, temperature):
    model, adapters = setup
    requests, checks = constraint_mix(adapters, temperature, seed0=100)
    jumped_engine = make_engine(model, adapters, jump_forward="exact")
    jumped = run(jumped_engine, requests)
    plain_engine = make_engine(model, adapters, jump_forward="off")
    plain = run(plain_engine, requests)
    for rid in checks:
        assert jumped[rid][0] == plain[rid][0], rid
        assert jumped[rid][2].finish_reason == plain[rid][2].finish_reason == "stop"
    assert jumped_engine.grammars.num_jumped_tokens > 0
    assert plain_engine.grammars.num_jumped_tokens == 0
    # Jumped tokens are computed as chunks: fewer steps for the same tokens.
    assert jumped_engine.stats().num_steps < plain_engine.stats().num_steps


@pytest.mark.parametrize("spec, needle", [
    (StructuredOutput("grammar", 'root ::= ( "a"'), "structured.grammar: does not compile"),
    (StructuredOutput("regex", "[a-"), "structured.regex: does not compile"),
    (StructuredOutput("regex", r"[^\s\S]"), "structured.regex: no token can continue"),
    (StructuredOutput("json_schema", '{"type": "nonsense"}'),
     "structured.json_schema: does not compile"),
])
def test_a_bad_grammar_fails_its_request_alone(setup, spec, needle):
    model, adapters = setup
    engine = make_engine(model, adapters)
    good = StructuredOutput("regex", "[0-9]{4}")
    results = run(engine, [
        ("bad", "x", SamplingParams(max_tokens=20, structured=spec), None),
        ("good", "x", SamplingParams(max_tokens=20, structured=good), adapters[0].digest),
        ("free", "x", SamplingParams(max_tokens=5), None),
    ])
    bad = results["bad"][2]
    assert bad.finish_reason == "error" and bad.error.startswith(needle), bad.error
    assert results["good"][2].finish_reason == "stop"
    assert re.fullmatch("[0-9]{4}", results["good"][1])
    assert results["free"][2].finish_reason == "length"
    assert_pages_idle(engine)


def test_a_compile_over_the_time_limit_fails_alone(setup):
    model, adapters = setup
    engine = make_engine(model, adapters, timeout=0.0)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMAS[0]))
    results = run(engine, [("slow", "x", SamplingParams(max_tokens=50, structured=spec), None),
                           ("free", "x", SamplingParams(max_tokens=5), None)])
    out = results["slow"][2]
    assert out.finish_reason == "error"
    assert "over the limit of 0 s (grammar_compile_timeout)" in out.error, out.error
    assert results["free"][2].finish_reason == "length"


def test_a_compiling_grammar_does_not_block_the_queue_behind_it(setup, monkeypatch):
    model, adapters = setup
    engine = make_engine(model, adapters)
    release = threading.Event()
    compile_spec = engine.grammars._compile_spec

    def held(compiler, spec):  # fault injection: this compile waits until the test lets it go
        release.wait(60)
        return compile_spec(compiler, spec)

    monkeypatch.setattr(engine.grammars, "_compile_spec", held)
    spec = StructuredOutput("regex", "[a-z]{2}")
    engine.add_request("held", "x", SamplingParams(max_tokens=10, structured=spec))
    engine.add_request("free", "y", SamplingParams(max_tokens=4))
    finished: dict[str, object] = {}
    deadline = time.monotonic() + 60
    while "free" not in finished:
        assert time.monotonic() < deadline
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "held" not in finished and engine.scheduler.num_waiting == 1
    release.set()
    while engine.has_unfinished():
        assert time.monotonic() < deadline
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["held"].finish_reason == "stop"


def test_compiled_grammars_are_cached_per_engine(setup):
    model, adapters = setup
    engine = make_engine(model, adapters)
    spec = StructuredOutput("choice", choices=("on", "off"))
    for i in range(3):
        results = run(engine, [(f"r{i}", "x", SamplingParams(max_tokens=5, structured=spec),
                                None)])
        assert results[f"r{i}"][1] in ("on", "off")
    assert engine.grammars.num_compiles == 1
    assert engine.grammars.cache.hits == 2


@pytest.mark.parametrize("kwargs, needle", [
    (dict(kind="json_schema", value="{" * 10 + "}" * 10), "not valid JSON"),
    (dict(kind="json_schema", value=json.dumps({"a": [[[[[[[[[[{"b": [[[[[[[[[[[[[[[[[[[[[[[[
        ]]]]]]]]]]]]]]]]]]]]]]]]}]]]]]]]]]]})), "nested deeper than 32"),
    (dict(kind="regex", value="a" * (65 << 10)), "over the limit of 65536"),
    (dict(kind="choice", choices=()), "1..256 non-empty strings"),
    (dict(kind="xml", value="<a/>"), "is not one of"),
    (dict(kind="json_object", value="{}"), "takes no value"),
])
def test_oversized_or_malformed_constraints_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        StructuredOutput(**kwargs)


def test_sampled_outputs_are_well_formed_utf8(setup):
    """xgrammar alone admits byte tokens that are not UTF-8 (overlong forms, surrogates),
    which decode to U+FFFD; the UTF-8 filter keeps every constrained output well-formed."""
    model, adapters = setup
    engine = make_engine(model, adapters)
    specs = [StructuredOutput("regex", "[^a]{6}"),
             StructuredOutput("json_schema", json.dumps({"type": "string", "maxLength": 6}))]
    requests = [(f"r{i}", "x", SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                                              structured=specs[i % 2]), None)
                for i in range(40)]
    results = run(engine, requests)
    for tokens, text, out in results.values():
        assert out.finish_reason == "stop", out.error
        assert "\ufffd" not in text, (text, tokens)
        assert all(t < 256 for t in tokens[:-1]), tokens  # bytes only, then the stop token
        assert bytes(tokens[:-1]).decode("utf-8") == text
    texts = [results[f"r{i}"][1] for i in range(0, 40, 2)]
    assert [t for t in texts if not re.fullmatch("[^a]{6}", t, re.DOTALL)] == []
    assert any(max(t.encode()) >= 0x80 for t in texts)  # multi-byte characters were drawn


def write_merging_tokenizer(path: Path) -> None:
    """The byte-level tokenizer plus BPE merges of JSON punctuation (``{"``, ``":``, `` "``,
    ``",``), so that a forced string has several valid first tokens, as in a real BPE
    vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    write_byte_tokenizer(path)  # the config files; tokenizer.json is replaced below
    chars = sorted(ByteLevel.alphabet(), key=_byte_of)
    vocab = {ch: i for i, ch in enumerate(chars)}
    specials = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    vocab.update({s: BOS + i for i, s in enumerate(specials)})
    merges = [("{", '"'), ('"', ":"), ("Ġ", '"'), ('"', ",")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)])
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def merging_model(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("bpe") / "model", "llama", seed=9,
                      max_position_embeddings=1024)
    write_merging_tokenizer(path)
    return path


def test_string_jump_forward_outputs_validate(setup, merging_model):
    _, adapters = setup  # adapters fit any model of this shape
    engines = {mode: make_engine(merging_model, adapters, jump_forward=mode)
               for mode in ("string", "exact", "off")}
    merged = set(range(261, 265))
    results = {}
    for mode, engine in engines.items():
        for temperature in (0.0, 1.0):
            requests, checks = constraint_mix(adapters, temperature, seed0=7)
            got = run(engine, requests)
            results[mode, temperature] = got
            for rid, spec in checks.items():
                _, text, out = got[rid]
                assert out.finish_reason == "stop", (mode, rid, out.error, text)
                check_valid(spec, text)
    jumped = {mode: e.grammars.num_jumped_tokens for mode, e in engines.items()}
    assert jumped["string"] > jumped["exact"] > jumped["off"] == 0, jumped
    # Exact mode stays identical to no jump-forward with merges in the vocabulary; string
    # mode cuts forced strings its own way (merged tokens where the model chose others).
    exact, off, string = (results[m, 0.0] for m in ("exact", "off", "string"))
    assert all(exact[r][0] == off[r][0] for r in exact)
    assert any(string[r][0] != off[r][0] for r in string)
    assert any(merged & set(tokens) for tokens, _, _ in string.values())


def test_prefix_cache_hits_keep_constrained_outputs(setup):
    model, adapters = setup
    engine = make_engine(model, adapters)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMAS[1]))
    prompt = "a shared system prompt that fills several pages of four tokens each: "
    outputs = []
    for i in range(3):
        got = run(engine, [(f"p{i}", prompt, SamplingParams(max_tokens=200, structured=spec),
                            adapters[1].digest)])
        outputs.append(got[f"p{i}"])
    assert outputs[0][2].num_cached_tokens == 0
    assert all(o[2].num_cached_tokens > 0 for o in outputs[1:])
    assert all(o[0] == outputs[0][0] and o[2].finish_reason == "stop" for o in outputs)
    jsonschema.validate(json.loads(outputs[0][1]), SCHEMAS[1])


def test_a_matcher_that_fails_fails_its_request_alone(setup):
    model, adapters = setup
    engine = make_engine(model, adapters)
    spec = StructuredOutput("regex", "[a-z]{3}")
    engine.add_request("bad", "x", SamplingParams(max_tokens=10, structured=spec))
    engine.add_request("good", "y", SamplingParams(max_tokens=10, structured=spec))
    bad = engine.sequences("bad")[0]

    def broken(req, bitmask, row):  # fault injection: this request's matcher raises
        raise RuntimeError("matcher exploded")

    deadline = time.monotonic() + 60
    while bad.grammar is None or bad.grammar.compiled is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    bad.grammar.fill = broken
    finished = {}
    while engine.has_unfinished():
        assert time.monotonic() < deadline
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["bad"].finish_reason == "error"
    assert "matcher exploded" in finished["bad"].error
    assert finished["good"].finish_reason == "stop"
    assert_pages_idle(engine)
