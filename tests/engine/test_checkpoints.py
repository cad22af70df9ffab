"""Checkpoints are served exactly or refused at load, never served wrong in silence (issue 13,
finding 9): Llama's mlp_bias and attention_bias (o_proj.bias included), hidden_act, and
tensors the model would not use."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.models.config import ModelConfig
from tests.engine.test_parity import run_staggered
from tests.helpers import hf_greedy, make_model, random_prompts


def _engine(model):
    return Engine(EngineConfig(model=str(model), num_pages=64,
                               scheduler=SchedulerConfig(page_size=4)))


@pytest.mark.parametrize("overrides", [
    {"mlp_bias": True, "attention_bias": True},
    {"hidden_act": "gelu_pytorch_tanh"},
    {"hidden_act": "gelu"},
    {"hidden_act": "gelu_new", "mlp_bias": True},
])
def test_biases_and_activations_match_transformers(tmp_path, overrides):
    model = make_model(tmp_path / "m", "llama", seed=5, std=0.2, **overrides)
    names = load_file(str(model / "model.safetensors"))
    if overrides.get("attention_bias"):
        assert "model.layers.0.self_attn.o_proj.bias" in names
    if overrides.get("mlp_bias"):
        assert "model.layers.0.mlp.down_proj.bias" in names
    prompts = random_prompts(2, seed=9, low=6, high=20)
    expected = hf_greedy(model, prompts, 10)
    assert run_staggered(_engine(model), prompts, [10, 10], [0, 2]) == expected


def test_unsupported_hidden_act_is_refused_naming_it(tmp_path):
    model = make_model(tmp_path / "m", "llama")
    cfg = json.loads((model / "config.json").read_text())
    cfg["hidden_act"] = "quick_gelu"
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="^hidden_act: 'quick_gelu' is not supported"):
        _engine(model)


def test_a_tensor_the_model_does_not_use_is_refused_naming_it(tmp_path):
    model = make_model(tmp_path / "m", "llama")
    tensors = load_file(str(model / "model.safetensors"))
    # An o_proj bias in a checkpoint whose config says attention_bias is false: transformers
    # would drop it; serving without it would be wrong in silence.
    tensors["model.layers.1.self_attn.o_proj.bias"] = torch.ones(64)
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.layers.1.self_attn.o_proj.bias' is not used"):
        _engine(model)


def test_qwen2_and_mistral_biases_follow_transformers():
    base = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    qwen = ModelConfig.from_hf_dict(base)
    assert qwen.attention_bias and not qwen.o_proj_bias and not qwen.mlp_bias
    mistral = ModelConfig.from_hf_dict({**base, "architectures": ["MistralForCausalLM"],
                                        "attention_bias": True, "mlp_bias": True})
    assert not mistral.attention_bias and not mistral.mlp_bias
    llama = ModelConfig.from_hf_dict({**base, "architectures": ["LlamaForCausalLM"],
                                      "attention_bias": True, "mlp_bias": True})
    assert llama.o_proj_bias and llama.mlp_bias
