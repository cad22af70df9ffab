"""DirectoryAdapterSource: a plain folder of adapter directories, served by digest."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.adapter_store.errors import AdapterNotFound, AdapterStoreError
from loraplex.adapter_store.format import load_adapter
from loraplex.adapter_store.store import AdapterSource, DirectoryAdapterSource


def test_serves_every_valid_subdirectory(tmp_path, base_config, kit):
    root = tmp_path / "adapters"
    for i, (rank, dtype) in enumerate([(2, torch.float32), (8, torch.float16)]):
        kit.write_adapter(root / f"a{i}", kit.lora_tensors(base_config, rank=rank, dtype=dtype,
                                                           seed=i), kit.lora_config(r=rank))
    kit.write_adapter(root / "broken", kit.lora_tensors(base_config), kit.lora_config(r=7))
    (root / "notes.txt").write_text("not an adapter")
    source = DirectoryAdapterSource(root, base_config)
    assert isinstance(source, AdapterSource)
    assert sorted(source.names()) == ["a0", "a1"]
    assert "differs from r=7" in source.errors["broken"]
    for name, digest in source.names().items():
        want = load_adapter(root / name, base_config)
        got = source.fetch(digest)
        assert got.digest == digest == want.digest == source.digest_of(name)
        for (a, b), (wa, wb) in zip(got.weights.values(), want.weights.values()):
            assert torch.equal(a, wa) and torch.equal(b, wb)
    with pytest.raises(AdapterNotFound):
        source.fetch("0" * 64)
    with pytest.raises(AdapterNotFound):
        source.digest_of("broken")


def test_changes_on_disk_are_caught_and_refresh_picks_them_up(tmp_path, base_config, kit):
    root = tmp_path / "adapters"
    kit.write_adapter(root / "a", kit.lora_tensors(base_config), kit.lora_config())
    source = DirectoryAdapterSource(root, base_config)
    digest = source.digest_of("a")
    cfg = json.loads((root / "a" / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 32
    (root / "a" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterStoreError, match="changed"):
        source.fetch(digest)
    source.refresh()
    assert source.digest_of("a") != digest
    assert source.fetch(source.digest_of("a")).lora_alpha == 32.0
