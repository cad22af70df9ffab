from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UploadMetadata(_message.Message):
    __slots__ = ("name", "tenant", "uploader")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    UPLOADER_FIELD_NUMBER: _ClassVar[int]
    name: str
    tenant: str
    uploader: str
    def __init__(self, name: _Optional[str] = ..., tenant: _Optional[str] = ..., uploader: _Optional[str] = ...) -> None: ...

class FileHeader(_message.Message):
    __slots__ = ("name", "size", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class UploadRequest(_message.Message):
    __slots__ = ("metadata", "file", "chunk")
    METADATA_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    metadata: UploadMetadata
    file: FileHeader
    chunk: bytes
    def __init__(self, metadata: _Optional[_Union[UploadMetadata, _Mapping]] = ..., file: _Optional[_Union[FileHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("tenant", "name", "version", "digest", "rank", "target_modules", "dtype", "nbytes", "created", "uploader")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    UPLOADER_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    name: str
    version: int
    digest: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    dtype: str
    nbytes: int
    created: float
    uploader: str
    def __init__(self, tenant: _Optional[str] = ..., name: _Optional[str] = ..., version: _Optional[int] = ..., digest: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., dtype: _Optional[str] = ..., nbytes: _Optional[int] = ..., created: _Optional[float] = ..., uploader: _Optional[str] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("tenant", "name")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    name: str
    def __init__(self, tenant: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ...) -> None: ...

class GetAdapterRequest(_message.Message):
    __slots__ = ("adapter", "tenant")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    tenant: str
    def __init__(self, adapter: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class DeleteAdapterRequest(_message.Message):
    __slots__ = ("adapter", "tenant")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    tenant: str
    def __init__(self, adapter: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class DeleteAdapterResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: _containers.RepeatedCompositeFieldContainer[Adapter]
    def __init__(self, deleted: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ...) -> None: ...
