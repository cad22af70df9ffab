"""Jump-forward before a request's first model call: what its grammar forces at the start is
appended at once and computed with the prompt's prefill (exact mode: the same tokens as
without jump-forward; string mode: the forced string as the tokenizer cuts it)."""

from __future__ import annotations

import json
import re

import jsonschema

from loraplex.server.params import SamplingParams, StructuredOutput
from tests.engine.test_structured import make_engine, run
from tests.engine.test_structured import merging_model as merging_model  # noqa: F401
from tests.engine.test_structured import setup as setup  # noqa: F401  (the fixtures)
from tests.helpers import assert_pages_idle


def test_a_fully_forced_output_needs_one_model_step(setup):  # noqa: F811
    model, adapters = setup
    engine = make_engine(model, adapters)
    spec = StructuredOutput("choice", choices=("alpha",))
    results = run(engine, [("one", "x", SamplingParams(max_tokens=20, structured=spec), None)])
    tokens, text, out = results["one"]
    assert (text, out.finish_reason) == ("alpha", "stop")
    # The grammar wrote it all before the model ran: one step computes it with the prompt
    # and samples the stop token (two of them end the text: the model picks one).
    assert engine.stats().num_steps == 1
    assert_pages_idle(engine)


def test_the_forced_start_is_computed_with_the_prompt(setup):  # noqa: F811
    model, adapters = setup
    engine = make_engine(model, adapters)
    spec = StructuredOutput("regex", r"abc[0-9]{2}")
    engine.add_request("r", "prompt", SamplingParams(max_tokens=20, structured=spec))
    req = engine.sequences("r")[0]
    first = []
    while not first:  # the steps until the grammar has compiled produce nothing
        first = engine.step()
    # The forced start is out before the model ran, and the step's prefill computed it with
    # the prompt (without the start jump: the prompt alone, then "a" sampled, "bc" jumped).
    assert first[0].new_text == "abc"
    assert req.num_computed_tokens == req.num_prompt_tokens + 3
    text = "".join(o.new_text for o in first)
    while engine.has_unfinished():
        text += "".join(o.new_text for o in engine.step())
    assert re.fullmatch(r"abc[0-9]{2}", text), text
    assert engine.grammars is not None and engine.grammars.num_jumped_tokens >= 3


def test_string_mode_jumps_the_opening_of_an_object(setup, merging_model):  # noqa: F811
    _, adapters = setup
    engine = make_engine(merging_model, adapters, jump_forward="string")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}},
              "required": ["city"]}
    spec = StructuredOutput("json_schema", json.dumps(schema))
    requests = [(f"r{i}", f"p{i}", SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                                                  structured=spec), None) for i in range(4)]
    results = run(engine, requests)
    tokenizer = engine.tokenizer.for_this_thread()
    opening = tokenizer.encode('{"city": "', add_special_tokens=False)
    for tokens, text, out in results.values():
        assert out.finish_reason == "stop", out.error
        jsonschema.validate(json.loads(text), schema)
        assert tokens[:len(opening)] == opening  # the tokenizer's own cut: `{"` merged
    assert_pages_idle(engine)


def test_a_forced_start_longer_than_max_tokens_ends_with_length(setup):  # noqa: F811
    model, adapters = setup
    engine = make_engine(model, adapters)
    spec = StructuredOutput("choice", choices=("alpha",))
    results = run(engine, [("short", "x", SamplingParams(max_tokens=2, structured=spec), None)])
    tokens, text, out = results["short"]
    assert (text, out.finish_reason, len(tokens)) == ("al", "length", 2)
    assert engine.stats().num_steps == 0  # ended before it was ever scheduled
    assert_pages_idle(engine)
