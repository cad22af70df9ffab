"""The files of an uploaded PEFT adapter directory, read safely.

A directory holds exactly ``adapter_config.json`` and ``adapter_model.safetensors``, and may
hold a ``README.md`` (read for its checksum, otherwise ignored). Everything else is refused
before a byte of any file is read: pickled weights (never unpickled), code, tokenizers,
sub-directories, symlinks, special files. Files are opened with ``O_NOFOLLOW`` and checked to
be regular files of the size listed, so a file swapped for a symlink or a FIFO after the
listing is refused too.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from loraplex.adapter_store.errors import AdapterValidationError
from loraplex.adapter_store.peft_config import CONFIG_FILE, MAX_CONFIG_BYTES

WEIGHTS_FILE = "adapter_model.safetensors"
README_FILE = "README.md"
ALLOWED_FILES = (CONFIG_FILE, WEIGHTS_FILE, README_FILE)
MAX_README_BYTES = 1 << 20

_PICKLE_LIKE = frozenset({
    ".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz", ".gguf",
    ".ggml", ".h5", ".msgpack", ".onnx", ".tar", ".zip",
})
_CODE = frozenset({".py", ".pyc", ".pyo", ".so", ".dll", ".dylib", ".sh", ".js", ".ipynb"})
_TOKENIZER = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
    "chat_template.jinja", "chat_template.json",
})
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class AdapterFiles:
    """The bytes of an adapter directory's files.

    Attributes:
        config: ``adapter_config.json``.
        weights: ``adapter_model.safetensors``.
        sha256: hex sha256 of every file, by name, when checksums were declared (else empty).
    """

    config: bytes
    weights: bytes
    sha256: Mapping[str, str]


def check_file_name(name: str) -> str:
    """Refuse a file name that is not one of the accepted plain names.

    Traversal (``../x``), absolute paths, separators, NUL bytes and any name outside
    :data:`ALLOWED_FILES` are refused with a reason that says which rule it broke.

    Raises:
        AdapterValidationError: naming the file.
    """
    shown = repr(name)[1:-1][:100]
    if not isinstance(name, str) or not name:
        _fail(shown, "file name", "empty")
    if "\x00" in name or "/" in name or "\\" in name or os.path.isabs(name) or name in (".", ".."):
        _fail(shown, "file name", "must be a plain file name (no path, traversal or NUL)")
    if name not in ALLOWED_FILES:
        _refuse_extra(name)
    return name


def read_adapter_files(
    path: str | os.PathLike[str],
    *,
    max_weights_bytes: int,
    declared_sha256: Mapping[str, str] | None = None,
) -> AdapterFiles:
    """List and read an adapter directory, refusing anything but the accepted files.

    Args:
        path: the directory (itself not a symlink).
        max_weights_bytes: the largest ``adapter_model.safetensors`` accepted.
        declared_sha256: if given, the sha256 the client declared for each file it sent; the
            names must be exactly the files present and every checksum must match.

    Returns:
        The files' bytes and checksums.

    Raises:
        AdapterValidationError: naming the file and the rule it broke.
    """
    root = Path(path)
    if root.is_symlink():
        _fail(str(root), "directory", "symlinks are not accepted")
    if not root.is_dir():
        _fail(str(root), "directory", "not a directory")
    sizes: dict[str, int] = {}
    with os.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        if entry.is_symlink():
            _fail(entry.name, "file", "symlinks are not accepted")
        if entry.name not in ALLOWED_FILES:
            _refuse_extra(entry.name)
        st = entry.stat(follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            _fail(entry.name, "file", "not a regular file")
        sizes[entry.name] = st.st_size
    for required in (CONFIG_FILE, WEIGHTS_FILE):
        if required not in sizes:
            _fail(required, "file", "missing")
    limits = {CONFIG_FILE: MAX_CONFIG_BYTES, WEIGHTS_FILE: max_weights_bytes,
              README_FILE: MAX_README_BYTES}
    for name, size in sizes.items():
        if size > limits[name]:
            _fail(name, "size", f"{size} bytes, over the {limits[name]}-byte limit")
    declared = _check_declared(declared_sha256, sizes) if declared_sha256 is not None else None

    contents: dict[str, bytes] = {}
    sha256: dict[str, str] = {}
    for name, size in sizes.items():
        data = _read_regular_file(root / name, name, size)
        if declared is not None:
            sha256[name] = hashlib.sha256(data).hexdigest()
            if sha256[name] != declared[name]:
                _fail(name, "sha256", f"is {sha256[name]}, the client declared {declared[name]}")
        contents[name] = data
    return AdapterFiles(config=contents[CONFIG_FILE], weights=contents[WEIGHTS_FILE],
                        sha256=sha256)


def write_upload(directory: str | os.PathLike[str], files: Mapping[str, bytes]) -> None:
    """Stage uploaded files into an empty directory for :func:`load_adapter`.

    Every name is checked with :func:`check_file_name` before anything is written; files are
    created exclusively (``O_EXCL | O_NOFOLLOW``), never through a link.

    Raises:
        AdapterValidationError: a refused file name.
    """
    for name in files:
        check_file_name(name)
    for name, data in files.items():
        fd = os.open(os.path.join(directory, name),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)


def _check_declared(declared: Mapping[str, str], sizes: Mapping[str, int]) -> dict[str, str]:
    out = {}
    for name, digest in declared.items():
        check_file_name(name)
        if name not in sizes:
            _fail(name, "sha256", "declared for a file that was not uploaded")
        if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
            _fail(name, "sha256", "must be 64 lowercase hex digits")
        out[name] = digest
    for name in sizes:
        if name not in out:
            _fail(name, "sha256", "no checksum declared for this file")
    return out


def _read_regular_file(path: Path, name: str, size: int) -> bytes:
    # O_NONBLOCK: opening a FIFO swapped in after the listing must not hang.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        _fail(name, "file", f"cannot be opened ({e.strerror})")
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            _fail(name, "file", "changed while it was read")
        data = f.read(size)
        if len(data) != size or f.read(1):
            _fail(name, "file", "changed while it was read")
    return data


def _refuse_extra(name: str) -> NoReturn:
    suffix = os.path.splitext(name)[1].lower()
    shown = repr(name)[1:-1][:100]
    if suffix in _PICKLE_LIKE:
        _fail(shown, "file", "weights must be safetensors; pickled or other weight formats are "
              "never loaded")
    if suffix in _CODE:
        _fail(shown, "file", "code is not accepted in an adapter")
    if name in _TOKENIZER:
        _fail(shown, "file", "tokenizer files are not accepted (an adapter cannot change the "
              "base model's tokenizer)")
    _fail(shown, "file", f"unexpected file (an adapter holds only {', '.join(ALLOWED_FILES)})")


def _fail(file: str, field: str, reason: str) -> NoReturn:
    raise AdapterValidationError(file, field, reason)
