"""The compile-time buckets (pure functions, no kernel runs): every batch a worker can schedule
maps into a small finite set of kernel variants, and that set is what warm-up enumerates.

Sweeps: token counts 1..max_num_batched_tokens, segment counts 1..min(T, max_num_seqs), ranks
1..max_rank, devices of 4 (the interpreter) and 132 (H100/H200) multiprocessors,
for the demo model and a 7B-like Llama.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from loraplex.kernels import buckets
from loraplex.kernels.attention_plan import AttentionPlan, plan_attention
from loraplex.kernels.paged_attention import attention_launches
from loraplex.kernels.sgmv import expand_launch, shrink_launch
from loraplex.kernels.sgmv_plan import plan_expand, plan_shrink, row_align
from loraplex.kernels.variants import (
    Variant,
    expand_specialization,
    serving_variants,
    shrink_specialization,
    variant,
)
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.models.demo import demo_model_config
from loraplex.server.engine.warmup import module_geometry

SMS = (4, 132)
LLAMA_7B = ModelConfig.from_hf_dict(dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=4096,
    intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, max_position_embeddings=4096))
# name: (model, dtype, page_size, max_model_len, max_num_batched_tokens, max_num_seqs, max_rank,
#        the size of its variant set)
CONFIGS = {
    "demo": (demo_model_config(), torch.float32, 16, 2048, 2048, 256, 64, 65),
    "demo-r16": (demo_model_config(), torch.float32, 16, 2048, 1024, 128, 16, 26),
    "7b": (LLAMA_7B, torch.float16, 16, 4096, 2048, 256, 64, 65),
    "7b-short": (LLAMA_7B, torch.bfloat16, 16, 384, 512, 64, 64, 63),
}


def test_bucket_functions_map_every_input_into_their_sets() -> None:
    assert {buckets.rank_block(r) for r in range(1, 1025)} == set(buckets.RANK_BLOCKS)
    for max_rank in range(1, 1025):
        assert buckets.rank_blocks(max_rank) == tuple(
            sorted({buckets.rank_block(r) for r in range(1, max_rank + 1)}))
    shapes = {buckets.tile_shape(t, s) for t in range(1, 2049) for s in range(1, min(t, 256) + 1)}
    assert shapes == set(buckets.TILE_SHAPES)
    for n in range(1, 5000):
        assert buckets.next_pow2(n) == 1 << (n - 1).bit_length()
        assert buckets.floor_pow2(n) <= n < 2 * buckets.floor_pow2(n)
    for want, d, page_elems in itertools.product((32, 64, 128, 256), range(1, 300, 7),
                                                 (16, 80, 256, 32768)):
        block = buckets.column_block(want, d, page_elems)
        assert 16 <= block <= max(want, 16) and block & (block - 1) == 0
        assert block <= page_elems


def _segment_counts(tokens: int, max_seqs: int) -> list[int]:
    # every count for short steps; beyond, both ends, the bucket edges and T / k for a ladder of k
    top = min(tokens, max_seqs)
    if tokens <= 48:
        return list(range(1, top + 1))
    ladder = {1, 2, 3, 7, 16, 17, 63, 64, 65, 255, top}
    ladder |= {tokens // k for k in (2, 3, 4, 5, 31, 32, 33, 63, 64, 65)}
    return sorted(s for s in ladder if 1 <= s <= top)


def _lora_keys(config: ModelConfig, dtype: torch.dtype, page_size: int, max_tokens: int,
               max_seqs: int, max_rank: int) -> set[Variant]:
    """Every LoRA variant the launchers pick over the sweep (as ``sgmv_shrink`` would)."""
    page_elems = 2 * page_size * config.num_kv_heads * config.head_dim
    element_size = torch.empty(0, dtype=dtype).element_size()
    geometry = {(g.d_in, g.d_out, g.y_stride, g.y_start): g
                for g in module_geometry(config).values()}.values()
    d_ins = sorted({g.d_in for g in geometry})
    d_outs = sorted({g.d_out for g in geometry})
    plans: dict[tuple, tuple[int, int, int]] = {}  # (op, d, plan) -> a batch that picks it
    # (T, S) in full against the largest rank of each rank tile; every rank on fewer shapes
    full = sorted({min(b, max_rank) for b in buckets.RANK_BLOCKS} | {max_rank})
    for tokens in range(1, max_tokens + 1):
        sweep_ranks = range(1, max_rank + 1) if tokens in (1, 2, 7, 64, 300) else full
        for segments in _segment_counts(tokens, max_seqs):
            for rank, sms in itertools.product(sweep_ranks, SMS):
                for d in d_ins:
                    plan = plan_shrink(tokens, segments, d, rank, page_elems, sms)
                    plans.setdefault(("shrink", d, plan), (tokens, segments, rank))
                for d in d_outs:
                    plan = plan_expand(tokens, segments, d, rank, page_elems, sms)
                    plans.setdefault(("expand", d, plan), (tokens, segments, rank))
    keys = set()
    for (op, d, plan), (tokens, segments, rank) in plans.items():
        for geo in geometry:
            if op == "shrink" and geo.d_in == d:
                launch = shrink_launch(plan, tokens, segments, rank, dtype,
                                       row_align(d, page_elems, page_elems, 0))
                keys.add(variant(launch.kernel.__name__, launch.constexprs,
                                 shrink_specialization(geo)))
            elif op == "expand" and geo.d_out == d:
                launch = expand_launch(plan, tokens, segments, d, dtype,
                                       row_align(d, page_elems, page_elems, 0))
                keys.add(variant(launch.kernel.__name__, launch.constexprs,
                                 expand_specialization(geo, element_size)))
    return keys


def _attention_keys(config: ModelConfig, dtype: torch.dtype, page_size: int,
                    max_model_len: int, max_seqs: int) -> set[Variant]:
    keys = set()
    lens = sorted({1, 2, 255, 256, 511, 512, 513, 1024, 4096, 32768} | set(range(1, 2049, 37)))
    for num_seqs, max_len, sms in itertools.product(range(1, max_seqs + 1), lens, SMS):
        if max_len > max_model_len:
            continue
        plan = plan_attention(num_seqs, config.num_kv_heads, config.head_dim, max_len, dtype, sms)
        for q_lens in ((1,) * num_seqs, (2,) * num_seqs, (1,) * (num_seqs - 1) + (2,)):
            for launch in attention_launches(plan, q_lens, config.num_heads, config.num_kv_heads,
                                             config.head_dim, page_size, dtype).values():
                keys.add(variant(launch.kernel.__name__, launch.constexprs))
    return keys


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_schedulable_batch_maps_into_the_variants_warm_up_enumerates(name: str) -> None:
    config, dtype, page_size, max_len, max_tokens, max_seqs, max_rank, size = CONFIGS[name]
    geometry = module_geometry(config)
    enumerated = serving_variants(geometry, config.num_heads, config.num_kv_heads,
                                  config.head_dim, page_size, dtype, max_len, max_rank)
    lora = _lora_keys(config, dtype, page_size, max_tokens, max_seqs, max_rank)
    attention = _attention_keys(config, dtype, page_size, max_len, max_seqs)
    write_kv = {v for v in enumerated if v.kernel == "_write_kv_kernel"}
    # what serving can launch is exactly what warm-up enumerates (nothing wasted, none missed)
    assert enumerated == lora | attention | write_kv and len(write_kv) == 1
    assert len(enumerated) == size  # small: one compile each at start, none while serving


def test_no_adapters_no_lora_variants() -> None:
    config = demo_model_config()
    keys = serving_variants(None, config.num_heads, config.num_kv_heads, config.head_dim, 16,
                            torch.float32, 2048, 64)
    assert {k.kernel for k in keys} == {"_decode_kernel", "_merge_splits_kernel",
                                        "_prefill_kernel", "_write_kv_kernel"}


def test_attention_split_counts_are_runtime_arguments() -> None:
    # any split count compiles the one split variant; counts above the cap are refused
    a, b = (attention_launches(AttentionPlan(num_splits=n), (1, 1), 8, 2, 64, 16, torch.float16)
            for n in (3, 17))
    assert a["decode"].constexprs == b["decode"].constexprs
    assert a["merge"].constexprs == b["merge"].constexprs
    with pytest.raises(ValueError, match="num_splits"):
        AttentionPlan(num_splits=buckets.MAX_ATTENTION_SPLITS + 1)
