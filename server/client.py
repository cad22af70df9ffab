"""Python clients of a loraplex gateway: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

    from loraplex.server.client import Client

    with Client("127.0.0.1:50051", api_key="...") as client:
        for chunk in client.generate_stream("Once upon a time", adapter="my-lora",
                                            max_tokens=32):
            print(chunk.text, end="", flush=True)
        reply = client.generate(messages=[{"role": "user", "content": "Hi!"}])

Calls raise ``ServiceError`` (``.code`` a ``grpc.StatusCode``, ``.message``) for a non-OK
status. The API key defaults to ``$LORAPLEX_API_KEY``. ``tls=True`` (or ``tls_ca_file=...``,
or ``$LORAPLEX_TLS=1`` / ``$LORAPLEX_TLS_CA_FILE``) connects with TLS, checking the server
against that CA or the system's roots; ``client_cert_file`` / ``client_key_file`` present a
client certificate to a gateway that requires one (``server/tls.py``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from loraplex.adapter_store.store import AdapterVersion
from loraplex.server import env
from loraplex.server.api import (
    MAX_MESSAGE_BYTES,
    AdapterQuery,
    ChatMessage,
    ChatMessages,
    Completion,
    FileHeader,
    GenerateChunk,
    GenerateRequest,
    ServiceError,
    UploadMetadata,
    UploadPart,
)
from loraplex.server.params import SamplingParams, StructuredOutput
from loraplex.server.tls import client_credentials
from loraplex.server.wire.stubs import AsyncClientStub, ClientStub

__all__ = ["AsyncClient", "ChatMessage", "Client", "ServiceError", "StructuredOutput",
           "adapter_upload_parts"]

DEFAULT_ADDRESS = "127.0.0.1:50051"
UPLOAD_CHUNK_BYTES = 1 << 20
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


def adapter_upload_parts(path: str | os.PathLike[str], name: str, tenant: str = "",
                         uploader: str = "") -> Iterator[UploadPart]:
    """The messages of an ``Upload`` for a PEFT adapter directory: the metadata, then each
    regular file's header (size, sha256) and 1 MiB chunks. The server refuses any file it does
    not accept at its header, before its bytes are sent.

    Raises:
        ValueError: ``path`` is not a directory of regular files (checked before returning).
    """
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"{path}: not a directory")
    files = sorted(root.iterdir())
    for file in files:
        if file.is_symlink() or not file.is_file():
            raise ValueError(f"{file}: only regular files can be uploaded")
    return _parts(files, UploadMetadata(name=name, tenant=tenant, uploader=uploader))


def _parts(files: list[Path], metadata: UploadMetadata) -> Iterator[UploadPart]:
    yield metadata
    for file in files:
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            while block := f.read(UPLOAD_CHUNK_BYTES):
                digest.update(block)
        yield FileHeader(file.name, file.stat().st_size, digest.hexdigest())
        with open(file, "rb") as f:
            while block := f.read(UPLOAD_CHUNK_BYTES):
                yield block


# What ``messages=`` takes: ChatMessage objects, {"role": ..., "content": ...} mappings (as
# OpenAI's API spells them) or (role, content) pairs.
Messages = Sequence[ChatMessage | Mapping[str, str] | tuple[str, str]]
PromptArg = str | list[int] | tuple[int, ...] | None


def _chat(messages: Messages) -> ChatMessages:
    out = []
    for m in messages:
        if isinstance(m, ChatMessage):
            out.append(m)
        elif isinstance(m, Mapping):
            out.append(ChatMessage(str(m["role"]), str(m["content"])))
        else:
            role, content = m
            out.append(ChatMessage(str(role), str(content)))
    return ChatMessages(tuple(out))


def _request(prompt: PromptArg, adapter: str, params: SamplingParams | None, request_id: str,
             kwargs: dict[str, Any], messages: Messages | None = None) -> GenerateRequest:
    if params is not None and kwargs:
        raise TypeError("pass either params or sampling keyword arguments, not both")
    if (prompt is None) == (messages is None):
        raise TypeError("pass either a prompt (text or token ids) or messages, not both")
    if params is None:
        params = SamplingParams(**kwargs)
    if messages is not None:
        body: str | tuple[int, ...] | ChatMessages = _chat(messages)
    else:
        body = prompt if isinstance(prompt, str) else tuple(prompt or ())
    return GenerateRequest(prompt=body, params=params, adapter=adapter, request_id=request_id)


def _metadata(api_key: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {api_key}")] if api_key else []


class Client:
    """A blocking client.

    Args:
        address: the gateway's ``host:port``.
        api_key: the tenant's key (default ``$LORAPLEX_API_KEY``; none for a keyless server).
        timeout: default deadline of each call in seconds (None: no deadline).
        tls / tls_ca_file / client_cert_file / client_key_file: TLS (see the module's
            docstring; each None reads its ``LORAPLEX_*`` variable).

    Raises:
        ValueError: a TLS file that cannot be read or is not PEM.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, api_key: str | None = None,
                 timeout: float | None = None, *, tls: bool | None = None,
                 tls_ca_file: str | None = None, client_cert_file: str | None = None,
                 client_key_file: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = _metadata(api_key if api_key is not None else env.get("API_KEY"))
        creds = client_credentials(tls, tls_ca_file, client_cert_file, client_key_file)
        self._channel = (grpc.secure_channel(address, creds, options=_CHANNEL_OPTIONS)
                         if creds is not None
                         else grpc.insecure_channel(address, options=_CHANNEL_OPTIONS))
        self._stub = ClientStub(self._channel)

    @property
    def has_api_key(self) -> bool:
        """Whether calls carry an API key (given, or from ``$LORAPLEX_API_KEY``)."""
        return bool(self._metadata)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def generate(self, prompt: PromptArg = None, adapter: str = "", *,
                 messages: Messages | None = None, params: SamplingParams | None = None,
                 request_id: str = "", timeout: float | None = None, **sampling: Any
                 ) -> Completion:
        """The whole completion of ``prompt`` (text or token ids) or of chat ``messages``
        (``[{"role": "user", "content": "Hi"}]``, rendered by the model's chat template; the
        reply ends at its end-of-turn token). ``sampling`` are ``SamplingParams`` fields
        (``max_tokens=32, temperature=0.7, ...``), or pass ``params``."""
        return self._stub.generate(
            _request(prompt, adapter, params, request_id, sampling, messages), self._metadata,
            self._timeout(timeout))

    def generate_stream(self, prompt: PromptArg = None, adapter: str = "", *,
                        messages: Messages | None = None, params: SamplingParams | None = None,
                        request_id: str = "", timeout: float | None = None, **sampling: Any
                        ) -> Iterator[GenerateChunk]:
        """Chunks as they are produced; closing the iterator cancels the request (arguments
        as for ``generate``)."""
        return self._stub.generate_stream(
            _request(prompt, adapter, params, request_id, sampling, messages), self._metadata,
            self._timeout(timeout))

    def upload_adapter(self, path: str | os.PathLike[str], name: str, tenant: str = "",
                       uploader: str = "", timeout: float | None = None) -> AdapterVersion:
        """Upload a PEFT adapter directory as the next version of ``name``."""
        return self._stub.upload(adapter_upload_parts(path, name, tenant, uploader),
                                     self._metadata, self._timeout(timeout))

    def list_adapters(self, name: str = "", tenant: str = "",
                      timeout: float | None = None) -> list[AdapterVersion]:
        return self._stub.list_adapters(AdapterQuery(name, tenant), self._metadata,
                                   self._timeout(timeout))

    def get_adapter(self, ref: str, tenant: str = "", timeout: float | None = None
                    ) -> AdapterVersion:
        return self._stub.get_adapter(AdapterQuery(ref, tenant), self._metadata,
                                  self._timeout(timeout))

    def delete_adapter(self, ref: str, tenant: str = "", timeout: float | None = None
                       ) -> list[AdapterVersion]:
        return self._stub.delete_adapter(AdapterQuery(ref, tenant), self._metadata,
                                     self._timeout(timeout))

    def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        """``SERVING`` / ``NOT_SERVING`` from the standard health service."""
        return self._stub.health(service, timeout)


