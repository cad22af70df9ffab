"""The Llama family (Llama, Mistral, Qwen2): RMSNorm, RoPE, GQA attention over paged KV, SwiGLU.

The model works on the step's flattened tokens ``[T, hidden]``: prefill chunks and decodes of
many requests run in one forward pass. q/k/v and gate/up weights are fused at load so a layer
is four matrix multiplies; LoRA deltas are added to the fused outputs slice by slice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_elementwise, cpu_gemm
from loraplex.kernels.metadata import AttentionMetadata
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.models.rope import RotaryEmbedding

logger = logging.getLogger(__name__)


class LoraHook(Protocol):
    """Adds the batch's adapter deltas to a fused projection's output in place."""

    def __call__(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None: ...


@dataclass
class ForwardContext:
    """What one forward pass needs besides the tokens: KV pages and the kernels to use."""

    attn: AttentionMetadata
    kv_pools: torch.Tensor  # [num_layers, num_pages, page_elems]
    page_size: int
    write_kv: Callable[..., None]
    attention: Callable[..., torch.Tensor]
    lora: LoraHook | None = None
    # Tensor parallelism: sums a row-parallel layer's partial output over the ranks, in place
    # (after its LoRA delta, which is partial too: parallel/sharding.py).
    all_reduce: Callable[[torch.Tensor], None] | None = None


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    o: torch.Tensor  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    o_bias: torch.Tensor | None = None  # [hidden] (Llama with attention_bias)
    gate_up_bias: torch.Tensor | None = None  # [2 * intermediate] (mlp_bias)
    down_bias: torch.Tensor | None = None  # [hidden] (mlp_bias)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # transformers' NewGELUActivation, written as it writes it (not F.gelu's tanh kernel).
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


# The MLP activations by transformers' ACT2FN name (config.SUPPORTED_ACTIVATIONS).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "relu": F.relu,
}


# Calls of up to this many rows run on the decode copy where a bf16 model keeps one
# (``LlamaModel.decode_tiles``), by its kind. Against oneDNN's prepacked bf16 GEMM at SmolLM2's
# projections, one core: the AMX tile GEMM (Sapphire Rapids-class) 1.24-1.40x at 1-32 rows,
# 1.16-1.19x at 33-64, 1.04x at 65 and 1.0x at 100, the lm_head (49152 x 576) 1.10-1.24x at 1-32
# rows, 0.88x at 64; the pair GEMM (Zen 5) 1.09-1.67x at 32-64 rows, 0.97-1.16x at 96-256,
# 0.81-0.95x at 1536, the lm_head 1.24-1.45x at 1-32 rows, 1.12x at 48, 1.02x at 64.
DECODE_TILE_ROWS = 64
LM_HEAD_TILE_ROWS = {"bf16_amx": 32, "bf16": 48}
# The decode copy is kept only while it takes at most this share of the host's available
# memory at load (a large model keeps one copy rather than crowd out the KV pool and adapters).
DECODE_COPY_SHARE = 0.25


def host_memory_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def onednn_linear_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``pack_linear`` applies: oneDNN's prepacked GEMM on CPU, fp32 or bf16."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """``[d_out, d_in]`` -> oneDNN's blocked copy of it, for ``linear``.

    On CPU, oneDNN's GEMM on a prepacked weight runs 1.3-1.8x faster than ``F.linear`` (MKL) on
    the few-row inputs of decode steps, in fp32 and bf16 alike, and no slower on prefill chunks.
    A bf16 weight is packed for batches of 64 rows (oneDNN's batch-size hint): on AMX tiles
    1.03-1.06x at 1-64 rows and the same at 256-1536 as packed with no hint (SmolLM2's
    projections, one Sapphire Rapids-class core; 1.02-1.04x at two threads); the same at
    256-1536 rows on a Zen 5 core (0.98-1.03x).
    """
    hint = 64 if weight.dtype == torch.bfloat16 else None
    return torch.ops.mkldnn._reorder_linear_weight(weight, hint)


class LayerTiles(NamedTuple):
    """A layer's four projections in the native GEMM's panel order
    (``loraplex/kernels/cpu_gemm.pack``: AMX tiles or FMA vectors, bf16 pair panels)."""

    qkv: cpu_gemm.PackedWeight
    o: cpu_gemm.PackedWeight
    gate_up: cpu_gemm.PackedWeight
    down: cpu_gemm.PackedWeight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tiles: cpu_gemm.PackedWeight | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` for a dense or a ``pack_linear`` weight, or, given ``tiles``
    (the same weight in ``cpu_gemm.pack``'s form; ``weight`` is then only its shape), on the
    native GEMM (AMX or FMA in float32, pair dot products in bf16)."""
    if tiles is not None:
        return cpu_gemm.linear(x if x.stride(-1) == 1 else x.contiguous(), tiles, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As Hugging Face does it: normalise in float32, cast back, then scale.
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm ``weight * dtype(h * rsqrt(mean(h^2) + eps))``, ``h = float32(x)``:
    ``x [T, n]``, ``weight [n]`` -> ``[T, n]`` in x's dtype. The fused C kernel on contiguous
    CPU float32/bf16 tensors (loraplex/kernels/cpu_elementwise.py, the same roundings), else
    torch."""
    if cpu_elementwise.usable(x, weight):
        return cpu_elementwise.rms_norm(x, weight, eps)
    return _rms_norm_torch(x, weight, eps)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``hidden += delta`` (in place), then ``rms_norm(hidden, weight, eps)``: one pass over
    ``[T, n]`` in the fused C kernel where ``rms_norm`` takes it."""
    if cpu_elementwise.usable(hidden, delta, weight):
        return cpu_elementwise.add_rms_norm(hidden, delta, weight, eps)
    hidden += delta
    return _rms_norm_torch(hidden, weight, eps)


class LlamaModel:
    """A Llama-family causal LM over paged KV. Weights come from ``loader.load_weights``."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: torch.Tensor) -> None:
        self.config = config
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.norm = norm  # [hidden]
        self.lm_head = lm_head  # [vocab, hidden] (the embedding itself when tied)
        self.dtype = embed.dtype
        self.device = embed.device
        self.rope = RotaryEmbedding(config, self.dtype, self.device)
        self.scale = config.head_dim ** -0.5
        self.act = ACTIVATIONS[config.hidden_act]
        # float32 where cpu_gemm has a kernel (AMX tiles; FMA vectors on AVX2), bf16 on its
        # pair dot product one (AVX512-BF16 without AMX) where only one copy is kept: every
        # projection on it, its weights rearranged once and the dense copies dropped (kept as
        # "meta" tensors: their shapes, no memory); a tied lm_head stays the embedding
        self.tiles: list[LayerTiles] | None = None
        self.lm_head_tiles: cpu_gemm.PackedWeight | None = None
        # bf16 on oneDNN: decode-sized calls on the AMX tile GEMM or the pair GEMM, from a
        # second copy of the projections in its panel order (oneDNN's keep prefill chunks,
        # where they are the faster: cpu_gemm.bf16_decode_kind)
        self.decode_tiles: list[LayerTiles] | None = None
        self.lm_head_decode_tiles: cpu_gemm.PackedWeight | None = None
        cpu = self.device.type == "cpu"
        onednn = onednn_linear_supported(self.dtype, self.device)
        decode_kind = (cpu_gemm.bf16_decode_kind()
                       if cpu and onednn and self.dtype == torch.bfloat16 else None)
        if decode_kind is not None:
            copy_bytes = 2 * (lm_head.numel() + sum(
                t.numel() for w in layers for t in (w.qkv, w.o, w.gate_up, w.down)))
            available = host_memory_available()
            if available is not None and copy_bytes > DECODE_COPY_SHARE * available:
                logger.warning(
                    "bf16 model: no second copy of the projections for decode steps (%.1f GiB, "
                    "more than %.0f%% of the %.1f GiB of memory available): one copy",
                    copy_bytes / 2**30, 100 * DECODE_COPY_SHARE, available / 2**30)
                decode_kind = None
        native_gemm = cpu and decode_kind is None and (
            (self.dtype == torch.float32 and cpu_gemm.enabled())
            or (self.dtype == torch.bfloat16 and cpu_gemm.bf16_enabled()))
        if native_gemm:
            self.tiles = []
            for w in layers:
                self.tiles.append(LayerTiles(cpu_gemm.pack(w.qkv), cpu_gemm.pack(w.o),
                                             cpu_gemm.pack(w.gate_up), cpu_gemm.pack(w.down)))
                w.qkv, w.o = w.qkv.to("meta"), w.o.to("meta")
                w.gate_up, w.down = w.gate_up.to("meta"), w.down.to("meta")
            self.lm_head_tiles = cpu_gemm.pack(lm_head)
            if lm_head is not embed:
                self.lm_head = lm_head.to("meta")
        elif onednn:
            if decode_kind is not None:
                self.decode_tiles = [
                    LayerTiles(*(cpu_gemm.pack(t, decode_kind)
                                 for t in (w.qkv, w.o, w.gate_up, w.down)))
                    for w in layers]
                self.lm_head_decode_tiles = cpu_gemm.pack(lm_head, decode_kind)
            # Packed in place, so the dense copies are freed (a tied lm_head gets its own).
            for w in layers:
                w.qkv, w.o = pack_linear(w.qkv), pack_linear(w.o)
                w.gate_up, w.down = pack_linear(w.gate_up), pack_linear(w.down)
            self.lm_head = pack_linear(lm_head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """``input_ids, positions [T]`` -> final hidden states ``[T, hidden]`` (pre lm_head)."""
        cfg = self.config
        num_tokens = input_ids.shape[0]
        cos, sin = self.rope.cos_sin(positions)
        eps, layers = cfg.rms_norm_eps, self.layers
        hidden = F.embedding(input_ids, self.embed)  # [T, hidden]
        # The residual stream: each norm runs fused with the residual add before it, so
        # `x` (the next block's input) is always rms_norm of the updated `hidden`.
        x = rms_norm(hidden, layers[0].input_norm, eps) if layers else hidden
        no_tiles = (None, None, None, None)
        tiles = self.tiles
        if tiles is None and num_tokens <= DECODE_TILE_ROWS:
            tiles = self.decode_tiles
        for i, w in enumerate(layers):
            t_qkv, t_o, t_gate_up, t_down = tiles[i] if tiles else no_tiles
            qkv = linear(x, w.qkv, w.qkv_bias, t_qkv)  # [T, q_size + 2 * kv_size]
            if ctx.lora is not None:
                ctx.lora(i, "qkv", x, qkv)
            q, k = self.rope.apply_qk(qkv, cos, sin, cfg.num_heads, cfg.num_kv_heads,
                                      cfg.head_dim)
            v = qkv[:, cfg.q_size + cfg.kv_size:].reshape(num_tokens, cfg.num_kv_heads,
                                                          cfg.head_dim)
            pool = ctx.kv_pools[i]
            ctx.write_kv(pool, k, v, ctx.attn.slot_mapping, ctx.page_size)
            attn = ctx.attention(q, pool, ctx.attn, ctx.page_size, cfg.num_kv_heads, self.scale)
            attn = attn.reshape(num_tokens, cfg.q_size)
            o = linear(attn, w.o, w.o_bias, t_o)
            if ctx.lora is not None:
                ctx.lora(i, "o", attn, o)
            if ctx.all_reduce is not None:
                ctx.all_reduce(o)  # the sum over ranks comes before the residual add
            x = add_rms_norm(hidden, o, w.post_norm, eps)  # hidden is this forward's own
            gate_up = linear(x, w.gate_up, w.gate_up_bias, t_gate_up)  # [T, 2 * intermediate]
            if ctx.lora is not None:
                ctx.lora(i, "gate_up", x, gate_up)
            act = self._act_and_mul(gate_up)  # [T, intermediate]
            down = linear(act, w.down, w.down_bias, t_down)
            if ctx.lora is not None:
                ctx.lora(i, "down", act, down)
            if ctx.all_reduce is not None:
                ctx.all_reduce(down)
            if i + 1 < len(layers):
                x = add_rms_norm(hidden, down, layers[i + 1].input_norm, eps)
            else:
                hidden += down  # the final norm is compute_logits', on the rows it needs
        return hidden

    def _act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of ``gate_up [T, 2 * I]`` -> ``[T, I]``."""
        if self.act is F.silu and cpu_elementwise.usable(gate_up):
            return cpu_elementwise.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        # SiLU in place on gate_up's own buffer (same values; one [T, intermediate]
        # temporary fewer); the other activations are not all in-place ops
        return (F.silu(gate, inplace=True) if self.act is F.silu else self.act(gate)) * up

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits ``[N, vocab]`` (final norm included)."""
        h = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        tiles = self.lm_head_tiles
        decode = self.lm_head_decode_tiles
        if tiles is None and decode is not None and h.shape[0] <= LM_HEAD_TILE_ROWS[decode.kind]:
            tiles = decode
        return linear(h, self.lm_head, tiles=tiles).float()


# Which slice of each fused projection a LoRA target module writes to.
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def module_slices(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """module -> (fused group, start column, end column) in that group's output."""
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    return {
        "q_proj": ("qkv", 0, q),
        "k_proj": ("qkv", q, q + kv),
        "v_proj": ("qkv", q + kv, q + 2 * kv),
        "o_proj": ("o", 0, config.hidden_size),
        "gate_proj": ("gate_up", 0, inter),
        "up_proj": ("gate_up", inter, 2 * inter),
        "down_proj": ("down", 0, config.hidden_size),
    }
