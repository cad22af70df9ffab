"""The gateway's ``Adapters`` service: upload (streamed to a private temporary directory, then
validated by the store's ``format.load_adapter`` against the client's declared sha256), list,
get and delete, each within the caller's tenant (admins may name another).

A tenant's view is its own namespace: another tenant's adapter answers ``NOT_FOUND`` with the
message a missing one gets, and an upload does the same work whether or not the digest is
stored already (the store guarantees it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import grpc

from loraplex.adapter_store.adapter_files import (
    MAX_README_BYTES,
    README_FILE,
    WEIGHTS_FILE,
    check_file_name,
)
from loraplex.adapter_store.errors import (
    AdapterNotFound,
    AdapterStoreError,
    AdapterValidationError,
)
from loraplex.adapter_store.format import load_adapter
from loraplex.adapter_store.peft_config import CONFIG_FILE, MAX_CONFIG_BYTES
from loraplex.adapter_store.store import AdapterStore, AdapterVersion, check_name
from loraplex.server.api import AdapterQuery, FileHeader, ServiceError, UploadMetadata, UploadPart
from loraplex.server.auth import Identity, KeyRing
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.metrics import GatewayMetrics
from loraplex.server.quote import quote


@dataclass(frozen=True)
class UploadLimits:
    """Bounds on one upload: ``max_bytes`` for the weights file, ``max_rank`` for ``r``."""

    max_bytes: int = 2 << 30
    max_rank: int = 64

    def file_limit(self, name: str) -> int:
        return {CONFIG_FILE: MAX_CONFIG_BYTES, README_FILE: MAX_README_BYTES,
                WEIGHTS_FILE: self.max_bytes}[name]


def _invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


@contextlib.contextmanager
def store_errors(ref: str = "") -> Iterator[None]:
    """Map the store's exceptions onto statuses (one NOT_FOUND message for every tenant)."""
    try:
        yield
    except AdapterNotFound:
        raise ServiceError(grpc.StatusCode.NOT_FOUND, f"adapter {quote(ref)} not found") from None
    except ValueError as exc:  # AdapterValidationError too: it names the file and field
        raise _invalid(str(exc)) from None
    except AdapterStoreError as exc:
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"adapter store: {exc}") from None


class _UploadDir:
    """Files of one upload, written as they stream in, each checked against its header."""

    def __init__(self, root: str, limits: UploadLimits) -> None:
        self.root = root
        self.limits = limits
        self.declared: dict[str, str] = {}
        self._file: BinaryIO | None = None
        self._name = ""
        self._remaining = 0

    def begin(self, header: FileHeader) -> None:
        self.end()
        try:
            check_file_name(header.name)
        except AdapterValidationError as exc:
            raise _invalid(str(exc)) from None
        if header.name in self.declared:
            raise _invalid(f"{header.name}: sent twice")
        limit = self.limits.file_limit(header.name)
        if header.size > limit:
            raise _invalid(f"{header.name}: size: {header.size} bytes, over the "
                           f"{limit}-byte limit")
        self.declared[header.name] = header.sha256
        fd = os.open(os.path.join(self.root, header.name),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._file = os.fdopen(fd, "wb")
        self._name, self._remaining = header.name, header.size

    def write(self, chunk: bytes) -> None:
        if self._file is None:
            raise _invalid("upload: a chunk came before any file header")
        if len(chunk) > self._remaining:
            raise _invalid(f"{self._name}: size: more bytes than its header declared")
        self._file.write(chunk)
        self._remaining -= len(chunk)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def end(self) -> None:
        if self._file is None:
            return
        self.close()
        if self._remaining:
            raise _invalid(f"{self._name}: size: {self._remaining} bytes fewer than its "
                           "header declared")


class AdaptersService:
    """The ``Adapters`` service's implementation."""

    def __init__(self, store: AdapterStore, keys: KeyRing, base_config: ModelConfig,
                 limits: UploadLimits, metrics: GatewayMetrics,
                 on_stored: Callable[[str], None] | None = None) -> None:
        self.store = store
        self.on_stored = on_stored  # each stored upload's digest (the gateway warms a worker)
        self.keys = keys
        self.base_config = base_config
        self.limits = limits
        self.metrics = metrics

    def authenticate(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's tenant (checked before a malformed message is refused).

        Raises:
            ServiceError: UNAUTHENTICATED.
        """
        return self.keys.authenticate(context.invocation_metadata()).tenant

    def _caller(self, context: grpc.aio.ServicerContext, tenant: str) -> str:
        identity: Identity = self.keys.authenticate(context.invocation_metadata())
        return identity.tenant_for(tenant)

    async def upload(self, parts: AsyncIterator[UploadPart],
                     context: grpc.aio.ServicerContext) -> AdapterVersion:
        """Receive, validate and store an adapter as the next version of its name."""
        identity = self.keys.authenticate(context.invocation_metadata())
        code, tenant = "CANCELLED", identity.tenant
        try:
            first = await anext(parts, None)
            if not isinstance(first, UploadMetadata):
                raise _invalid("upload: the first message must be the metadata")
            tenant = identity.tenant_for(first.tenant)
            with store_errors():
                check_name(first.name)
            with tempfile.TemporaryDirectory(prefix="loraplex-upload-") as root:
                files = _UploadDir(root, self.limits)
                try:
                    async for part in parts:
                        if isinstance(part, FileHeader):
                            files.begin(part)
                        elif isinstance(part, bytes):
                            files.write(part)
                        else:
                            raise _invalid("upload: the metadata must come first, and once")
                    files.end()
                finally:
                    files.close()
                with store_errors():
                    adapter = await asyncio.to_thread(
                        load_adapter, root, self.base_config, max_rank=self.limits.max_rank,
                        max_bytes=self.limits.max_bytes, declared_sha256=files.declared)
            with store_errors():
                record = await asyncio.to_thread(self.store.put, tenant, first.name, adapter,
                                                 uploader=first.uploader)
            code = "OK"
            if self.on_stored is not None:
                self.on_stored(record.digest)
            return record
        except ServiceError as exc:
            code = exc.code.name
            raise
        finally:
            self.metrics.uploads.labels(tenant=tenant, code=code).inc()

    async def list_adapters(self, query: AdapterQuery, context: grpc.aio.ServicerContext
                            ) -> list[AdapterVersion]:
        """Every version of the tenant's adapters (or of the name in ``query.ref``)."""
        tenant = self._caller(context, query.tenant)
        with store_errors(query.ref):
            if query.ref:
                return await asyncio.to_thread(self.store.versions, tenant, query.ref)
            return await asyncio.to_thread(self.store.list, tenant)

    async def get_adapter(self, query: AdapterQuery, context: grpc.aio.ServicerContext
                          ) -> AdapterVersion:
        """``name`` (latest) or ``name@version``."""
        tenant = self._caller(context, query.tenant)
        with store_errors(query.ref):
            return await asyncio.to_thread(self.store.resolve, tenant, query.ref)

    async def delete_adapter(self, query: AdapterQuery, context: grpc.aio.ServicerContext
                             ) -> list[AdapterVersion]:
        """Delete ``name@version`` or every version of ``name``."""
        tenant = self._caller(context, query.tenant)
        with store_errors(query.ref):
            return await asyncio.to_thread(self.store.delete, tenant, query.ref)
