"""The engine's LoRA hook: the CPU path (blocks resolved once per resident adapter, segment by
segment) against the op-signature path over the page table, and dense math on plain A / B."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import random
import weakref

import numpy as np
import pytest
import torch

from loraplex.kernels import cpu, cpu_lora_native, native, reference
from loraplex.kernels.layout import adapter_layout, write_region
from loraplex.server.engine.adapter_cache import ResidentAdapter
from loraplex.server.engine.lora import LoraBatch, LoraOps, lora_ops
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.models.llama import FUSED_GROUPS, module_slices

CONFIG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=24,
                     intermediate_size=40, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=6, max_position_embeddings=128)
PAGE_ELEMS = 88  # rows of 24 and 40 elements straddle pages: some blocks are copies
GROUP_WIDTH = {"qkv": 24 + 2 * 12, "o": 24, "gate_up": 80, "down": 24}
GROUP_INPUT = {"qkv": 24, "o": 24, "gate_up": 24, "down": 40}
KERNEL_PATH = LoraOps(reference.lora_shrink, reference.lora_expand, segment_major=False)


def write_adapter(pools: torch.Tensor, pages: list[int], rank: int, modules: tuple[str, ...],
                  seed: int) -> tuple[ResidentAdapter, dict]:
    gen = torch.Generator().manual_seed(seed)
    shapes = CONFIG.module_shapes()
    layout = adapter_layout(rank, modules, shapes)
    weights = {}
    for layer in range(CONFIG.num_layers):
        for m in modules:
            d_in, d_out = shapes[m]
            a, b = torch.randn(rank, d_in, generator=gen), torch.randn(d_out, rank, generator=gen)
            write_region(pools[layer], pages, layout.a_offsets[m], a)
            write_region(pools[layer], pages, layout.b_offsets[m], b.T.contiguous())
            weights[layer, m] = (a, b)
    scale = 0.5 + seed / 10
    return ResidentAdapter(f"adapter{seed}", layout, scale, tuple(pages)), weights


def dense(x, y, layer, group, segments):
    out = y.clone()
    slices = module_slices(CONFIG)
    for (lo, hi), adapter, weights in segments:
        for m in FUSED_GROUPS[group]:
            if adapter is None or (layer, m) not in weights:
                continue
            a, b = weights[layer, m]
            _, start, end = slices[m]
            out[lo:hi, start:end] += adapter.scale * (x[lo:hi] @ a.T) @ b.T
    return out


def test_segment_major_matches_page_table_path_and_dense() -> None:
    rng = random.Random(3)
    num_pages = 40
    pools = torch.randn(CONFIG.num_layers, num_pages, PAGE_ELEMS)  # garbage between blocks
    free = list(range(num_pages))
    rng.shuffle(free)
    specs = [(8, ("q_proj", "v_proj")), (3, ("q_proj", "k_proj", "v_proj", "o_proj",
                                             "gate_proj", "up_proj", "down_proj")),
             (1, ("o_proj", "down_proj"))]
    adapters = []
    for i, (rank, modules) in enumerate(specs):
        layout = adapter_layout(rank, modules, CONFIG.module_shapes())
        pages = [free.pop() for _ in range(layout.num_pages(PAGE_ELEMS))]
        adapters.append(write_adapter(pools, pages, rank, modules, seed=i + 1))
    # segments: adapter 0, base, adapter 1, adapter 2, adapter 0 again (a second segment)
    order = [0, None, 1, 2, 0]
    seg_lens = [3, 2, 1, 4, 1]
    bounds = [0]
    for n in seg_lens:
        bounds.append(bounds[-1] + n)
    resident = [adapters[i][0] if i is not None else None for i in order]
    cpu = LoraBatch(CONFIG, pools, lora_ops("torch"), resident, seg_lens)
    kernel = LoraBatch(CONFIG, pools, KERNEL_PATH, resident, seg_lens)
    assert cpu.ops.segment_major
    dense_segments = [((bounds[s], bounds[s + 1]), resident[s],
                       adapters[i][1] if i is not None else {}) for s, i in enumerate(order)]
    for layer in range(CONFIG.num_layers):
        for group in FUSED_GROUPS:
            x = torch.randn(bounds[-1], GROUP_INPUT[group])
            y0 = torch.randn(bounds[-1], GROUP_WIDTH[group])
            y_cpu, y_kernel = y0.clone(), y0.clone()
            cpu(layer, group, x, y_cpu)
            kernel(layer, group, x, y_kernel)
            torch.testing.assert_close(y_cpu, y_kernel, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(y_cpu, dense(x, y0, layer, group, dense_segments),
                                       rtol=1e-4, atol=1e-4)
            assert torch.equal(y_cpu[3:5], y0[3:5])  # the base-model segment is untouched
    # the blocks were resolved once per adapter, layer and group, and cached on the adapter
    assert set(adapters[1][0].blocks) == {(layer, g) for layer in range(2) for g in FUSED_GROUPS}


def test_a_steps_plan_is_made_once_per_group_with_every_layer_resolved(monkeypatch) -> None:
    pools = torch.randn(CONFIG.num_layers, 30, PAGE_ELEMS)
    first, w1 = write_adapter(pools, [4, 9, 1, 7], 4, ("q_proj", "v_proj"), seed=1)
    second, w2 = write_adapter(pools, [12, 2, 20], 2, ("o_proj",), seed=2)
    batch = LoraBatch(CONFIG, pools, lora_ops("torch"), [first, None, second], [2, 1, 3])
    made = []
    plan = batch._plan
    monkeypatch.setattr(batch, "_plan", lambda group, x: made.append(group) or plan(group, x))
    x = torch.randn(6, 24)
    for layer in (1, 0, 1):  # any layer first, each more than once
        for group, width in (("qkv", 48), ("o", 24), ("down", 24)):
            y0 = torch.randn(6, width)
            y = y0.clone()
            batch(layer, group, x if group != "down" else torch.randn(6, 40), y)
            if group == "down":  # no adapter targets it: untouched
                assert torch.equal(y, y0)
                continue
            expected = dense(x, y0, layer, group, [((0, 2), first, w1), ((3, 6), second, w2)])
            torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    assert made == ["qkv", "o", "down"]
    # the first call of a group resolved its blocks in every layer, the same objects cached
    # per (layer, group) as before
    for adapter in (first, second):
        for group in ("qkv", "o", "down"):
            layers = adapter.groups[group].layers
            assert [adapter.blocks[layer, group] for layer in range(CONFIG.num_layers)] == \
                list(layers)
    assert not first.groups["o"].targeted and second.groups["o"].targeted


def test_new_residency_resolves_its_own_pages() -> None:
    # Evicted and copied back in elsewhere, an adapter is a new ResidentAdapter: the blocks
    # cached for its old pages (now someone else's) are never used again.
    pools = torch.zeros(CONFIG.num_layers, 30, PAGE_ELEMS)
    modules = ("q_proj", "v_proj")
    old, _ = write_adapter(pools, [4, 9, 1, 7], 4, modules, seed=5)
    x = torch.randn(2, 24)
    LoraBatch(CONFIG, pools, lora_ops("torch"), [old], [2])(0, "qkv", x, torch.zeros(2, 48))
    assert old.blocks
    pools[:, [4, 9, 1, 7]] = torch.randn(CONFIG.num_layers, 4, PAGE_ELEMS)  # pages reused as KV
    new, weights = write_adapter(pools, [12, 2, 20, 25], 4, modules, seed=5)
    assert not new.blocks
    y = torch.zeros(2, 48)
    LoraBatch(CONFIG, pools, lora_ops("torch"), [new], [2])(0, "qkv", x, y)
    torch.testing.assert_close(y, dense(x, torch.zeros(2, 48), 0, "qkv",
                                        [((0, 2), new, weights)]), rtol=1e-4, atol=1e-4)


def test_bf16_pool_runs_lora_in_float32_within_bf16_rounding() -> None:
    # A bf16 pool (the engine in bfloat16 on CPU): the CPU path resolves float32 copies of the
    # blocks once (oneDNN's bf16 GEMM is slow at rank 8-16) and rounds each output element
    # once; against the op-signature path in bf16 (which also rounds h to bf16) and dense
    # float32 math on the same bf16-rounded weights, within bf16's last bits (2**-8 relative on
    # outputs of size ~10: atol 0.1 covers a flip in y's rounding plus h's).
    rng = random.Random(7)
    pools = torch.randn(CONFIG.num_layers, 40, PAGE_ELEMS)
    free = list(range(40))
    rng.shuffle(free)
    specs = [(8, ("q_proj", "v_proj", "o_proj", "down_proj")), (3, ("q_proj", "k_proj"))]
    adapters = []
    for i, (rank, modules) in enumerate(specs):
        layout = adapter_layout(rank, modules, CONFIG.module_shapes())
        pages = [free.pop() for _ in range(layout.num_pages(PAGE_ELEMS))]
        adapters.append(write_adapter(pools, pages, rank, modules, seed=i + 1))
    pools16 = pools.bfloat16()
    weights16 = [{k: (a.bfloat16().float(), b.bfloat16().float()) for k, (a, b) in w.items()}
                 for _, w in adapters]
    order, seg_lens = [0, None, 1, 0], [3, 2, 4, 1]
    bounds = [0, 3, 5, 9, 10]
    resident = [adapters[i][0] if i is not None else None for i in order]
    cpu = LoraBatch(CONFIG, pools16, lora_ops("torch"), resident, seg_lens)
    kernel = LoraBatch(CONFIG, pools16, KERNEL_PATH, resident, seg_lens)
    dense_segments = [((bounds[s], bounds[s + 1]), resident[s],
                       weights16[i] if i is not None else {}) for s, i in enumerate(order)]
    for layer in range(CONFIG.num_layers):
        for group in ("qkv", "o", "down"):
            x = torch.randn(10, GROUP_INPUT[group]).bfloat16()
            y0 = torch.randn(10, GROUP_WIDTH[group]).bfloat16()
            y_cpu, y_kernel = y0.clone(), y0.clone()
            cpu(layer, group, x, y_cpu)
            kernel(layer, group, x, y_kernel)
            assert y_cpu.dtype == torch.bfloat16
            oracle = dense(x.float(), y0.float(), layer, group, dense_segments)
            torch.testing.assert_close(y_cpu.float(), oracle, rtol=2e-2, atol=1e-1)
            torch.testing.assert_close(y_cpu, y_kernel, rtol=2e-2, atol=1e-1)
            assert torch.equal(y_cpu[3:5], y0[3:5])  # the base-model segment is untouched
            assert not torch.equal(y_cpu, y0)
    groups = list(adapters[0][0].blocks.values())
    if native.available("lora"):  # decode-sized segments ran in C on the bf16 blocks in place
        assert groups and all(g.native is not None and not g._a_cat and not g._b_wide
                              for g in groups)
    else:  # widened: float32 copies of the concatenated blocks
        assert groups and all(torch.float32 in g._a_cat and torch.float32 in g._b_wide
                              for g in groups)


def _with_host_region(adapter: ResidentAdapter, pools: torch.Tensor) -> ResidentAdapter:
    # the CPU engine's case: the host cache's region [num_layers, num_elems], the pages' values
    pages = torch.tensor(adapter.pages)
    region = torch.stack([reference.region_rows(pools[layer], pages, 0, 1,
                                                adapter.layout.num_elems)[0]
                          for layer in range(CONFIG.num_layers)])
    return dataclasses.replace(adapter, host_region=region)


def test_host_region_adapters_run_on_tables_from_its_offsets_views_made_on_demand() -> None:
    pools = torch.randn(CONFIG.num_layers, 30, PAGE_ELEMS)
    modules = ("q_proj", "v_proj", "o_proj")
    pages = [4, 9, 1, 7, 22, 13, 17, 28][:adapter_layout(4, modules, CONFIG.module_shapes())
                                           .num_pages(PAGE_ELEMS)]
    plain, weights = write_adapter(pools, pages, 4, modules, seed=3)
    adapter = _with_host_region(plain, pools)
    pools[:, list(plain.pages)] = float("nan")  # the region alone is read from now on
    batch = LoraBatch(CONFIG, pools, lora_ops("torch"), [adapter, None], [5, 2])
    for layer in range(CONFIG.num_layers):
        for group in ("qkv", "o", "down"):
            x = torch.randn(7, GROUP_INPUT[group])
            y0 = torch.randn(7, GROUP_WIDTH[group])
            y = y0.clone()
            batch(layer, group, x, y)
            torch.testing.assert_close(y, dense(x, y0, layer, group, [((0, 5), adapter, weights)]),
                                       rtol=1e-4, atol=1e-4)
            assert torch.equal(y[5:], y0[5:])
    qkv = adapter.groups["qkv"]
    assert isinstance(qkv.layers, cpu.LazyLayers) and qkv.native is not None
    assert qkv.targeted and not adapter.groups["down"].targeted
    if native.available("lora"):  # the float32 native path never asked for the views
        assert not [key for key in adapter.blocks if key[1] in ("qkv", "o")]
    # made on demand: views of the region, and the same table rows as made from them
    for layer in (1, -2):
        group = qkv.layers[layer]
        assert adapter.blocks[layer % CONFIG.num_layers, "qkv"] is group
        region = adapter.host_region
        for m in group.modules:
            assert region.data_ptr() <= m.a_t.data_ptr() < region.data_ptr() + region.nbytes
        own = cpu_lora_native.module_table(group).table
        rows = np.ctypeslib.as_array(ctypes.cast(
            int(qkv.native.addresses[layer]), ctypes.POINTER(ctypes.c_int64)),
            shape=tuple(own.shape))
        assert rows.tolist() == own.tolist()
    assert qkv.layers[0:2] == (qkv.layers[0], qkv.layers[1])
    with pytest.raises(IndexError):
        qkv.layers[CONFIG.num_layers]
    # the lazily resolving layers hold their adapter weakly: no cycle keeps an evicted
    # adapter (and its host region) alive until a full collection
    gone = weakref.ref(adapter)
    lazy = adapter.groups["o"].layers
    gc.disable()
    try:
        del adapter, batch, qkv, group
        assert gone() is None
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="adapter"):
        lazy[0]


def test_region_tables_refuse_blocks_outside_the_region() -> None:
    region = torch.zeros(2, 100)
    ok = cpu_lora_native.RegionModule(0, 40, 2, 0, 30, 20)
    tables = cpu_lora_native.region_tables(region, [ok])
    assert tables is not None and tables.num_modules.tolist() == [1, 1]
    with pytest.raises(ValueError, match="outside the region"):
        cpu_lora_native.region_tables(region, [ok._replace(b_offset=41)])  # 41 + 2 * 30 > 100
    with pytest.raises(ValueError, match="outside the region"):
        cpu_lora_native.region_tables(region, [ok._replace(a_offset=-1)])
    assert cpu_lora_native.region_tables(region.half(), [ok]) is None  # no kernel dtype
    assert cpu_lora_native.region_tables(region[:, ::2], [ok]) is None  # not unit-stride