class AsyncClient:
    """The asyncio client (same methods as ``Client``, awaitable)."""

    def __init__(self, address: str = DEFAULT_ADDRESS, api_key: str | None = None,
                 timeout: float | None = None, *, tls: bool | None = None,
                 tls_ca_file: str | None = None, client_cert_file: str | None = None,
                 client_key_file: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = _metadata(api_key if api_key is not None else env.get("API_KEY"))
        creds = client_credentials(tls, tls_ca_file, client_cert_file, client_key_file)
        self._channel = (grpc.aio.secure_channel(address, creds, options=_CHANNEL_OPTIONS)
                         if creds is not None
                         else grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS))
        self._stub = AsyncClientStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    async def generate(self, prompt: PromptArg = None, adapter: str = "", *,
                       messages: Messages | None = None, params: SamplingParams | None = None,
                       request_id: str = "", timeout: float | None = None, **sampling: Any
                       ) -> Completion:
        return await self._stub.generate(
            _request(prompt, adapter, params, request_id, sampling, messages), self._metadata,
            self._timeout(timeout))

    def generate_stream(self, prompt: PromptArg = None, adapter: str = "", *,
                        messages: Messages | None = None, params: SamplingParams | None = None,
                        request_id: str = "", timeout: float | None = None, **sampling: Any
                        ) -> AsyncIterator[GenerateChunk]:
        return self._stub.generate_stream(
            _request(prompt, adapter, params, request_id, sampling, messages), self._metadata,
            self._timeout(timeout))

    async def upload_adapter(self, path: str | os.PathLike[str], name: str, tenant: str = "",
                             uploader: str = "", timeout: float | None = None
                             ) -> AdapterVersion:
        return await self._stub.upload(adapter_upload_parts(path, name, tenant, uploader),
                                           self._metadata, self._timeout(timeout))

    async def list_adapters(self, name: str = "", tenant: str = "",
                            timeout: float | None = None) -> list[AdapterVersion]:
        return await self._stub.list_adapters(AdapterQuery(name, tenant), self._metadata,
                                         self._timeout(timeout))

    async def get_adapter(self, ref: str, tenant: str = "", timeout: float | None = None
                          ) -> AdapterVersion:
        return await self._stub.get_adapter(AdapterQuery(ref, tenant), self._metadata,
                                        self._timeout(timeout))

    async def delete_adapter(self, ref: str, tenant: str = "", timeout: float | None = None
                             ) -> list[AdapterVersion]:
        return await self._stub.delete_adapter(AdapterQuery(ref, tenant), self._metadata,
                                           self._timeout(timeout))

    async def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        return await self._stub.health(service, timeout)
