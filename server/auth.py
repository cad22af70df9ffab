"""API keys: who is calling (the tenant) and whether they may act for other tenants (admin).

Keys are never stored: the key file (or ``LORAPLEX_API_KEYS``) lists the sha256 of each key,
one entry per line::

    # sha256(key)                                                     tenant  [role]
    9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08  acme
    60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752  ops     admin

(``printf %s "$KEY" | sha256sum`` prints the hash; keys should be long random strings, so a
plain hash is enough.) A line may end with the tenant's quota (``quota.py``), overriding the
gateway's defaults: ``max_concurrency=N`` and ``tokens_per_minute=N`` (0: unlimited)::

    9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08  acme  max_concurrency=8

A limit applies to the tenant, whichever of its keys a request uses; when its lines disagree,
the strictest value wins (and the disagreement is logged).

A presented key is hashed and compared with every entry in constant time. The file is re-read
when it changes (checked on every call) and on SIGHUP, so removing a line revokes a key (or
changes a quota) without a restart. A malformed line is skipped with an error in the log; a
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
from typing import NamedTuple

import grpc

from loraplex.adapter_store.store import DEFAULT_TENANT, check_name
from loraplex.server.api import ServiceError
from loraplex.server.quota import LIMIT_NAMES

logger = logging.getLogger(__name__)

ADMIN_ROLE = "admin"
_HASH = re.compile(r"(?:sha256:)?([0-9a-f]{64})")
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


class KeyEntry(NamedTuple):
    """One line of the key file: the key's sha256, who it is, and its tenant's quota
    overrides (``(limit name, value)`` pairs)."""

    key_hash: bytes
    identity: Identity
    limits: tuple[tuple[str, int], ...] = ()


def _parse_options(options: list[str]) -> tuple[bool, tuple[tuple[str, int], ...], str | None]:
    """``[admin] [name=N ...]`` -> (admin, limits, problem)."""
    admin = False
    limits: dict[str, int] = {}
    for i, option in enumerate(options):
        if option == ADMIN_ROLE and i == 0:
            admin = True
            continue
        name, sep, value = option.partition("=")
        if not sep:
            return admin, (), f"the role must be {ADMIN_ROLE!r}, right after the tenant"
        if name not in LIMIT_NAMES:
            return admin, (), f"unknown limit {name!r} (known: {', '.join(LIMIT_NAMES)})"
        if not (value.isascii() and value.isdigit()):
            return admin, (), f"{name}: {value!r} is not a whole number >= 0"
        limits[name] = int(value)
    return admin, tuple(limits.items()), None


def parse_keys(text: str, source: str) -> list[KeyEntry]:
    """Parse key-file text into entries; bad lines are logged and skipped (``source`` names
    the file in the log)."""
    entries = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        problem = None
        admin = False
        limits: tuple[tuple[str, int], ...] = ()
        match = _HASH.fullmatch(fields[0].lower())
        if match is None:
            problem = "the first field must be the key's sha256 (64 hex digits)"
        elif len(fields) < 2:
            problem = "expected: SHA256 TENANT [admin] [max_concurrency=N] [tokens_per_minute=N]"
        else:
            admin, limits, problem = _parse_options(fields[2:])
            if problem is None:
                try:
                    check_name(fields[1], "tenant")
                except ValueError as exc:
                    problem = str(exc)
        if problem is not None or match is None:
            logger.error("%s line %d skipped: %s", source, lineno, problem)
            continue
        entries.append(KeyEntry(bytes.fromhex(match.group(1)), Identity(fields[1], admin=admin),
                                limits))
    return entries


def merge_limits(entries: Iterable[KeyEntry]) -> dict[str, dict[str, int]]:
    """Each tenant's quota overrides from its entries; the strictest value of a limit wins
    (0, unlimited, is the loosest)."""
    merged: dict[str, dict[str, int]] = {}
    for entry in entries:
        tenant = entry.identity.tenant
        mine = merged.setdefault(tenant, {})
        for name, value in entry.limits:
            old = mine.get(name)
            if old is not None and old != value:
                logger.warning("API keys: tenant %r has %s=%d and %s=%d on different lines; "
                               "the strictest applies", tenant, name, old, name, value)
                value = max(old, value) if 0 in (old, value) else min(old, value)
            mine[name] = value
    return {tenant: limits for tenant, limits in merged.items() if limits}


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
        self._file_entries: list[KeyEntry] = []
        self._limits = merge_limits(self._text_entries)
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
                self._limits = merge_limits(self._text_entries)
                return
            self._file_entries = parse_keys(text, self.path)
            self._limits = merge_limits(self._text_entries + self._file_entries)
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
        for entry in self._text_entries + self._file_entries:
            if hmac.compare_digest(entry.key_hash, digest) and found is None:
                found = entry.identity
        if found is None:
            raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        return found

    def tenant_limits(self, tenant: str) -> dict[str, int]:
        """The quota overrides the key entries give ``tenant`` (``{limit name: value}``;
        empty: the gateway's defaults). Current as of the last (re-)read of the file."""
        return dict(self._limits.get(tenant, {}))


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
