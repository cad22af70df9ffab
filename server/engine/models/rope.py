"""Rotary position embeddings, computed as Hugging Face computes them (float32 angles, then
cast), for the rope_scaling types we serve: default, linear and llama3."""

from __future__ import annotations

import math

import torch

from loraplex.kernels import cpu_elementwise
from loraplex.server.engine.models.config import ModelConfig


def inv_frequencies(config: ModelConfig) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies after rope scaling."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling_dict
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables by position; ``apply`` rotates q and k in place of HF's rotate_half."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.inv_freq = inv_frequencies(config).to(device)  # [head_dim // 2] float32
        self.dtype = dtype

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` -> cos, sin ``[T, head_dim]`` in the model dtype."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def apply_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The q and k heads of a fused ``qkv [T, (num_heads + 2 * num_kv_heads) * head_dim]``,
        rotated: ``q [T, num_heads, head_dim]``, ``k [T, num_kv_heads, head_dim]`` (new tensors,
        ``qkv`` unchanged); ``cos``/``sin [T, head_dim]`` from ``cos_sin``.

        One native call for both (``loraplex/kernels/cpu_elementwise.rope_qk``, the same roundings
        as ``apply``) on contiguous CPU float32/bf16 tensors; ``apply`` on each otherwise.
        """
        if cpu_elementwise.usable(qkv, cos, sin):
            return cpu_elementwise.rope_qk(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
        num_tokens, q_size = qkv.shape[0], num_heads * head_dim
        q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
        k = qkv[:, q_size:q_size + num_kv_heads * head_dim].view(num_tokens, num_kv_heads,
                                                                 head_dim)
        return self.apply(q, cos, sin), self.apply(k, cos, sin)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, head_dim]`` by the per-token ``cos``/``sin [T, head_dim]``.

        HF's ``x * cos + rotate_half(x) * sin`` with the same roundings, bit for bit:
        ``rotate_half(x) = cat(-x2, x1)`` and both halves of the tables are equal, so the
        first half is ``x1 * c - x2 * s`` and the second ``x2 * c + x1 * s``; written so
        without the negated copy and the concatenation (25-30% less time in float32).
        """
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        s = sin[:, None, :half]
        out = x * cos[:, None, :]
        tmp = x2 * s
        out[..., :half].sub_(tmp)
        torch.mul(x1, s, out=tmp)
        out[..., half:].add_(tmp)
        return out
