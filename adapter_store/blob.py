"""A canonical adapter as one blob: a safetensors file that its digest fully determines.

    blob = u64le(N) || safetensors JSON header (N bytes) || tensor data, canonical order

The data region is exactly the tensor bytes the digest hashes, and the safetensors header is a
deterministic function of the canonical header, which it carries in
``__metadata__["loraplex.adapter"]``. Verifying a blob therefore means: regenerate the header
we would have written, compare it byte for byte, and hash ``canonical header || data`` against
the digest. Any safetensors reader can open a blob; nothing in it is pickled.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from types import MappingProxyType
from typing import Any, NoReturn

import torch

from loraplex.adapter_store.errors import AdapterStoreError, AdapterValidationError
from loraplex.adapter_store.format import (
    DTYPE_NAMES,
    FORMAT_VERSION,
    CanonicalAdapter,
    canonical_header,
    effective_scale,
    tensor_bytes,
)
from loraplex.server.engine.models.config import LORA_MODULES, ModelConfig

METADATA_KEY = "loraplex.adapter"
MAX_BLOB_HEADER_BYTES = 4 << 20
_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
_HEADER_KEYS = {"base_dims", "dtype", "format_version", "lora_alpha", "r", "scale",
                "target_modules", "use_rslora"}
_DIM_KEYS = {"hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
             "head_dim"}


def blob_prefix(adapter: CanonicalAdapter) -> bytes:
    """The blob's first bytes: ``u64le(N)`` and the padded safetensors header."""
    return _prefix(adapter.header(), adapter.rank, adapter.dtype, adapter.target_modules,
                   _module_shapes(dict(adapter.base_dims)), adapter.num_layers)


def blob_size(adapter: CanonicalAdapter) -> int:
    """Bytes of the adapter's blob."""
    return len(blob_prefix(adapter)) + adapter.nbytes


def blob_pieces(adapter: CanonicalAdapter) -> Iterator[bytes | memoryview]:
    """The blob as consecutive pieces (header, then each tensor's bytes), without copies."""
    yield blob_prefix(adapter)
    for t in adapter.tensors():
        yield tensor_bytes(t)


def verified_pieces(adapter: CanonicalAdapter) -> Iterator[bytes | memoryview]:
    """:func:`blob_pieces`, hashing as they go; at the end, refuse a digest that is wrong.

    Stores write through this so that no blob is ever stored under a digest it does not
    have. Consume it fully before committing anything.

    Raises:
        AdapterValidationError: (after the last piece) the tensors do not hash to the digest.
    """
    header = adapter.header()
    h = hashlib.sha256(len(header).to_bytes(8, "little"))
    h.update(header)
    pieces = blob_pieces(adapter)
    yield next(pieces)
    for piece in pieces:
        h.update(piece)
        yield piece
    if h.hexdigest() != adapter.digest:
        raise AdapterValidationError("adapter", "digest", f"{adapter.digest} does not match "
                                     f"the content ({h.hexdigest()})")


def adapter_to_blob(adapter: CanonicalAdapter) -> bytes:
    """The whole blob in memory (small adapters, tests); stores stream :func:`blob_pieces`."""
    return b"".join(blob_pieces(adapter))


def rechunk(pieces: Iterable[bytes | memoryview], chunk_bytes: int) -> Iterator[bytearray]:
    """Regroup a byte stream into chunks of exactly ``chunk_bytes`` (the last one shorter).

    Each chunk is a fresh buffer (one copy of the data, no more); callers may keep it.
    """
    buf, filled = bytearray(chunk_bytes), 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        while len(view):
            take = min(chunk_bytes - filled, len(view))
            buf[filled:filled + take] = view[:take]
            filled += take
            view = view[take:]
            if filled == chunk_bytes:
                yield buf
                buf, filled = bytearray(chunk_bytes), 0
    if filled:
        del buf[filled:]
        yield buf


