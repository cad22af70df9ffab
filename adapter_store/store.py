"""The adapter store: ``tenant / name @ version -> digest``, and blobs by digest for workers.

Two interfaces, one per side of the gateway:

* :class:`AdapterStore` (gateway, CLI): ``put`` a validated adapter under a tenant's name
  (each put makes the next version, numbers are never reused), ``resolve`` ``name`` or
  ``name@version``, ``list``, ``versions``, ``delete``. A tenant sees only its own names;
  another tenant's adapter raises :class:`AdapterNotFound` with the message an absent one
  gets, and ``put`` always does the same work whether or not anyone stored the digest before.
* :class:`AdapterSource` (workers): ``fetch(digest) -> CanonicalAdapter``, verified against
  the digest on every read. Both backends implement it, and so does
  :class:`DirectoryAdapterSource` for a plain local folder of adapters.

Backends: ``fs_store.FsAdapterStore`` (``fs:PATH``, the default) and
``redis_store.RedisAdapterStore`` (``redis://`` / ``rediss://``); :func:`open_store` picks one.
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from loraplex.adapter_store.errors import (
    AdapterNotFound,
    AdapterStoreError,
    AdapterValidationError,
)

if TYPE_CHECKING:
    # Imported when used: the client and the gateway's records must not load torch.
    from loraplex.adapter_store.directory_source import DirectoryAdapterSource
    from loraplex.adapter_store.format import CanonicalAdapter
    from loraplex.server.engine.models.config import ModelConfig

__all__ = [
    "DEFAULT_TENANT", "AdapterNotFound", "AdapterSource", "AdapterStore", "AdapterStoreError",
    "AdapterVersion", "DirectoryAdapterSource", "check_digest", "check_name", "open_store",
    "parse_ref",
]

DEFAULT_TENANT = "default"
NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
DIGEST_RE = re.compile(r"[0-9a-f]{64}")
MAX_UPLOADER_CHARS = 256

Progress = Callable[[int], None]  # called with the number of bytes just written


@dataclass(frozen=True)
class AdapterVersion:
    """One version of a tenant's adapter: the record ``name@version`` points to.

    Attributes:
        tenant / name / version: where it lives; versions count from 1.
        digest: the content digest (what workers fetch).
        rank / target_modules / dtype: the adapter's shape.
        nbytes: bytes of its tensors.
        created: unix time of the put.
        uploader: who pushed it (free text, as given).
    """

    tenant: str
    name: str
    version: int
    digest: str
    rank: int
    target_modules: tuple[str, ...]
    dtype: str
    nbytes: int
    created: float
    uploader: str

    @property
    def ref(self) -> str:
        """``name@version``."""
        return f"{self.name}@{self.version}"

    def to_record(self) -> dict[str, Any]:
        """The stored metadata (the key gives tenant, name and version)."""
        doc = asdict(self)
        for key in ("tenant", "name", "version"):
            del doc[key]
        doc["target_modules"] = list(self.target_modules)
        return doc

    @classmethod
    def from_record(cls, tenant: str, name: str, version: int, doc: Any) -> AdapterVersion:
        """Rebuild from :meth:`to_record`'s output; ``AdapterStoreError`` if malformed."""
        try:
            out = cls(tenant=tenant, name=name, version=version, digest=str(doc["digest"]),
                      rank=int(doc["rank"]), target_modules=tuple(doc["target_modules"]),
                      dtype=str(doc["dtype"]), nbytes=int(doc["nbytes"]),
                      created=float(doc["created"]), uploader=str(doc["uploader"]))
        except (KeyError, TypeError, ValueError) as e:
            raise AdapterStoreError(f"metadata of {name}@{version} is corrupt ({e})") from e
        if not DIGEST_RE.fullmatch(out.digest):
            raise AdapterStoreError(f"metadata of {name}@{version} is corrupt (digest)")
        return out


