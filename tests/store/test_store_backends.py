"""Behaviour both backends share (each test runs on fs and on a real redis-server)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from loraplex.adapter_store.blob import blob_size
from loraplex.adapter_store.errors import (
    AdapterNotFound,
    AdapterStoreError,
    AdapterValidationError,
)
from loraplex.adapter_store.format import CanonicalAdapter, build_adapter, load_adapter
from loraplex.adapter_store.store import AdapterSource
from loraplex.server.engine.models.config import LORA_MODULES, ModelConfig

ROUND_TRIPS = {
    # name: (rank, targets, dtype, config overrides)
    "r1-all-fp32": (1, LORA_MODULES, torch.float32, {}),
    "r4-qv-fp16": (4, ("q_proj", "v_proj"), torch.float16, {}),
    "r16-mlp-o-bf16": (16, ("o_proj", "gate_proj", "up_proj", "down_proj"), torch.bfloat16, {}),
    "r8-k-rslora-fp32": (8, ("k_proj",), torch.float32, {"use_rslora": True, "lora_alpha": 16}),
    "r64-all-bf16": (64, LORA_MODULES, torch.bfloat16, {"lora_alpha": 128}),
}


def assert_bit_exact(got: CanonicalAdapter, want: CanonicalAdapter) -> None:
    for f in ("digest", "rank", "lora_alpha", "use_rslora", "scale", "target_modules", "dtype",
              "num_layers", "base_dims"):
        assert getattr(got, f) == getattr(want, f), f
    assert list(got.weights) == list(want.weights)
    for key, (a, b) in want.weights.items():
        ga, gb = got.weights[key]
        for x, y in ((ga, a), (gb, b)):
            assert x.dtype == y.dtype and x.shape == y.shape and x.is_contiguous()
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_round_trip_is_bit_exact(case, store, make_adapter, base_config):
    rank, targets, dtype, overrides = ROUND_TRIPS[case]
    adapter = load_adapter(make_adapter(rank=rank, targets=targets, dtype=dtype, **overrides),
                           base_config)
    written = []
    record = store.put("default", "my-adapter", adapter, uploader="alice",
                       progress=written.append)
    assert sum(written) == blob_size(adapter)
    assert (record.version, record.digest, record.rank, record.dtype) == (
        1, adapter.digest, rank, str(dtype).removeprefix("torch."))
    assert record.target_modules == tuple(targets) and record.nbytes == adapter.nbytes
    assert record.uploader == "alice" and record.created > 0
    assert store.resolve("default", "my-adapter") == record
    assert_bit_exact(store.fetch(record.digest), adapter)
    assert isinstance(store, AdapterSource)


def test_versions_resolve_list_delete(store, make_adapter, base_config):
    a = load_adapter(make_adapter("a", seed=1), base_config)
    b = load_adapter(make_adapter("b", seed=2), base_config)
    assert [store.put("t1", "x", ad).version for ad in (a, b, a)] == [1, 2, 3]
    store.put("t1", "y.v2_final-1", b)
    assert store.resolve("t1", "x").version == 3
    assert store.resolve("t1", "x@2").digest == b.digest
    assert [(r.name, r.version) for r in store.list("t1")] == [
        ("x", 1), ("x", 2), ("x", 3), ("y.v2_final-1", 1)]
    assert [r.version for r in store.delete("t1", "x@3")] == [3]
    assert store.resolve("t1", "x").version == 2
    with pytest.raises(AdapterNotFound):
        store.resolve("t1", "x@3")
    with pytest.raises(AdapterNotFound):
        store.delete("t1", "x@3")
    assert store.put("t1", "x", a).version == 4  # numbers are never reused
    assert [r.version for r in store.delete("t1", "x")] == [1, 2, 4]
    with pytest.raises(AdapterNotFound):
        store.resolve("t1", "x")
    assert [r.name for r in store.list("t1")] == ["y.v2_final-1"]
    assert store.put("t1", "x", a).version == 5
    assert_bit_exact(store.fetch(a.digest), a)  # re-put after deleting: blob written again


def test_tenants_are_isolated_and_nothing_is_revealed(store, make_adapter, base_config):
    adapter = load_adapter(make_adapter(), base_config)
    store.put("acme", "secret", adapter)
    with pytest.raises(AdapterNotFound) as other:
        store.resolve("globex", "secret")
    with pytest.raises(AdapterNotFound) as absent:
        store.resolve("globex", "never-existed")
    assert str(other.value) == str(absent.value).replace("never-existed", "secret")
    with pytest.raises(AdapterNotFound):
        store.delete("globex", "secret")
    assert store.list("globex") == []
    # The same content under another tenant: an ordinary version 1, nothing shared in view.
    mine = store.put("globex", "mine", adapter)
    assert mine.version == 1 and mine.tenant == "globex"
    store.delete("acme", "secret")
    assert_bit_exact(store.fetch(adapter.digest), adapter)  # still referenced by globex
    store.delete("globex", "mine")
    with pytest.raises(AdapterNotFound):
        store.fetch(adapter.digest)


@pytest.mark.parametrize("bad", ["", "A", "../x", "x/y", "-x", ".x", "x" * 129, "x@1", "é"])
def test_bad_names_and_tenants_refused(bad, store, make_adapter, base_config):
    adapter = load_adapter(make_adapter(), base_config)
    with pytest.raises(ValueError):
        store.put("default", bad, adapter)
    with pytest.raises(ValueError):
        store.put(bad, "ok", adapter)
    with pytest.raises(ValueError):
        store.resolve(bad, "ok")
    assert store.list("default") == []


@pytest.mark.parametrize("ref", ["x@0", "x@-1", "x@abc", "x@", "x@1@2", "x@01"])
def test_bad_refs_refused(ref, store):
    with pytest.raises(ValueError):
        store.resolve("default", ref)


def test_fetch_unknown_and_malformed_digest(store):
    with pytest.raises(AdapterNotFound):
        store.fetch("0" * 64)
    for bad in ("0" * 63, "G" * 64, "../" + "0" * 61):
        with pytest.raises(ValueError):
            store.fetch(bad)


def test_base_model_mismatch(store_factory, make_adapter, base_config, kit):
    other = ModelConfig.from_hf_dict({**kit.tiny_llama, "num_attention_heads": 2,
                                      "num_key_value_heads": 1, "head_dim": 16})
    adapter = load_adapter(make_adapter(), base_config)
    with pytest.raises(AdapterValidationError):
        store_factory(other).put("default", "x", adapter)
    store_factory(base_config).put("default", "x", adapter)
    with pytest.raises(AdapterStoreError):
        store_factory(other).fetch(adapter.digest)


def test_wrong_digest_is_never_stored(store, make_adapter, base_config):
    adapter = load_adapter(make_adapter(), base_config)
    forged = dataclasses.replace(adapter, digest="ab" * 32)
    with pytest.raises(AdapterValidationError):
        store.put("default", "x", forged)
    assert store.list("default") == []
    with pytest.raises(AdapterNotFound):
        store.fetch("ab" * 32)


def test_concurrent_puts_of_one_name_get_distinct_versions(store_factory, make_adapter,
                                                           base_config):
    adapters = [load_adapter(make_adapter(f"a{i}", seed=i), base_config) for i in range(8)]
    results: list[int] = []
    errors: list[BaseException] = []

    def put(adapter):
        try:
            results.append(store_factory().put("default", "hot", adapter).version)
        except BaseException as e:  # surfaced below
            errors.append(e)
    threads = [threading.Thread(target=put, args=(a,)) for a in adapters]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(results) == list(range(1, 9))
    store = store_factory()
    by_version = {r.version: r.digest for r in store.versions("default", "hot")}
    assert sorted(by_version.values()) == sorted(a.digest for a in adapters)
    for adapter in adapters:
        assert_bit_exact(store.fetch(adapter.digest), adapter)


def test_built_adapters_round_trip(store, base_config):
    gen = torch.Generator().manual_seed(0)
    shapes = base_config.module_shapes()
    weights = {(layer, m): (torch.randn(2, shapes[m][0], generator=gen),
                            torch.randn(shapes[m][1], 2, generator=gen))
               for layer in range(base_config.num_layers) for m in ("up_proj", "q_proj")}
    adapter = build_adapter(weights, rank=2, lora_alpha=1.0, base_config=base_config)
    assert adapter.target_modules == ("q_proj", "up_proj")
    record = store.put("default", "built", adapter)
    assert_bit_exact(store.fetch(record.digest), adapter)
