"""``--model demo``: a small deterministic random-weight Llama with a byte-level tokenizer
and a minimal ChatML chat template, built once into the cache directory (like vLLM's dummy
weights; no network)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from loraplex.server import env
from loraplex.server.engine.models.config import ModelConfig

DEMO_VERSION = 2  # bumped whenever what is built changes: cached copies are then rebuilt
NUM_BYTE_TOKENS = 256
BOS, EOS, PAD = 256, 257, 258
IM_START, IM_END = 259, 260  # ChatML's turn markers
# ChatML, as Qwen2 and SmolLM2 use it, without a default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def llama_hf_config(*, vocab_size: int, hidden_size: int, intermediate_size: int,
                    num_hidden_layers: int, num_attention_heads: int, num_key_value_heads: int,
                    head_dim: int, max_position_embeddings: int = 2048,
                    attention_bias: bool | None = None, torch_dtype: str = "float32"
                    ) -> dict[str, Any]:
    """The ``config.json`` of a random Llama with the byte tokenizer's special tokens: the
    demo model's, the benchmarks' and the tests' (they differ only in these sizes).
    ``attention_bias`` None leaves the key out (transformers' default, False)."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    if attention_bias is not None:
        cfg["attention_bias"] = attention_bias
    cfg.update({"hidden_act": "silu", "bos_token_id": BOS, "eos_token_id": EOS,
                "pad_token_id": PAD, "torch_dtype": torch_dtype})
    return cfg


DEMO_HF_CONFIG = llama_hf_config(vocab_size=320, hidden_size=256, intermediate_size=688,
                                 num_hidden_layers=4, num_attention_heads=8,
                                 num_key_value_heads=4, head_dim=32, attention_bias=False)


def demo_model_config() -> ModelConfig:
    """The demo model's ``ModelConfig`` (without building its weights)."""
    return ModelConfig.from_hf_dict(DEMO_HF_CONFIG)


def demo_model_path() -> Path:
    """Build the demo model on first use; return its directory."""
    path = env.cache_dir() / f"demo-llama-v{DEMO_VERSION}"
    if (path / "model.safetensors").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=path.parent))
    try:
        write_random_llama(tmp, DEMO_HF_CONFIG, seed=0)
        write_byte_tokenizer(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process built it first
            if not (path / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def write_random_llama(path: Path, hf_config: dict, seed: int, std: float = 0.08) -> None:
    """Write ``config.json`` and deterministic random ``model.safetensors`` for a Llama-family
    config (used by the demo model, tests and benchmarks)."""
    cfg = ModelConfig.from_hf_dict(hf_config)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    h, i = cfg.hidden_size, cfg.intermediate_size
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(cfg.vocab_size, h)}
    shapes = cfg.module_shapes()
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            d_in, d_out = shapes[m]
            tensors[p + f"self_attn.{m}.weight"] = rand(d_out, d_in)
            if cfg.attention_bias and (m != "o_proj" or cfg.o_proj_bias):
                tensors[p + f"self_attn.{m}.bias"] = rand(d_out)
        tensors[p + "mlp.gate_proj.weight"] = rand(i, h)
        tensors[p + "mlp.up_proj.weight"] = rand(i, h)
        tensors[p + "mlp.down_proj.weight"] = rand(h, i)
        if cfg.mlp_bias:
            for m, d_out in (("gate_proj", i), ("up_proj", i), ("down_proj", h)):
                tensors[p + f"mlp.{m}.bias"] = rand(d_out)
        tensors[p + "input_layernorm.weight"] = 1.0 + rand(h)
        tensors[p + "post_attention_layernorm.weight"] = 1.0 + rand(h)
    tensors["model.norm.weight"] = 1.0 + rand(h)
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = rand(cfg.vocab_size, h)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    with open(path / "config.json", "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=2)


def write_byte_tokenizer(path: Path, chat_template: bool = True) -> None:
    """A byte-level tokenizer: ids 0..255 are bytes, then ``<s>``, ``</s>``, ``<pad>``,
    ``<|im_start|>``, ``<|im_end|>``; with ``chat_template``, the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {ch: idx for idx, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)])
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "pad_token": "<pad>", "model_max_length": 2048}
    if chat_template:
        config["chat_template"] = CHATML_TEMPLATE
    with open(path / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f)
    with open(path / "generation_config.json", "w", encoding="utf-8") as f:
        json.dump({"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}, f)


def _byte_of(ch: str) -> int:
    # GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to 256+.
    code = ord(ch)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
