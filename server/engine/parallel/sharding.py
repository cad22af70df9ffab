"""How a Llama-family model and its adapters split over ``N`` tensor-parallel ranks.

Megatron's layout for the base model, S-LoRA's for the adapters:

* q/k/v and gate/up are **column-parallel**: rank ``r`` holds the output rows of its attention
  heads (its KV heads; ``N / num_kv_heads`` ranks share one replicated KV head when there are
  fewer KV heads than ranks, as vLLM does) and its ``intermediate / N`` slice of gate and up.
  No communication: attention and the activation are local to a rank's heads and slice.
* o and down are **row-parallel**: rank ``r`` holds the input columns matching its heads and
  slice, computes a partial ``[T, hidden]`` and the ranks all-reduce it (sum). Their biases
  live on rank 0 only, so the sum adds them once.
* embedding, final norm and lm_head are **replicated**: the vocabularies served here are
  small beside the layers, and a replicated lm_head gives the driver the full logits with no
  all-gather, so the sampler stays one process's.
* LoRA on a column-parallel module: ``A`` replicated, ``B`` sharded by output columns like
  the base weight; the delta of the rank's columns is local. On a row-parallel module: ``A``
  sharded by input rows, ``B`` replicated; by linearity ``(sum_r x_r A_r^T) B^T = sum_r
  (x_r A_r^T) B^T``, so each rank adds its partial delta to its partial output and the base
  layer's all-reduce sums both: no collective of its own.

Each rank therefore runs the unchanged model on a **shard config** (``shard_config``): fewer
heads, fewer KV heads, a smaller intermediate size; page and adapter layouts
(``loraplex/kernels/layout.py``) are computed on the shard config's shapes, the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from loraplex.kernels.layout import AdapterLayout, adapter_layout
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.models.llama import LayerWeights

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` (naming ``tensor_parallel_size``) unless ``size`` ranks can split
    ``config``: heads and the intermediate size divide by it, and KV heads divide by it or it
    by them."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {size}")
    if config.num_heads % size:
        raise ValueError(f"tensor_parallel_size: {size} does not divide the model's "
                         f"{config.num_heads} attention heads")
    kv = config.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ValueError(f"tensor_parallel_size: {size} and the model's {kv} KV heads: one "
                         "must divide the other")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size: {size} does not divide the model's "
                         f"intermediate size {config.intermediate_size}")


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The model one rank runs: ``num_heads / N`` heads, ``max(1, num_kv_heads / N)`` KV
    heads, ``intermediate / N``; everything else (hidden, vocab, RoPE) unchanged."""
    check_tensor_parallel(config, size)
    return replace(config, num_heads=config.num_heads // size,
                   num_kv_heads=max(1, config.num_kv_heads // size),
                   intermediate_size=config.intermediate_size // size)


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``: which columns of each projection it owns.

    Every range is ``(start, end)`` in the unsharded tensor's coordinates.
    """

    config: ModelConfig  # the unsharded model
    size: int
    rank: int

    def __post_init__(self) -> None:
        check_tensor_parallel(self.config, self.size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank: {self.rank} is outside [0, {self.size})")

    @property
    def local(self) -> ModelConfig:
        return shard_config(self.config, self.size)

    def q_range(self) -> tuple[int, int]:
        n = self.local.q_size
        return self.rank * n, (self.rank + 1) * n

    def kv_heads(self) -> tuple[int, int]:
        """The KV heads this rank holds (one, shared with other ranks, when KV < N)."""
        kv = self.config.num_kv_heads
        if kv >= self.size:
            per = kv // self.size
            return self.rank * per, (self.rank + 1) * per
        head = self.rank // (self.size // kv)
        return head, head + 1

    def kv_range(self) -> tuple[int, int]:
        lo, hi = self.kv_heads()
        d = self.config.head_dim
        return lo * d, hi * d

    def inter_range(self) -> tuple[int, int]:
        n = self.local.intermediate_size
        return self.rank * n, (self.rank + 1) * n

    def out_range(self, module: str) -> tuple[int, int]:
        """Output columns of a column-parallel module this rank computes."""
        if module == "q_proj":
            return self.q_range()
        if module in ("k_proj", "v_proj"):
            return self.kv_range()
        if module in ("gate_proj", "up_proj"):
            return self.inter_range()
        raise ValueError(f"module: {module!r} is not column-parallel")

    def in_range(self, module: str) -> tuple[int, int]:
        """Input columns of a row-parallel module this rank reads."""
        if module == "o_proj":
            return self.q_range()
        if module == "down_proj":
            return self.inter_range()
        raise ValueError(f"module: {module!r} is not row-parallel")

    # -- the base model --------------------------------------------------------------------
    def qkv_rows(self) -> torch.Tensor:
        """Rows of the fused ``[q_size + 2 * kv_size, hidden]`` q/k/v weight on this rank."""
        q, kv = self.config.q_size, self.config.kv_size
        (q0, q1), (k0, k1) = self.q_range(), self.kv_range()
        return torch.cat([torch.arange(q0, q1), q + torch.arange(k0, k1),
                          q + kv + torch.arange(k0, k1)])

    def gate_up_rows(self) -> torch.Tensor:
        inter = self.config.intermediate_size
        i0, i1 = self.inter_range()
        return torch.cat([torch.arange(i0, i1), inter + torch.arange(i0, i1)])

    def layer(self, w: LayerWeights) -> LayerWeights:
        """This rank's slice of one layer's (dense, unpacked) weights."""
        qkv, gu = self.qkv_rows(), self.gate_up_rows()
        (q0, q1), (i0, i1) = self.q_range(), self.inter_range()
        first = self.rank == 0
        return LayerWeights(
            input_norm=w.input_norm,
            qkv=w.qkv[qkv].contiguous(),
            qkv_bias=w.qkv_bias[qkv].contiguous() if w.qkv_bias is not None else None,
            o=w.o[:, q0:q1].contiguous(),
            post_norm=w.post_norm,
            gate_up=w.gate_up[gu].contiguous(),
            down=w.down[:, i0:i1].contiguous(),
            o_bias=w.o_bias if first else None,
            gate_up_bias=w.gate_up_bias[gu].contiguous() if w.gate_up_bias is not None else None,
            down_bias=w.down_bias if first else None,
        )

    # -- adapters --------------------------------------------------------------------------
    def adapter_layout(self, layout: AdapterLayout) -> AdapterLayout:
        """The layout of this rank's shard of an adapter (shard shapes, same modules)."""
        return adapter_layout(layout.rank, layout.modules, self.local.module_shapes())

    def adapter(self, flat: torch.Tensor, layout: AdapterLayout) -> torch.Tensor:
        """``[num_layers, layout.num_elems]`` (the whole adapter, ``flatten_adapter``'s
        region) -> this rank's region ``[num_layers, adapter_layout(layout).num_elems]``.

        Column-parallel modules keep ``A`` whole and the rank's rows of ``B^T``' columns;
        row-parallel ones the rank's columns of ``A`` and ``B^T`` whole."""
        local = self.adapter_layout(layout)
        shapes = self.config.module_shapes()
        r = layout.rank
        out = flat.new_zeros(flat.shape[0], local.num_elems)
        for module in layout.modules:
            d_in, d_out = shapes[module]
            a_off, b_off = layout.a_offsets[module], layout.b_offsets[module]
            a = flat[:, a_off:a_off + r * d_in].view(-1, r, d_in)  # [L, r, d_in]
            bt = flat[:, b_off:b_off + r * d_out].view(-1, r, d_out)  # [L, r, d_out]
            if module in COLUMN_PARALLEL:
                lo, hi = self.out_range(module)
                bt = bt[:, :, lo:hi]
            else:
                lo, hi = self.in_range(module)
                a = a[:, :, lo:hi]
            la, lb = local.a_offsets[module], local.b_offsets[module]
            out[:, la:la + a[0].numel()] = a.reshape(flat.shape[0], -1)
            out[:, lb:lb + bt[0].numel()] = bt.reshape(flat.shape[0], -1)
        return out
