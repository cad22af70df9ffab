"""An adapter warmed into the host cache ahead of its first request (``AdapterManager.warm``,
the worker's ``Prefetch``): loaded without a request, never evicting, first out; and the load
path's page-region layout and finiteness check."""

from __future__ import annotations

import time

import pytest
import torch

from loraplex.adapter_store.format import load_adapter
from loraplex.server.engine.adapter_cache import AdapterManager, _all_finite, flatten_adapter
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.pager import Pager
from loraplex.server.engine.request import Request, SamplingParams
from tests.engine.test_fault_isolation import write_huge_adapter
from tests.engine.test_lora_parity import LoadedSource


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("warm")
    config = ModelConfig.from_pretrained(tiny_llama)
    return [load_adapter(write_huge_adapter(root / f"a{i}", tiny_llama, value=0.01 * (i + 1)),
                         config) for i in range(3)]


def _manager(tiny_llama, adapters, host_cache_bytes=4 << 30, source=None):
    config = ModelConfig.from_pretrained(tiny_llama)
    pools = torch.zeros(config.num_layers, 32, 256)
    return AdapterManager(source or LoadedSource(adapters), config, Pager(32), pools,
                          max_rank=8, host_cache_bytes=host_cache_bytes)


def _wait(predicate, what):
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _idle(manager, digest):
    return not manager.is_loading(digest)


def _load_for_a_request(manager, adapter, rid="r"):
    request = Request(rid, [1, 2], SamplingParams(), adapter_digest=adapter.digest)
    _wait(lambda: manager.ready(request), "adapter never reached the host cache")


def test_warm_loads_into_the_host_cache_without_a_request(tiny_llama, adapters):
    a = adapters[0]
    manager = _manager(tiny_llama, adapters)
    try:
        assert manager.warm(a.digest) is True
        _wait(lambda: a.digest in manager.host_digests(), "warm load never landed")
        assert manager.warm(a.digest) is False  # cached: nothing started
        assert manager.counters["warm_loads"] == 1 and manager.counters["host_misses"] == 0
        # its request finds it cached: admitted at once, no second fetch
        request = Request("r", [1, 2], SamplingParams(), adapter_digest=a.digest)
        assert manager.ready(request)
        assert manager.source.fetches == [a.digest]
    finally:
        manager.close()


def test_a_warm_load_never_evicts_and_goes_first(tiny_llama, adapters):
    a, b, c = adapters
    one = flatten_adapter(a, ModelConfig.from_pretrained(tiny_llama), torch.float32, 8).nbytes
    # room for exactly one adapter: the warm one is dropped, the used one stays
    manager = _manager(tiny_llama, adapters, host_cache_bytes=one)
    try:
        _load_for_a_request(manager, a)
        assert manager.warm(b.digest)
        _wait(lambda: _idle(manager, b.digest), "warm load never ended")
        assert manager.host_digests() == (a.digest,)
        assert manager.counters["warm_dropped"] == 1
    finally:
        manager.close()
    # room for two: the warm one goes in as the least recently used, so the next load evicts
    # it and not the adapter a request used
    manager = _manager(tiny_llama, adapters, host_cache_bytes=2 * one)
    try:
        _load_for_a_request(manager, a)
        assert manager.warm(b.digest)
        _wait(lambda: b.digest in manager.host_digests(), "warm load never landed")
        assert manager.host_digests() == (b.digest, a.digest)
        _load_for_a_request(manager, c, "r2")
        assert manager.host_digests() == (a.digest, c.digest)
        assert manager.counters["warm_dropped"] == 0
    finally:
        manager.close()


def test_a_failed_warm_load_is_retried_by_the_request_that_needs_it(tiny_llama, adapters):
    source = LoadedSource(adapters[:1])
    manager = _manager(tiny_llama, adapters, source=source)
    missing = adapters[1].digest
    try:
        assert manager.warm(missing)
        _wait(lambda: _idle(manager, missing), "warm load never ended")
        assert manager.take_failures() == {}  # kept, it would fail a later request unretried
        assert manager.counters["load_failures"] == 1
        # a request for it starts its own load, whose failure is the request's
        request = Request("r", [1, 2], SamplingParams(), adapter_digest=missing)
        assert not manager.ready(request)
        _wait(lambda: _idle(manager, missing), "the request's load never ended")
        failures = manager.take_failures()
        assert list(failures) == [missing] and "failed to load" in failures[missing]
        assert source.fetches == [missing, missing]
    finally:
        manager.close()


def test_flatten_lays_each_module_where_its_layout_says(tiny_llama, adapters):
    config = ModelConfig.from_pretrained(tiny_llama)
    adapter = adapters[2]
    for dtype in (torch.float32, torch.bfloat16):
        host = flatten_adapter(adapter, config, dtype, max_rank=8)
        want = torch.zeros_like(host.flat)
        rank = adapter.rank
        for (layer, module), (a, b) in adapter.weights.items():
            off = host.layout.a_offsets[module]
            want[layer, off:off + a.numel()] = a.to(dtype).reshape(-1)
            off = host.layout.b_offsets[module]
            want[layer, off:off + b.numel()] = b.to(dtype).t().reshape(-1)
        assert rank == 4 and torch.equal(host.flat, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_all_finite_from_exponent_bits_agrees_with_isfinite_on_every_pattern(dtype):
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.isfinite(every)
    assert not bool(finite.all()) and bool(finite.any())
    assert _all_finite(every[finite])
    for i in torch.nonzero(~finite).flatten()[::97].tolist():
        t = every[finite][:1000].clone()
        t[i % 1000] = every[i]
        assert not _all_finite(t), every[i]


def test_all_finite_float32_and_other_dtypes():
    x = torch.randn(1000)
    assert _all_finite(x) and _all_finite(x.double()) and _all_finite(x[::2])
    for bad in (float("inf"), float("-inf"), float("nan")):
        for t in (x.clone(), x.double()):
            t[17] = bad
            assert not _all_finite(t)
            assert not _all_finite(t[1::2])  # strided: torch's own check
    big = torch.tensor([3.4e38, -3.4e38, 1e-45])
    assert _all_finite(big) and not _all_finite(big.to(torch.float16))
