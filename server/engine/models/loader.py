"""Load a Hugging Face model directory (config.json + safetensors, sharded with an index)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.models.llama import LayerWeights, LlamaModel


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
    return LlamaModel(config, *load_tensors(path, config, dtype, device))


def load_tensors(path: str | Path, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str = "cpu",
                 layer_fn: Callable[[LayerWeights], LayerWeights] | None = None,
                 ) -> tuple[torch.Tensor, list[LayerWeights], torch.Tensor, torch.Tensor]:
    """``load_weights``'s dense tensors before the model packs them: ``(embed, layers, norm,
    lm_head)``. Tensors are read as they are needed, and each layer goes through
    ``layer_fn`` as soon as it is read (a tensor-parallel rank keeps only its shard: its peak
    memory is its shard plus one whole layer, not the whole checkpoint)."""
    path = Path(path)
    with ExitStack() as files:
        tensors: dict[str, Any] = {}  # name -> the open file holding it
        for file in _weight_files(path):
            f = files.enter_context(safe_open(str(file), framework="pt"))
            for name in f.keys():
                tensors[name] = f
        return _load(path, config, tensors, dtype, device, layer_fn)


def _load(path: Path, config: ModelConfig, tensors: dict[str, Any], dtype: torch.dtype,
          device: torch.device | str, layer_fn: Callable[[LayerWeights], LayerWeights] | None
          ) -> tuple[torch.Tensor, list[LayerWeights], torch.Tensor, torch.Tensor]:
    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"{path}: weight {name!r} is missing")
        return tensors.pop(name).get_tensor(name).to(device=device, dtype=dtype)

    def take_cat(names: list[str]) -> torch.Tensor:
        return torch.cat([take(n) for n in names])

    layers: list[LayerWeights] = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = [p + f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj")]
        mlp = [p + f"mlp.{m}" for m in ("gate_proj", "up_proj")]
        layer = LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=take_cat([n + ".weight" for n in attn]),
            qkv_bias=take_cat([n + ".bias" for n in attn]) if config.attention_bias else None,
            o=take(p + "self_attn.o_proj.weight"),
            o_bias=take(p + "self_attn.o_proj.bias") if config.o_proj_bias else None,
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=take_cat([n + ".weight" for n in mlp]),
            gate_up_bias=take_cat([n + ".bias" for n in mlp]) if config.mlp_bias else None,
            down=take(p + "mlp.down_proj.weight"),
            down_bias=take(p + "mlp.down_proj.bias") if config.mlp_bias else None,
        )
        layers.append(layer_fn(layer) if layer_fn is not None else layer)
    embed = take("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else take("lm_head.weight")
    if config.tie_word_embeddings and "lm_head.weight" in tensors:
        # Tied: transformers uses the embedding; a copy of it is harmless, anything else not.
        if not torch.equal(take("lm_head.weight"), embed):
            raise ValueError(f"{path}: weight 'lm_head.weight' differs from the embedding, but "
                             "tie_word_embeddings is true")
    norm = take("model.norm.weight")
    # rotary_emb.inv_freq buffers (older checkpoints) are derived from the config; anything
    # else left over is a weight the model would silently not apply.
    leftover = sorted(n for n in tensors if not n.endswith("rotary_emb.inv_freq"))
    if leftover:
        more = f" and {len(leftover) - 3} more" if len(leftover) > 3 else ""
        raise ValueError(f"{path}: checkpoint tensor {leftover[0]!r} is not used by this "
                         f"{config.architecture} model (unused: {', '.join(leftover[:3])}{more});"
                         " refusing to serve it wrong")
    return embed, layers, norm, lm_head


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
