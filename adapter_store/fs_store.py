"""The disk backend (the default, embedded): one directory, safe across processes.

    root/
      blobs/<d[:2]>/<digest>.safetensors    blobs by digest (see blob.py)
      refs/<digest>/<tenant>@<name>@<v>      which versions use a blob (empty files)
      tenants/<tenant>/<name>/<v>.json       version records
      tenants/<tenant>/<name>/next           the last version number handed out
      tmp/                                   uploads in progress
      lock                                   flock(2): commits and deletes take it

Invariant: a version record exists only once its blob and ref are durable. A put writes the
blob to ``tmp/`` and fsyncs it without the lock, then under the lock renames it into place,
adds the ref, and writes the record last (temporary file, fsync, rename, fsync the
directory). A crash at any point leaves either nothing visible or a complete version; at
worst an unreferenced blob or a stale file in ``tmp/`` (swept after a day).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loraplex.adapter_store.blob import adapter_from_blob, verified_pieces
from loraplex.adapter_store.errors import AdapterNotFound, AdapterStoreError
from loraplex.adapter_store.format import CanonicalAdapter
from loraplex.adapter_store.store import AdapterStore, AdapterVersion, Progress
from loraplex.server.engine.models.config import ModelConfig

STALE_TMP_S = 24 * 3600


class FsAdapterStore(AdapterStore):
    """Adapters in a local directory (created if missing); see the module docstring.

    Args:
        root: the store's directory.
        base_config: as for :class:`AdapterStore`.
    """

    def __init__(self, root: str | os.PathLike[str], base_config: ModelConfig | None = None
                 ) -> None:
        super().__init__(base_config)
        self.root = Path(root).expanduser()
        try:
            for sub in ("blobs", "refs", "tenants", "tmp"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            self._sweep_tmp()
        except OSError as e:
            raise AdapterStoreError(f"fs store {self.root}: cannot open ({e})") from e

    def close(self) -> None:
        """Nothing to release: every operation opens and closes its own files."""

    def _put(self, adapter: CanonicalAdapter, record: AdapterVersion,
             progress: Progress | None) -> AdapterVersion:
        tmp = self._write_tmp_blob(adapter, progress)
        tenant, name, digest = record.tenant, record.name, record.digest
        try:
            with self._locked():
                blob = self._blob_path(digest)
                _make_dirs(blob.parent, self.root)
                # Replace even if present: the same work whether or not it was stored before.
                os.replace(tmp, blob)
                _fsync_dir(blob.parent)
                name_dir = self.root / "tenants" / tenant / name
                _make_dirs(name_dir, self.root)
                version = self._next_version(name_dir)
                refs = self.root / "refs" / digest
                _make_dirs(refs, self.root)
                (refs / f"{tenant}@{name}@{version}").touch()
                _fsync_dir(refs)
                record = dataclasses.replace(record, version=version)
                self._write_atomic(name_dir / f"{version}.json",
                                   json.dumps(record.to_record()).encode())
                self._write_atomic(name_dir / "next", str(version).encode())
        except OSError as e:
            raise AdapterStoreError(f"fs store {self.root}: put failed ({e})") from e
        finally:
            tmp.unlink(missing_ok=True)
        return record

    def _versions(self, tenant: str, name: str) -> list[AdapterVersion]:
        name_dir = self.root / "tenants" / tenant / name
        out = []
        for version in _version_numbers(name_dir):
            try:
                doc = json.loads((name_dir / f"{version}.json").read_bytes())
            except FileNotFoundError:
                continue  # deleted since the listing
            except (OSError, ValueError) as e:
                raise AdapterStoreError(f"fs store {self.root}: metadata of {name}@{version} "
                                        f"is unreadable ({e})") from e
            out.append(AdapterVersion.from_record(tenant, name, version, doc))
        return out

    def _names(self, tenant: str) -> list[str]:
        tenant_dir = self.root / "tenants" / tenant
        if not tenant_dir.is_dir():
            return []
        return [p.name for p in tenant_dir.iterdir() if _version_numbers(p)]

    def _delete(self, tenant: str, name: str, version: int | None) -> list[AdapterVersion]:
        name_dir = self.root / "tenants" / tenant / name
        deleted = []
        try:
            with self._locked():
                for record in self._versions(tenant, name):
                    if version is not None and record.version != version:
                        continue
                    (name_dir / f"{record.version}.json").unlink()
                    _fsync_dir(name_dir)
                    refs = self.root / "refs" / record.digest
                    (refs / f"{tenant}@{name}@{record.version}").unlink(missing_ok=True)
                    if refs.is_dir() and not any(refs.iterdir()):
                        self._blob_path(record.digest).unlink(missing_ok=True)
                        refs.rmdir()
                    deleted.append(record)
        except OSError as e:
            raise AdapterStoreError(f"fs store {self.root}: delete failed ({e})") from e
        return deleted

    def _fetch(self, digest: str) -> CanonicalAdapter:
        path = self._blob_path(digest)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                buf = bytearray(size)
                view, done = memoryview(buf), 0
                while done < size:
                    n = f.readinto(view[done:])
                    if not n:
                        break
                    done += n
        except FileNotFoundError:
            if (self.root / "refs" / digest).is_dir():
                raise AdapterStoreError(f"fs store {self.root}: blob {digest} is missing but "
                                        "still referenced") from None
            raise AdapterNotFound(f"no adapter with digest {digest}") from None
        except OSError as e:
            raise AdapterStoreError(f"fs store {self.root}: cannot read blob {digest} ({e})"
                                    ) from e
        if done != size:
            raise AdapterStoreError(f"fs store {self.root}: blob {digest} was truncated")
        return adapter_from_blob(buf, digest)

    def _blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / digest[:2] / f"{digest}.safetensors"

    def _write_tmp_blob(self, adapter: CanonicalAdapter, progress: Progress | None) -> Path:
        try:
            fd, name = tempfile.mkstemp(dir=self.root / "tmp", prefix="blob-", suffix=".tmp")
        except OSError as e:
            raise AdapterStoreError(f"fs store {self.root}: cannot write ({e})") from e
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                for piece in verified_pieces(adapter):
                    f.write(piece)
                    if progress is not None:
                        progress(len(piece) if isinstance(piece, bytes) else piece.nbytes)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise AdapterStoreError(f"fs store {self.root}: cannot write blob ({e})") from e
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def _write_atomic(self, path: Path, data: bytes) -> None:
        fd, name = tempfile.mkstemp(dir=self.root / "tmp", prefix="meta-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(name, path)
        except BaseException:
            Path(name).unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)

    def _next_version(self, name_dir: Path) -> int:
        # max() of both: a crash between writing a record and `next` must not reuse a number.
        try:
            last = int((name_dir / "next").read_text())
        except FileNotFoundError:
            last = 0
        except ValueError as e:
            raise AdapterStoreError(f"fs store {self.root}: {name_dir / 'next'} is corrupt"
                                    ) from e
        return max([last, *_version_numbers(name_dir)]) + 1

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _sweep_tmp(self) -> None:
        cutoff = time.time() - STALE_TMP_S
        for p in (self.root / "tmp").iterdir():
            try:
                if p.stat().st_mtime < cutoff:
                    p.unlink()
            except FileNotFoundError:
                pass


def _version_numbers(name_dir: Path) -> list[int]:
    try:
        names = os.listdir(name_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(n[:-5]) for n in names
                  if n.endswith(".json") and n[:-5].isascii() and n[:-5].isdigit()
                  and n[0] != "0")


def _make_dirs(path: Path, root: Path) -> None:
    # Durable: each directory created is fsynced into its parent, up to root.
    missing = []
    while path != root and not path.is_dir():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        directory.mkdir(exist_ok=True)
        _fsync_dir(directory.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
