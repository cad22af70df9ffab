"""API keys: who is calling (the tenant) and whether they may act for other tenants (admin).

Keys are never stored: the key file (or ``LORAPLEX_API_KEYS``) lists the sha256 of each key,
one entry per line::

    # sha256(key)                                                     tenant  [role]
    9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08  acme
    60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752  ops     admin

(``printf %s "$KEY" | sha256sum`` prints the hash; keys should be long random strings, so a
plain hash is enough.) A presented key is hashed and compared with every entry in constant
time. The file is re-read when it changes (checked on every call) and on SIGHUP, so removing a
line revokes a key without a restart. A malformed line is skipped with an error in the log; a
missing file leaves no valid key (every call is refused) until it is back.

Without keys the gateway runs keyless: every call is tenant ``default`` (``loraplex serve`` on
localhost; the gateway says so loudly at start).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from loraplex.adapter_store.store import DEFAULT_TENANT, check_name
from loraplex.server.api import ServiceError

logger = logging.getLogger(__name__)

ADMIN_ROLE = "admin"
_HASH = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")
MAX_KEY_CHARS = 1024


@dataclass(frozen=True)
class Identity:
    """The caller: a tenant, and whether it may name other tenants (admin)."""

    tenant: str
    admin: bool = False

    def tenant_for(self, requested: str) -> str:
        """The tenant a call acts for: its own, or (admins only) the one it names.

        Raises:
            ServiceError: PERMISSION_DENIED for a non-admin naming another tenant.
        """
        if not requested or requested == self.tenant:
            return self.tenant
        if not self.admin:
            raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                               "only an admin key may act for another tenant")
        return requested


KEYLESS = Identity(DEFAULT_TENANT)


def hash_key(key: str) -> str:
    """The hex sha256 of an API key, as the key file lists it."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def parse_keys(text: str, source: str) -> list[tuple[bytes, Identity]]:
    """Parse key-file text into ``(hash bytes, identity)`` entries; bad lines are logged and
    skipped (``source`` names the file in the log)."""
    entries = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        problem = None
        match = _HASH.match(fields[0].lower())
        if match is None:
            problem = "the first field must be the key's sha256 (64 hex digits)"
        elif len(fields) not in (2, 3):
            problem = "expected: SHA256 TENANT [admin]"
        elif len(fields) == 3 and fields[2] != ADMIN_ROLE:
            problem = f"the role must be {ADMIN_ROLE!r}"
        else:
            try:
                check_name(fields[1], "tenant")
            except ValueError as exc:
                problem = str(exc)
        if problem is not None or match is None:
            logger.error("%s line %d skipped: %s", source, lineno, problem)
            continue
        identity = Identity(fields[1], admin=len(fields) == 3)
        entries.append((bytes.fromhex(match.group(1)), identity))
    return entries


class KeyRing:
    """The gateway's API keys.

    Args:
        path: a key file, re-read whenever it changes.
        text: key entries given directly (``LORAPLEX_API_KEYS``); newlines or ``;`` separate
            entries.
    """

    def __init__(self, path: str | None = None, text: str | None = None) -> None:
        self.path = path
        self._text_entries = parse_keys((text or "").replace(";", "\n"), "LORAPLEX_API_KEYS")
        self._file_entries: list[tuple[bytes, Identity]] = []
        self._file_state: tuple[int, int, int] | None = None
        self._lock = threading.Lock()
        if path is not None:
            self.reload()

    @property
    def keyless(self) -> bool:
        """True when no key source is configured: every caller is tenant ``default``."""
        return self.path is None and not self._text_entries

    @property
    def num_keys(self) -> int:
        return len(self._text_entries) + len(self._file_entries)

    def reload(self) -> None:
        """Re-read the key file now (SIGHUP)."""
        if self.path is None:
            return
        with self._lock:
            try:
                st = os.stat(self.path)
                with open(self.path, encoding="utf-8") as f:
                    text = f.read()
            except OSError as exc:
                logger.error("API key file %s unreadable (%s): no file key is valid until it "
                             "is back", self.path, exc.strerror)
                self._file_entries, self._file_state = [], None
                return
            self._file_entries = parse_keys(text, self.path)
            self._file_state = (st.st_mtime_ns, st.st_size, st.st_ino)
        logger.info("API keys loaded from %s: %d keys", self.path, len(self._file_entries))

    def _reload_if_changed(self) -> None:
        if self.path is None:
            return
        try:
            st = os.stat(self.path)
            state: tuple[int, int, int] | None = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            state = None
        if state != self._file_state:
            self.reload()

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Identity:
        """The caller's identity from ``authorization: Bearer <key>`` or ``x-api-key``.

        Raises:
            ServiceError: UNAUTHENTICATED for a missing, unknown or revoked key.
        """
        if self.keyless:
            return KEYLESS
        key = api_key_from_metadata(metadata)
        if not key:
            raise ServiceError(grpc.StatusCode.UNAUTHENTICATED,
                               "missing API key: send metadata 'authorization: Bearer <key>'")
        if len(key) > MAX_KEY_CHARS:
            raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        self._reload_if_changed()
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found: Identity | None = None
        # Compare against every entry, without stopping at a match: constant time in the key.
        for stored, identity in self._text_entries + self._file_entries:
            if hmac.compare_digest(stored, digest) and found is None:
                found = identity
        if found is None:
            raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        return found


def api_key_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The key a call presents (``authorization: Bearer`` first, then ``x-api-key``)."""
    bearer = plain = ""
    for name, value in metadata or ():
        if isinstance(value, bytes):
            continue
        if name == "authorization" and value[:7].lower() == "bearer ":
            bearer = value[7:].strip()
        elif name == "x-api-key":
            plain = value.strip()
    return bearer or plain
