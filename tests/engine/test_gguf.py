"""``--model PATH.gguf``: a GGUF file (tiny, random, written here with the ``gguf`` package) is
converted once into a Hugging Face folder; loraplex's greedy float32 tokens on it equal
transformers' on the same folder, for Llama and Qwen2 (q/k/v biases)."""

from __future__ import annotations

import json
import os

import pytest

from loraplex.server.engine.llm import LLM
from loraplex.server.engine.models.builtin import resolve_model_path
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.request import SamplingParams
from tests.helpers import hf_greedy, write_tiny_gguf

PROMPTS = [[5, 6, 7, 8, 9], [100, 20, 30], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_converts_once_and_matches_transformers(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "cache"))
    # seed 0: no greedy step picks EOS, which transformers' min_new_tokens would mask
    gguf_file = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, seed=0)
    path = resolve_model_path(str(gguf_file))
    config = ModelConfig.from_pretrained(path)
    assert (config.num_layers, config.hidden_size, config.num_kv_heads,
            config.attention_bias) == (2, 64, 2, arch == "qwen2")
    hf = json.loads((tmp_path / "cache" / "gguf" / os.path.basename(path) / "config.json")
                    .read_text())
    assert "quantization_config" not in hf and "_name_or_path" not in hf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    assert tok.decode(tok("hello world")["input_ids"]) == "hello world"
    assert "assistant" in tok.chat_template

    expected = hf_greedy(path, PROMPTS, 6)
    got = LLM(path).generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in got] == expected

    before = os.stat(os.path.join(path, "model.safetensors"))
    assert resolve_model_path(str(gguf_file)) == path
    after = os.stat(os.path.join(path, "model.safetensors"))
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_replaced_gguf_file_is_converted_again(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tmp_path / "model.gguf"
    write_tiny_gguf(gguf_file, seed=1)
    first = resolve_model_path(str(gguf_file))
    tokens_first = LLM(first).generate([PROMPTS[0]], SamplingParams(max_tokens=4))[0].token_ids
    st = gguf_file.stat()
    write_tiny_gguf(gguf_file, seed=2, intermediate=96)  # other weights, another size
    os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = resolve_model_path(str(gguf_file))
    assert second != first
    assert ModelConfig.from_pretrained(second).intermediate_size == 96
    tokens_second = LLM(second).generate([PROMPTS[0]], SamplingParams(max_tokens=4))[0].token_ids
    assert tokens_second != tokens_first


def test_an_unsupported_architecture_is_refused_before_loading(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not one of"):
        resolve_model_path(str(path))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_gateway_reads_a_gguf_config_without_converting(arch, tmp_path, monkeypatch):
    from loraplex.adapter_store.cli import base_model_config

    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    header = base_model_config(str(gguf_file))
    assert not (tmp_path / "cache" / "gguf").exists()  # nothing converted
    converted = ModelConfig.from_pretrained(resolve_model_path(str(gguf_file)))
    assert header.dims_key() == converted.dims_key()
    assert (header.tie_word_embeddings, header.attention_bias) == (
        converted.tie_word_embeddings, converted.attention_bias)
