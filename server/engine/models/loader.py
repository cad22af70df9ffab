"""Load a Hugging Face model directory (config.json + safetensors, sharded with an index)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.models.llama import LayerWeights, LlamaModel

logger = logging.getLogger(__name__)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [path / s for s in shards]
    elif (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found {pickled}: pickle checkpoints are never loaded)" if pickled else ""
        raise ValueError(f"{path}: no safetensors weights{hint}")
    for f in files:
        if f.parent.resolve() != path.resolve() or f.name.startswith(("/", "..")):
            raise ValueError(f"{path}: shard {f.name!r} points outside the model directory")
    return files


def load_weights(path: str | Path, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> LlamaModel:
    """Read every tensor the model needs, cast to ``dtype`` and fuse q/k/v and gate/up."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"{path}: weight {name!r} is missing")
        return tensors.pop(name).to(device=device, dtype=dtype)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([take(p + f"self_attn.{m}.weight") for m in ("q_proj", "k_proj",
                                                                    "v_proj")])
        bias = None
        if config.attention_bias:
            bias = torch.cat([take(p + f"self_attn.{m}.bias") for m in ("q_proj", "k_proj",
                                                                       "v_proj")])
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=qkv,
            qkv_bias=bias,
            o=take(p + "self_attn.o_proj.weight"),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
            down=take(p + "mlp.down_proj.weight"),
        ))
    embed = take("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else take("lm_head.weight")
    norm = take("model.norm.weight")
    leftover = [n for n in tensors if "rotary_emb" not in n]
    if leftover:
        logger.warning("%s: %d unused weights, e.g. %s", path, len(leftover), leftover[:3])
    return LlamaModel(config, embed, layers, norm, lm_head)


def model_revision(path: str | Path) -> str:
    """The base model's identity for cache keys: sha256 of config.json and every weight file's
    bytes (never its path, so two copies agree and a changed checkpoint never does)."""
    path = Path(path)
    h = hashlib.sha256()
    for file in [path / "config.json", *_weight_files(path)]:
        h.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()