def adapter_from_blob(blob: bytes | bytearray, digest: str) -> CanonicalAdapter:
    """Verify a blob against its digest and decode it.

    The tensors are views into ``blob`` when it is a ``bytearray`` (no copy).

    Args:
        blob: the stored bytes.
        digest: the digest the blob is stored under.

    Returns:
        The adapter, whose digest is ``digest``.

    Raises:
        AdapterStoreError: the blob is malformed or does not hash to ``digest``.
    """
    if isinstance(blob, bytes):
        blob = bytearray(blob)  # tensors must not alias an immutable buffer
    if len(blob) < 8:
        _corrupt(digest, "shorter than a safetensors header")
    n = int.from_bytes(blob[:8], "little")
    if n > MAX_BLOB_HEADER_BYTES or 8 + n > len(blob):
        _corrupt(digest, f"header length {n} is out of range")
    try:
        st_header = json.loads(bytes(blob[8:8 + n]))
        header = st_header["__metadata__"][METADATA_KEY].encode()
        fields = _parse_header(header)
        shapes = _module_shapes(fields["base_dims"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        _corrupt(digest, f"unreadable header ({str(e)[:80]})")
    rank, dtype = fields["r"], _DTYPES[fields["dtype"]]
    targets, dims = tuple(fields["target_modules"]), fields["base_dims"]
    num_layers = dims["num_layers"]
    prefix = _prefix(header, rank, dtype, targets, shapes, num_layers)
    if bytes(blob[:len(prefix)]) != prefix:
        _corrupt(digest, "safetensors header is not the canonical one")
    itemsize = torch.empty((), dtype=dtype).element_size()
    data_len = sum(rank * (d_in + d_out) for m, (d_in, d_out) in shapes.items()
                   if m in targets) * num_layers * itemsize
    if len(blob) != len(prefix) + data_len:
        _corrupt(digest, f"{len(blob)} bytes, expected {len(prefix) + data_len}")
    h = hashlib.sha256(len(header).to_bytes(8, "little"))
    h.update(header)
    h.update(memoryview(blob)[len(prefix):])
    if h.hexdigest() != digest:
        _corrupt(digest, f"content hashes to {h.hexdigest()}")

    weights = {}
    offset = len(prefix)
    for layer in range(num_layers):
        for module in targets:
            d_in, d_out = shapes[module]
            pair = []
            for shape in ((rank, d_in), (d_out, rank)):
                count = shape[0] * shape[1]
                pair.append(torch.frombuffer(blob, dtype=dtype, count=count, offset=offset)
                            .view(shape))
                offset += count * itemsize
            weights[(layer, module)] = (pair[0], pair[1])
    return CanonicalAdapter(
        digest=digest, rank=rank, lora_alpha=fields["lora_alpha"],
        use_rslora=fields["use_rslora"], scale=fields["scale"], target_modules=targets,
        dtype=dtype, num_layers=num_layers, weights=MappingProxyType(weights),
        base_dims=tuple(sorted(dims.items())))


def _prefix(header: bytes, rank: int, dtype: torch.dtype, targets: tuple[str, ...],
            shapes: dict[str, tuple[int, int]], num_layers: int) -> bytes:
    itemsize = torch.empty((), dtype=dtype).element_size()
    doc: dict[str, Any] = {"__metadata__": {"format": "pt", METADATA_KEY: header.decode()}}
    offset = 0
    for layer in range(num_layers):
        for module in targets:
            d_in, d_out = shapes[module]
            for half, shape in (("A", [rank, d_in]), ("B", [d_out, rank])):
                size = shape[0] * shape[1] * itemsize
                doc[f"layers.{layer}.{module}.lora_{half}"] = {
                    "dtype": _ST_DTYPE[dtype], "shape": shape,
                    "data_offsets": [offset, offset + size]}
                offset += size
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned, as safetensors pads
    return len(raw).to_bytes(8, "little") + raw


def _parse_header(header: bytes) -> dict[str, Any]:
    fields = json.loads(header)
    if not isinstance(fields, dict) or set(fields) != _HEADER_KEYS:
        raise ValueError("header keys")
    if fields["format_version"] != FORMAT_VERSION:
        raise ValueError(f"format_version {fields['format_version']!r} is not supported")
    targets = fields["target_modules"]
    dims = fields["base_dims"]
    if (not isinstance(targets, list) or not targets
            or targets != [m for m in LORA_MODULES if m in targets]
            or fields["dtype"] not in _DTYPES or not isinstance(dims, dict)
            or set(dims) != _DIM_KEYS or not all(type(v) is int for v in dims.values())
            or type(fields["r"]) is not int or fields["r"] < 1
            or type(fields["use_rslora"]) is not bool
            or type(fields["lora_alpha"]) is not float):
        raise ValueError("header fields")
    canonical = canonical_header(rank=fields["r"], lora_alpha=fields["lora_alpha"],
                                 use_rslora=fields["use_rslora"],
                                 target_modules=tuple(targets),
                                 dtype=_DTYPES[fields["dtype"]], base_dims=dims)
    if canonical != header or fields["scale"] != effective_scale(
            fields["lora_alpha"], fields["r"], fields["use_rslora"]):
        raise ValueError("header is not canonical")
    return fields


def _module_shapes(dims: dict[str, int]) -> dict[str, tuple[int, int]]:
    try:
        base = ModelConfig(architecture="llama", vocab_size=1, max_position_embeddings=1,
                           **dims)
    except (TypeError, ValueError) as e:
        raise ValueError(f"base_dims: {e}") from e
    return base.module_shapes()


def _corrupt(digest: str, reason: str) -> NoReturn:
    raise AdapterStoreError(f"adapter blob {digest}: corrupt: {reason}")
