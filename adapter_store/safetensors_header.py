"""An uploaded safetensors file: its header checked by us, its tensors parsed by the library.

The library is the parser of record, but it trusts the sizes a header claims. So before it
runs, we read the header ourselves and bound everything that would be allocated: the header
length, each tensor's shape against its byte range, byte ranges against the file, and the
total against the cap. Only float32, float16 and bfloat16 tensors pass.
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

import safetensors.torch
import torch

from loraplex.adapter_store.errors import AdapterValidationError

MAX_HEADER_BYTES = 4 << 20
MAX_TENSOR_DIMS = 8
ST_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
}
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}


def load_safetensors(data: bytes, *, file: str, max_bytes: int) -> dict[str, torch.Tensor]:
    """Check a safetensors file's header, then parse it with the safetensors library.

    Args:
        data: the whole file.
        file: its name, for errors.
        max_bytes: the largest total tensor size accepted.

    Returns:
        Tensor name -> CPU tensor, in the file's dtypes.

    Raises:
        AdapterValidationError: naming the file and the header field or tensor.
    """
    check_header(data, file=file, max_bytes=max_bytes)
    try:
        return safetensors.torch.load(data)
    except Exception as e:  # the library raises its own SafetensorError, or ValueError
        _fail(file, "", f"not a valid safetensors file ({str(e)[:120]})")


def check_header(data: bytes, *, file: str, max_bytes: int) -> None:
    """Bound every size a safetensors header claims, without allocating any tensor.

    Raises:
        AdapterValidationError: a header over ``MAX_HEADER_BYTES`` or past the end of the
            file, a dtype other than F32/F16/BF16, a byte range outside the data, a shape
            whose size does not match its byte range, or a total over ``max_bytes``.
    """
    if len(data) < 8:
        _fail(file, "header", "too short to be a safetensors file")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > MAX_HEADER_BYTES:
        _fail(file, "header", f"claims {header_len} bytes, over the {MAX_HEADER_BYTES}-byte "
              "limit")
    if 8 + header_len > len(data):
        _fail(file, "header", f"claims {header_len} bytes but the file holds {len(data)}")
    header = _parse_header(data[8:8 + header_len], file)
    data_len = len(data) - 8 - header_len
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            if entry is not None and not (isinstance(entry, dict) and all(
                    isinstance(v, str) for v in entry.values())):
                _fail(file, "__metadata__", "must map strings to strings")
            continue
        field = f"tensor {name!r:.120}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            _fail(file, field, "entry must hold exactly dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in ST_DTYPES:
            _fail(file, field, f"dtype {dtype!r:.20} is not float32, float16 or bfloat16")
        if (not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS
                or not all(_is_count(d) for d in shape)):
            _fail(file, field, f"shape {shape!r:.80} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_count(o) for o in offsets)
                or not offsets[0] <= offsets[1] <= data_len):
            _fail(file, field, f"data_offsets {offsets!r:.80} fall outside the file's "
                  f"{data_len} data bytes")
        nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        if nbytes != offsets[1] - offsets[0]:
            _fail(file, field, f"shape {shape} needs {nbytes} bytes but data_offsets span "
                  f"{offsets[1] - offsets[0]}")
        total += nbytes
        if total > max_bytes:
            _fail(file, "size", f"tensors exceed the {max_bytes}-byte cap")


def _parse_header(raw: bytes, file: str) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_pairs_unique)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        _fail(file, "header", f"not valid UTF-8 JSON ({str(e)[:80]})")
    except KeyError as e:
        _fail(file, "header", f"duplicate key {e.args[0]!r:.120}")
    if not isinstance(header, dict):
        _fail(file, "header", "must be a JSON object")
    return header


def _pairs_unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise KeyError(k)
        out[k] = v
    return out


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _fail(file: str, field: str, reason: str) -> NoReturn:
    raise AdapterValidationError(file, field, reason)
