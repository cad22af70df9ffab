"""Every name, tenant, version, digest and key-hash pattern is matched whole: a trailing
newline, a NUL or a Unicode look-alike never passes (``re.match`` with ``$`` lets ``"x\\n"``
through; ``fullmatch`` does not)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from loraplex.adapter_store.errors import AdapterValidationError
from loraplex.adapter_store.format import load_adapter
from loraplex.adapter_store.fs_store import FsAdapterStore
from loraplex.adapter_store.store import check_digest, check_name, parse_ref
from loraplex.server.auth import hash_key, parse_keys
from tests.store.conftest import lora_config, lora_tensors, write_adapter

DIGEST = "ab" * 32
HOSTILE_NAMES = ["evil\n", "b\n", "evil\r\n", "evil\x00", "\x00", "ev\x00il",
                 "\u0430dapter",  # Cyrillic a
                 "adapter\u00a0", "\uff11\uff12",  # fullwidth 12
                 "adapter\u200b",  # zero-width space
                 "\ufeffadapter", "a" * 129]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_names_and_tenants_are_matched_whole(name: str) -> None:
    with pytest.raises(ValueError, match="must match"):
        check_name(name)
    with pytest.raises(ValueError, match="tenant"):
        check_name(name, "tenant")
    with pytest.raises(ValueError):
        parse_ref(name)
    with pytest.raises(ValueError):
        parse_ref(f"{name}@1")


@pytest.mark.parametrize("version", ["1\n", "1\x00", "\uff11", "\u0661", "01", "1 ", "+1",
                                     "1\u200b"])
def test_versions_are_matched_whole(version: str) -> None:
    with pytest.raises(ValueError, match="version"):
        parse_ref(f"alpha@{version}")


@pytest.mark.parametrize("digest", [DIGEST + "\n", DIGEST + "\x00", DIGEST[:-1] + "\uff41",
                                    DIGEST[:-1] + "\u0430", "\n" + DIGEST, DIGEST.upper()])
def test_digests_are_matched_whole(digest: str) -> None:
    with pytest.raises(ValueError, match="digest"):
        check_digest(digest)
    assert check_digest(DIGEST) == DIGEST


def test_store_refuses_a_trailing_newline(tmp_path: Path, base_config, make_adapter) -> None:
    store = FsAdapterStore(tmp_path / "store", base_config)
    adapter = load_adapter(make_adapter("ok"), base_config)
    for tenant, name in (("default", "evil\n"), ("b\n", "alpha"), ("default", "ev\x00il")):
        with pytest.raises(ValueError):
            store.put(tenant, name, adapter)
    assert store.list("default") == []
    with pytest.raises(ValueError):
        store.fetch(adapter.digest + "\n")


def test_key_file_hashes_tenants_and_limits_are_matched_whole() -> None:
    h = hash_key("some-key")
    good = parse_keys(f"{h} acme tokens_per_minute=100\n", "keys")
    assert [(e.identity.tenant, e.limits) for e in good] == [("acme", (("tokens_per_minute",
                                                                          100),))]
    # A hash with a trailing NUL, a Cyrillic tenant, fullwidth digits in a limit: all skipped.
    assert parse_keys(f"{h}\x00 acme\n", "keys") == []
    assert parse_keys(f"{h} \u0430cme\n", "keys") == []
    assert parse_keys(f"{h} acme tokens_per_minute=\uff11\uff10\n", "keys") == []
    assert parse_keys(f"sha256:{h}x acme\n", "keys") == []


def test_declared_checksums_and_tensor_names_are_matched_whole(tmp_path: Path,
                                                               base_config) -> None:
    tensors = lora_tensors(base_config, dtype=torch.float32)
    path = write_adapter(tmp_path / "a", tensors, lora_config(), readme=False)
    sums = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()}
    load_adapter(path, base_config, declared_sha256=sums)
    for bad in (sums["adapter_config.json"] + "\n", sums["adapter_config.json"] + "\x00"):
        with pytest.raises(AdapterValidationError, match="sha256"):
            load_adapter(path, base_config, declared_sha256={**sums, "adapter_config.json": bad})
    # A tensor name with a trailing newline is not a PEFT LoRA weight.
    renamed = {(k + "\n" if i == 0 else k): v for i, (k, v) in enumerate(tensors.items())}
    bad_dir = write_adapter(tmp_path / "b", renamed, lora_config(), readme=False)
    with pytest.raises(AdapterValidationError, match="not a LoRA weight"):
        load_adapter(bad_dir, base_config)
    # A target module entry with a trailing newline names no module.
    cfg_dir = write_adapter(tmp_path / "c", tensors, lora_config(target_modules=["q_proj\n",
                                                                                 "v_proj"]),
                            readme=False)
    with pytest.raises(AdapterValidationError, match="target_modules"):
        load_adapter(cfg_dir, base_config)
    assert json.loads((cfg_dir / "adapter_config.json").read_text())["target_modules"][0] \
        == "q_proj\n"
