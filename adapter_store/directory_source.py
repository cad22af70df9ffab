"""A plain local folder of PEFT adapter directories, served by digest (tests, offline engine)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from loraplex.adapter_store.errors import (
    AdapterNotFound,
    AdapterStoreError,
    AdapterValidationError,
)
from loraplex.adapter_store.format import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_RANK,
    CanonicalAdapter,
    load_adapter,
)
from loraplex.server.engine.models.config import ModelConfig

logger = logging.getLogger(__name__)


class DirectoryAdapterSource:
    """Serve every adapter sub-directory of ``root`` by digest (an ``AdapterSource``).

    Each sub-directory is validated with :func:`load_adapter` when the folder is scanned (at
    construction and on :meth:`refresh`); invalid ones are skipped, logged and listed in
    :attr:`errors`. ``fetch`` reads the directory again and checks that its digest has not
    changed.

    Args:
        root: the folder.
        base_config: the base model every adapter must fit.
        max_rank / max_bytes: as for :func:`load_adapter`.
    """

    def __init__(self, root: str | os.PathLike[str], base_config: ModelConfig, *,
                 max_rank: int = DEFAULT_MAX_RANK, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = Path(root)
        self.base_config = base_config
        self._limits = {"max_rank": max_rank, "max_bytes": max_bytes}
        self._paths: dict[str, Path] = {}
        self._digests: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.refresh()

    def refresh(self) -> None:
        """Scan ``root`` again."""
        paths: dict[str, Path] = {}
        digests: dict[str, str] = {}
        errors: dict[str, str] = {}
        for entry in sorted(self.root.iterdir()):
            if entry.is_symlink() or not entry.is_dir():
                continue
            try:
                adapter = load_adapter(entry, self.base_config, **self._limits)
            except AdapterValidationError as e:
                logger.warning("skipping adapter %s: %s", entry, e)
                errors[entry.name] = str(e)
                continue
            paths.setdefault(adapter.digest, entry)
            digests[entry.name] = adapter.digest
        self._paths, self._digests, self.errors = paths, digests, errors

    def names(self) -> dict[str, str]:
        """Sub-directory name -> digest, for every valid adapter."""
        return dict(self._digests)

    def digest_of(self, name: str) -> str:
        """The digest of the adapter in sub-directory ``name`` (``AdapterNotFound`` if none)."""
        if name not in self._digests:
            raise AdapterNotFound(f"adapter {name!r} not found")
        return self._digests[name]

    def fetch(self, digest: str) -> CanonicalAdapter:
        """The adapter with this digest, read and validated again.

        Raises:
            AdapterNotFound: no sub-directory had this digest at the last scan.
            AdapterStoreError: the directory changed or became invalid since.
        """
        path = self._paths.get(digest)
        if path is None:
            raise AdapterNotFound(f"no adapter with digest {digest[:80]!r}")
        try:
            adapter = load_adapter(path, self.base_config, **self._limits)
        except (AdapterValidationError, OSError) as e:
            raise AdapterStoreError(f"adapter {path} became unreadable: {e}") from e
        if adapter.digest != digest:
            raise AdapterStoreError(f"adapter {path} changed on disk (digest {adapter.digest})")
        return adapter
