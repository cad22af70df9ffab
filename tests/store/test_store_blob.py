"""Blobs: plain safetensors, fully determined by the digest; any change is caught."""

from __future__ import annotations

import dataclasses

import pytest
import safetensors.torch
import torch

from loraplex.adapter_store.blob import (
    adapter_from_blob,
    adapter_to_blob,
    blob_size,
    rechunk,
    verified_pieces,
)
from loraplex.adapter_store.errors import AdapterStoreError, AdapterValidationError
from loraplex.adapter_store.format import load_adapter
from loraplex.server.engine.models.config import LORA_MODULES


@pytest.fixture
def adapter(make_adapter, base_config):
    return load_adapter(make_adapter(rank=3, targets=LORA_MODULES, dtype=torch.bfloat16),
                        base_config)


def test_blob_is_safetensors_with_canonical_names(adapter):
    blob = adapter_to_blob(adapter)
    assert len(blob) == blob_size(adapter)
    assert (8 + int.from_bytes(blob[:8], "little")) % 8 == 0  # data is 8-byte aligned
    tensors = safetensors.torch.load(blob)
    for (layer, module), (a, b) in adapter.weights.items():
        assert torch.equal(tensors[f"layers.{layer}.{module}.lora_A"], a)
        assert torch.equal(tensors[f"layers.{layer}.{module}.lora_B"], b)
    decoded = adapter_from_blob(blob, adapter.digest)
    assert decoded == adapter and decoded.scale == adapter.scale
    assert decoded.nbytes == adapter.nbytes and decoded.dtype == torch.bfloat16


def test_every_byte_matters(adapter):
    blob = adapter_to_blob(adapter)
    header_end = 8 + int.from_bytes(blob[:8], "little")
    positions = sorted({0, 3, 9, 40, header_end // 2, header_end - 2, header_end - 1,
                        header_end, header_end + 1, len(blob) // 2, len(blob) - 1})
    for pos in positions:
        for flip in (0x01, 0x80):
            damaged = bytearray(blob)
            damaged[pos] ^= flip
            with pytest.raises(AdapterStoreError):
                adapter_from_blob(damaged, adapter.digest)
    for damaged in (blob[:-1], blob + b"\0", blob[:7], b""):
        with pytest.raises(AdapterStoreError):
            adapter_from_blob(damaged, adapter.digest)
    with pytest.raises(AdapterStoreError):
        adapter_from_blob(blob, "0" * 64)


def test_verified_pieces_refuse_a_wrong_digest(adapter):
    assert b"".join(verified_pieces(adapter)) == adapter_to_blob(adapter)
    with pytest.raises(AdapterValidationError, match="digest"):
        b"".join(verified_pieces(dataclasses.replace(adapter, digest="0" * 64)))


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_rechunk(chunk):
    pieces = [b"abc", memoryview(b""), memoryview(bytearray(b"defghij")), b"k" * 100]
    chunks = list(rechunk(pieces, chunk))
    assert b"".join(chunks) == b"".join(bytes(p) for p in pieces)
    assert all(len(c) == chunk for c in chunks[:-1]) and 0 < len(chunks[-1]) <= chunk
