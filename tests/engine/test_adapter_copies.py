"""Admission reserves an adapter's pages; the runner copies its weights in (issue 15, item 4):
scheduling writes no tensor, the scheduled batch carries the copy, the forward pass reads it."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch

from loraplex.adapter_store.format import load_adapter
from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.adapter_cache import AdapterManager
from loraplex.server.engine.batch import AdapterLoad
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.pager import Pager
from loraplex.server.engine.request import Request, SamplingParams
from tests.engine.test_fault_isolation import write_huge_adapter
from tests.engine.test_lora_parity import LoadedSource
from tests.helpers import assert_pages_idle


def _adapter(tiny_llama, tmp_path):
    path = write_huge_adapter(tmp_path / "small", tiny_llama, value=0.01)
    return load_adapter(path, ModelConfig.from_pretrained(tiny_llama))


def _wait_ready(manager, request):
    deadline = time.monotonic() + 30
    while not manager.ready(request):
        assert time.monotonic() < deadline, "adapter never reached the host cache"
        time.sleep(0.01)


def test_acquire_reserves_pages_and_copy_in_writes_them(tiny_llama, tmp_path):
    adapter = _adapter(tiny_llama, tmp_path)
    config = ModelConfig.from_pretrained(tiny_llama)
    pools = torch.zeros(config.num_layers, 32, 256)
    manager = AdapterManager(LoadedSource([adapter]), config, Pager(32), pools, max_rank=8)
    try:
        first = Request("a", [1, 2, 3], SamplingParams(), adapter_digest=adapter.digest)
        _wait_ready(manager, first)
        load = manager.acquire(first)
        assert load == AdapterLoad(adapter.digest, manager.resident(adapter.digest).pages)
        assert pools.count_nonzero() == 0  # reserved, not copied
        assert manager.counters["copies_in"] == 0
        manager.copy_in([load, load])  # one adapter's load twice in a batch: copied once
        assert pools[:, list(load.page_ids)].count_nonzero() > 0
        assert manager.counters["copies_in"] == 1 and manager.counters["copy_in_seconds"] > 0
        second = Request("b", [1, 2], SamplingParams(), adapter_digest=adapter.digest)
        assert manager.acquire(second) is None  # resident and copied: nothing to copy
        assert manager.counters["copies_in"] == 1
    finally:
        manager.close()


def test_a_copy_that_never_ran_is_issued_again(tiny_llama, tmp_path):
    # A step that fails before its copies (the runner raised) must not leave the adapter
    # resident with empty pages: the next admission carries the copy again.
    adapter = _adapter(tiny_llama, tmp_path)
    config = ModelConfig.from_pretrained(tiny_llama)
    pools = torch.zeros(config.num_layers, 32, 256)
    manager = AdapterManager(LoadedSource([adapter]), config, Pager(32), pools, max_rank=8)
    try:
        first = Request("a", [1, 2, 3], SamplingParams(), adapter_digest=adapter.digest)
        _wait_ready(manager, first)
        load = manager.acquire(first)
        manager.release(first)  # its step failed before copy_in
        second = Request("b", [1, 2], SamplingParams(), adapter_digest=adapter.digest)
        assert manager.acquire(second) == load
        manager.copy_in([load, load])  # one batch may carry the same load twice
        assert pools[:, list(load.page_ids)].count_nonzero() > 0
        third = Request("c", [1], SamplingParams(), adapter_digest=adapter.digest)
        assert manager.acquire(third) is None
    finally:
        manager.close()


def test_the_scheduled_batch_carries_the_copy_the_runner_performs(tiny_llama, tmp_path):
    adapter = _adapter(tiny_llama, tmp_path)
    engine = Engine(EngineConfig(model=str(tiny_llama), num_pages=64,
                                 scheduler=SchedulerConfig(page_size=4)),
                    adapter_source=LoadedSource([adapter]))
    request = engine.add_request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2),
                                 adapter_digest=adapter.digest)
    engine._drain_inbox()
    _wait_ready(engine.adapters, request)
    batch = engine.scheduler.schedule()
    (load,) = batch.adapter_loads
    assert load.digest == adapter.digest and engine.runner.pools.count_nonzero() == 0
    run = engine.runner.run(batch, engine.adapters)
    assert engine.runner.pools[:, list(load.page_ids)].count_nonzero() > 0
    assert run.row_requests == [request] and run.rows_of(request) == [0]
    engine.scheduler.finish(request, request.status.FINISHED_ABORTED)
    engine.outputs.take()
    assert_pages_idle(engine)
    engine.close()


def test_cpu_blocks_are_views_of_the_host_region_equal_to_the_pages(tiny_llama, tmp_path):
    # On a CPU pool the LoRA path reads each block from the host cache's region of the adapter
    # (one contiguous run) rather than copying blocks that cross pages at every copy-in; the
    # region holds the values the pages do.
    from loraplex.kernels import reference

    adapter = _adapter(tiny_llama, tmp_path)
    # one-token pages: some blocks of the adapter cross a page boundary
    engine = Engine(EngineConfig(model=str(tiny_llama), num_pages=256,
                                 scheduler=SchedulerConfig(page_size=1)),
                    adapter_source=LoadedSource([adapter]))
    try:
        request = engine.add_request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3),
                                     adapter_digest=adapter.digest)
        tokens = []
        deadline = time.monotonic() + 60
        while engine.has_unfinished() and time.monotonic() < deadline:
            for out in engine.step():
                tokens += out.new_token_ids
        assert len(tokens) == 3
        resident = engine.adapters.resident(request.adapter_digest)
        region = resident.host_region
        assert region is not None and region.dtype == engine.runner.pools.dtype
        lo = region.untyped_storage().data_ptr()
        hi = lo + region.untyped_storage().nbytes()
        # the forward passes ran on native tables computed from the region's offsets
        # (cpu_lora_native.region_tables) wherever the library loads; the views are made when
        # a path asks for a layer's blocks: the same addresses, row for row
        from loraplex.kernels import cpu_lora_native

        assert resident.groups["qkv"].targeted and resident.groups["qkv"].native is not None
        for name, layers in resident.groups.items():
            tables = layers.native
            resolved = list(layers.layers)  # every layer's views, made now where not yet
            if tables is None or not layers.targeted:
                continue
            assert len(tables.addresses) == len(resolved)
            for layer, group in enumerate(resolved):
                own = cpu_lora_native.module_table(group).table
                assert int(tables.num_modules[layer]) == own.shape[0] > 0, name
                rows = np.ctypeslib.as_array(
                    ctypes.cast(int(tables.addresses[layer]), ctypes.POINTER(ctypes.c_int64)),
                    shape=tuple(own.shape))
                assert rows.tolist() == own.tolist(), (name, layer)
        assert resident.blocks
        pages = torch.tensor(resident.pages)
        layout = resident.layout
        page_elems = engine.runner.pools.shape[2]
        shapes = ModelConfig.from_pretrained(tiny_llama).module_shapes()
        crossing = 0
        for (layer, _), group in resident.blocks.items():
            for m in group.modules:
                for t in (m.a_t, m.bt):
                    assert lo <= t.data_ptr() < hi  # a view, no copy
            pool = engine.runner.pools[layer]
            for module in layout.modules:
                d_in, d_out = shapes[module]
                for off, width in ((layout.a_offsets[module], d_in),
                                   (layout.b_offsets[module], d_out)):
                    rows = reference.region_rows(pool, pages, off, layout.rank, width)
                    view = region[layer, off:off + rows.numel()].view_as(rows)
                    assert torch.equal(rows, view)
                    crossing += off // page_elems != (off + rows.numel() - 1) // page_elems
        assert crossing > 0  # some blocks cross pages: those were copies before
    finally:
        engine.close()