def check_name(name: str, what: str = "name") -> str:
    """Refuse a name or tenant outside ``[a-z0-9][a-z0-9._-]{0,127}`` (``ValueError``)."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ValueError(f"{what} {str(name)[:140]!r} must match [a-z0-9][a-z0-9._-]{{0,127}}")
    return name


def check_digest(digest: str) -> str:
    """Refuse anything but 64 lowercase hex digits (``ValueError``)."""
    if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
        raise ValueError(f"digest {str(digest)[:80]!r} is not 64 lowercase hex digits")
    return digest


def parse_ref(ref: str) -> tuple[str, int | None]:
    """Split ``name`` or ``name@version`` (``ValueError`` if malformed)."""
    name, sep, version = ref.partition("@") if isinstance(ref, str) else ("", "", "")
    check_name(name)
    if not sep:
        return name, None
    if not version.isascii() or not version.isdigit() or version.startswith("0") \
            or len(version) > 12:
        raise ValueError(f"version {version[:20]!r} must be a positive integer")
    return name, int(version)


@runtime_checkable
class AdapterSource(Protocol):
    """Where workers get adapter weights: by digest, verified."""

    def fetch(self, digest: str) -> CanonicalAdapter:
        """The adapter stored under ``digest``.

        Raises:
            AdapterNotFound: no such digest.
            AdapterStoreError: unavailable, or the stored data does not verify.
        """
        ...


class AdapterStore(ABC):
    """Versioned, per-tenant names over content-addressed blobs (see the module docstring).

    Args:
        base_config: if given, ``put`` refuses and ``fetch`` rejects adapters made for other
            base-model dimensions.
    """

    def __init__(self, base_config: ModelConfig | None = None) -> None:
        self.base_config = base_config

    def put(self, tenant: str, name: str, adapter: CanonicalAdapter, *, uploader: str = "",
            progress: Progress | None = None) -> AdapterVersion:
        """Store ``adapter`` as the next version of ``tenant``'s ``name``.

        The blob is written (always, even if the digest is stored already) before the
        version record, so a crash leaves nothing visible.

        Returns:
            The new version's record (version number and digest).

        Raises:
            ValueError: a bad tenant, name or uploader.
            AdapterValidationError: the adapter does not fit the store's base model.
            AdapterStoreError: the store failed; no version was created.
        """
        check_name(tenant, "tenant")
        check_name(name)
        if not isinstance(uploader, str) or len(uploader) > MAX_UPLOADER_CHARS \
                or not uploader.isprintable():
            raise ValueError(f"uploader must be printable text of at most "
                             f"{MAX_UPLOADER_CHARS} characters")
        if self.base_config is not None:
            want = tuple(sorted(self.base_config.dims_key().items()))
            if adapter.base_dims != want:
                raise AdapterValidationError("adapter", "base_dims", f"made for {adapter.base_dims}"
                                             f", the store's base model has {want}")
        from loraplex.adapter_store.format import DTYPE_NAMES

        record = AdapterVersion(
            tenant=tenant, name=name, version=0, digest=adapter.digest, rank=adapter.rank,
            target_modules=adapter.target_modules, dtype=DTYPE_NAMES[adapter.dtype],
            nbytes=adapter.nbytes, created=time.time(), uploader=uploader)
        return self._put(adapter, record, progress)

    def resolve(self, tenant: str, ref: str) -> AdapterVersion:
        """``name`` (the latest version) or ``name@version`` -> its record.

        Raises:
            ValueError: a malformed tenant or ref.
            AdapterNotFound: no such name or version for this tenant.
        """
        name, version = parse_ref(ref)
        versions = self.versions(tenant, name)
        if version is None:
            return versions[-1]
        for v in versions:
            if v.version == version:
                return v
        raise AdapterNotFound(f"adapter {ref!r} not found")

    def versions(self, tenant: str, name: str) -> list[AdapterVersion]:
        """Every live version of ``name``, oldest first (``AdapterNotFound`` if none)."""
        check_name(tenant, "tenant")
        check_name(name)
        found = sorted(self._versions(tenant, name), key=lambda v: v.version)
        if not found:
            raise AdapterNotFound(f"adapter {name!r} not found")
        return found

    def delete(self, tenant: str, ref: str) -> list[AdapterVersion]:
        """Delete one version (``name@version``) or every version (``name``).

        Version numbers are not reused. A blob no version refers to any more is removed.

        Returns:
            The deleted records.

        Raises:
            AdapterNotFound: nothing matched.
        """
        check_name(tenant, "tenant")
        name, version = parse_ref(ref)
        deleted = self._delete(tenant, name, version)
        if not deleted:
            raise AdapterNotFound(f"adapter {ref!r} not found")
        return sorted(deleted, key=lambda v: v.version)

    def fetch(self, digest: str) -> CanonicalAdapter:
        """:class:`AdapterSource`: the adapter stored under ``digest``, verified on read."""
        adapter = self._fetch(check_digest(digest))
        if self.base_config is not None:
            want = tuple(sorted(self.base_config.dims_key().items()))
            if adapter.base_dims != want:
                raise AdapterStoreError(f"adapter {digest} was made for base dims "
                                        f"{adapter.base_dims}, this model has {want}")
        return adapter

    def watch_stored(self, callback: Callable[[str], None]) -> Callable[[], None] | None:
        """Call ``callback(digest)`` for each adapter ``put`` into this store from now on, by
        any process (a gateway warms the adapter on a worker before its first request).

        Best effort: a backend says what it can miss. The callback runs on a thread of the
        store's and must not block.

        Returns:
            A function that stops the watch, or None: this backend announces nothing (the
            ``fs:`` store; an adapter put there loads at its first request).
        """
        return None

    @abstractmethod
    def close(self) -> None:
        """Release connections and handles."""

    def __enter__(self) -> AdapterStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def _put(self, adapter: CanonicalAdapter, record: AdapterVersion,
             progress: Progress | None) -> AdapterVersion: ...

    @abstractmethod
    def _versions(self, tenant: str, name: str) -> list[AdapterVersion]: ...

    @abstractmethod
    def _names(self, tenant: str) -> list[str]: ...

    @abstractmethod
    def _delete(self, tenant: str, name: str, version: int | None) -> list[AdapterVersion]: ...

    @abstractmethod
    def _fetch(self, digest: str) -> CanonicalAdapter: ...

    def list(self, tenant: str) -> list[AdapterVersion]:
        """Every live version of every name of ``tenant``, by name then version."""
        check_name(tenant, "tenant")
        out = []
        for name in sorted(self._names(tenant)):
            out.extend(sorted(self._versions(tenant, name), key=lambda v: v.version))
        return out


def open_store(spec: str, base_config: ModelConfig | None = None) -> AdapterStore:
    """Open a store from ``fs:PATH``, ``redis://...`` or ``rediss://...`` (TLS).

    Redis URLs take redis-py's options: ``redis://[user:password@]host:port/db``, and query
    parameters such as ``?ssl_ca_certs=...`` for ``rediss://``.

    Raises:
        ValueError: an unknown scheme.
        AdapterStoreError: the store cannot be opened.
    """
    if spec.startswith("fs:"):
        from loraplex.adapter_store.fs_store import FsAdapterStore

        return FsAdapterStore(spec[3:], base_config)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from loraplex.adapter_store.redis_store import RedisAdapterStore

        return RedisAdapterStore.from_url(spec, base_config)
    raise ValueError(f"store {spec.split('@')[-1][:80]!r} must be fs:PATH, redis://... or "
                     "rediss://...")


def __getattr__(name: str) -> Any:
    # ``DirectoryAdapterSource`` is re-exported lazily: it needs torch (see the imports).
    if name == "DirectoryAdapterSource":
        from loraplex.adapter_store.directory_source import DirectoryAdapterSource

        return DirectoryAdapterSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
