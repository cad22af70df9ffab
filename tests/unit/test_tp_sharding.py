"""Tensor-parallel shards against the unsharded tensors: each rank's slice of q/k/v, gate/up,
o and down, and of every adapter module, recombines into the unsharded result."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.layout import adapter_layout
from loraplex.server.engine.models.config import LORA_MODULES, ModelConfig
from loraplex.server.engine.models.llama import LayerWeights
from loraplex.server.engine.parallel.sharding import (
    ROW_PARALLEL,
    Shard,
    check_tensor_parallel,
    shard_config,
)
from tests.helpers import tiny_hf_config

F64 = torch.float64  # sums in another order: exact enough to compare with the default tolerance


def config(heads: int, kv: int, **kw) -> ModelConfig:
    return ModelConfig.from_hf_dict(tiny_hf_config(num_attention_heads=heads,
                                                   num_key_value_heads=kv, **kw))


def random_layer(cfg: ModelConfig, gen: torch.Generator) -> LayerWeights:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return LayerWeights(input_norm=r(h), qkv=r(q + 2 * kv, h), qkv_bias=r(q + 2 * kv),
                        o=r(h, q), post_norm=r(h), gate_up=r(2 * i, h), down=r(h, i),
                        o_bias=r(h), gate_up_bias=r(2 * i), down_bias=r(h))


def split_qkv(cfg: ModelConfig, y: torch.Tensor):
    return y.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)


@pytest.mark.parametrize("heads,kv,size", [(4, 2, 2), (4, 1, 2), (4, 4, 4), (8, 2, 4),
                                           (4, 2, 4)])
def test_layer_shards_recombine(heads, kv, size):
    cfg = config(heads, kv)
    gen = torch.Generator().manual_seed(heads * 10 + kv)
    w = random_layer(cfg, gen)
    x = torch.randn(5, cfg.hidden_size, generator=gen)
    q, k, v = split_qkv(cfg, x @ w.qkv.t() + w.qkv_bias)
    gate, up = (x @ w.gate_up.t() + w.gate_up_bias).chunk(2, dim=-1)
    attn = torch.randn(5, cfg.q_size, generator=gen)
    act = torch.randn(5, cfg.intermediate_size, generator=gen)
    local = shard_config(cfg, size)
    qs, o_sum, gates, down_sum = [], 0, [], 0
    d = cfg.head_dim
    for rank in range(size):
        s = Shard(cfg, size, rank)
        ws = s.layer(w)
        lq, lk, lv = split_qkv(local, x @ ws.qkv.t() + ws.qkv_bias)
        qs.append(lq)
        # Each rank's KV heads are the unsharded ones it names (replicated when kv < size).
        h0, h1 = s.kv_heads()
        assert local.num_kv_heads == h1 - h0
        torch.testing.assert_close(lk, k[:, h0 * d:h1 * d])
        torch.testing.assert_close(lv, v[:, h0 * d:h1 * d])
        # GQA stays consistent: local query head j reads local KV head j // group.
        group = local.num_heads // local.num_kv_heads
        for j in range(local.num_heads):
            assert (s.q_range()[0] // d + j) // (heads // kv) == h0 + j // group
        g, u = (x @ ws.gate_up.t() + ws.gate_up_bias).chunk(2, dim=-1)
        gates.append((g, u))
        q0, q1 = s.q_range()
        i0, i1 = s.inter_range()
        o_part = attn[:, q0:q1] @ ws.o.t()
        down_part = act[:, i0:i1] @ ws.down.t()
        if ws.o_bias is not None:
            assert rank == 0
            o_part, down_part = o_part + ws.o_bias, down_part + ws.down_bias
        o_sum = o_sum + o_part
        down_sum = down_sum + down_part
    torch.testing.assert_close(torch.cat(qs, dim=-1), q)
    torch.testing.assert_close(torch.cat([g for g, _ in gates], dim=-1), gate)
    torch.testing.assert_close(torch.cat([u for _, u in gates], dim=-1), up)
    torch.testing.assert_close(o_sum, attn @ w.o.t() + w.o_bias)
    torch.testing.assert_close(down_sum, act @ w.down.t() + w.down_bias)


def random_flat(cfg: ModelConfig, rank: int, modules, gen):
    layout = adapter_layout(rank, modules, cfg.module_shapes())
    flat = torch.zeros(cfg.num_layers, layout.num_elems, dtype=F64)
    weights = {}
    for layer in range(cfg.num_layers):
        for m in modules:
            d_in, d_out = cfg.module_shapes()[m]
            a, b = (torch.randn(rank, d_in, generator=gen, dtype=F64),
                    torch.randn(d_out, rank, generator=gen, dtype=F64))
            weights[layer, m] = (a, b)
            flat[layer, layout.a_offsets[m]:layout.a_offsets[m] + a.numel()] = a.reshape(-1)
            flat[layer, layout.b_offsets[m]:layout.b_offsets[m] + b.numel()] = b.t().reshape(-1)
    return layout, flat, weights


@pytest.mark.parametrize("heads,kv,size", [(4, 2, 2), (4, 1, 2), (8, 2, 4)])
@pytest.mark.parametrize("rank,modules", [(1, ["q_proj", "v_proj"]), (8, LORA_MODULES),
                                          (64, ["k_proj", "o_proj", "down_proj"])])
def test_adapter_shards_recombine(heads, kv, size, rank, modules):
    cfg = config(heads, kv)
    gen = torch.Generator().manual_seed(rank)
    layout, flat, weights = random_flat(cfg, rank, modules, gen)
    local = shard_config(cfg, size)
    shapes = local.module_shapes()
    x = {m: torch.randn(3, cfg.module_shapes()[m][0], generator=gen, dtype=F64)
         for m in modules}
    for layer in range(cfg.num_layers):
        for m in modules:
            a, b = weights[layer, m]
            full = x[m] @ a.t() @ b.t()  # [3, d_out]
            parts = []
            for r in range(size):
                s = Shard(cfg, size, r)
                slayout = s.adapter_layout(layout)
                sflat = s.adapter(flat, layout)
                assert sflat.shape == (cfg.num_layers, slayout.num_elems)
                d_in, d_out = shapes[m]
                ao, bo = slayout.a_offsets[m], slayout.b_offsets[m]
                sa = sflat[layer, ao:ao + rank * d_in].view(rank, d_in)
                sbt = sflat[layer, bo:bo + rank * d_out].view(rank, d_out)
                if m in ROW_PARALLEL:
                    lo, hi = s.in_range(m)
                    torch.testing.assert_close(sa, a[:, lo:hi])  # A by input rows
                    torch.testing.assert_close(sbt, b.t())  # B replicated
                    parts.append(x[m][:, lo:hi] @ sa.t() @ sbt)
                else:
                    lo, hi = s.out_range(m)
                    torch.testing.assert_close(sa, a)  # A replicated
                    torch.testing.assert_close(sbt, b.t()[:, lo:hi])  # B by output columns
                    torch.testing.assert_close(x[m] @ sa.t() @ sbt, full[:, lo:hi])
            if m in ROW_PARALLEL:
                # The partial deltas sum (in the base layer's all-reduce) to the whole delta.
                torch.testing.assert_close(sum(parts), full)


def test_refuses_heads_that_do_not_divide():
    smollm2 = config(9, 3, hidden_size=576, intermediate_size=1536, head_dim=64)
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 does not divide the "
                                         "model's 9 attention heads"):
        check_tensor_parallel(smollm2, 2)
    check_tensor_parallel(smollm2, 3)
    with pytest.raises(ValueError, match="KV heads"):
        check_tensor_parallel(config(12, 6), 4)  # 12 heads split over 4, 6 KV heads do not
