"""The base model's shape, read from a Hugging Face ``config.json`` (never from code)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# The Llama family's linear layers, in canonical order (the order adapters are laid out in).
LORA_MODULES: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# transformers' ACT2FN names the model serves exactly (llama.py ACTIVATIONS implements them).
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map ``"float32" | "bfloat16" | "float16"`` (or a torch dtype) to a torch dtype."""
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ValueError(f"dtype: {name} is not one of {sorted(_DTYPES)}")
        return name
    key = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
           "float": "float32"}.get(name, name)
    if key not in _DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True)
class ModelConfig:
    """What the engine, the adapter validator and the kernels need to know of a base model."""

    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # sorted items of the HF dict
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (and o_proj's in Llama, see o_proj_bias)
    mlp_bias: bool = False  # gate/up/down biases (Llama)
    hidden_act: str = "silu"  # the MLP's activation, one of SUPPORTED_ACTIVATIONS
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    hf_config: tuple[tuple[str, Any], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(f"architecture: {self.architecture!r} is not supported")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act: {self.hidden_act!r} is not supported (supported: "
                             f"{', '.join(SUPPORTED_ACTIVATIONS)})")
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @property
    def o_proj_bias(self) -> bool:
        """Llama's ``attention_bias`` covers o_proj too; Qwen2's q/k/v biases do not."""
        return self.attention_bias and self.architecture == "llama"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """``(d_in, d_out)`` of every LoRA-targetable linear layer, by module name."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def dims_key(self) -> dict[str, int]:
        """The base-model dimensions an adapter's identity depends on."""
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
        }

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``; unsupported models raise ``ValueError``."""
        archs = cfg.get("architectures") or []
        arch: str | None = next(
            (SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = cfg.get("model_type")
            if isinstance(model_type, str) and model_type in SUPPORTED_ARCHITECTURES.values():
                arch = model_type
            else:
                raise ValueError(f"config.json: architectures {archs} / model_type "
                                 f"{model_type!r} are not supported (Llama, Mistral, Qwen2)")
        if cfg.get("auto_map"):
            raise ValueError("config.json: auto_map (remote code) is not allowed")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rope = {k: v for k, v in rope.items() if v is not None}
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.pop("type", None)
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        if rope.get("rope_type", "default") == "default":
            rope = {}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        window = cfg.get("sliding_window")
        if arch == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=tuple(sorted((k, _freeze(v)) for k, v in rope.items())),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # As transformers builds each architecture: Qwen2 always has q/k/v biases,
            # Mistral none, Llama what its config says.
            attention_bias=(arch == "qwen2"
                            or (arch == "llama" and bool(cfg.get("attention_bias", False)))),
            mlp_bias=arch == "llama" and bool(cfg.get("mlp_bias", False)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=int(window) if window else None,
            hf_config=tuple(sorted((k, _freeze(v)) for k, v in cfg.items())),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``<path>/config.json``; ``ValueError`` naming ``path`` when there is none."""
        config = Path(path) / "config.json"
        if not config.is_file():
            what = "has no config.json" if Path(path).exists() else "does not exist"
            raise ValueError(f"model: {path} {what} (give a Hugging Face model directory, or "
                             "--model demo)")
        with open(config, encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f))


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"config.json: non-finite value {value}")
    return value
