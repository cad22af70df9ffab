from loraplex.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefetchRequest(_message.Message):
    __slots__ = ("digests",)
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    digests: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, digests: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("started",)
    STARTED_FIELD_NUMBER: _ClassVar[int]
    started: int
    def __init__(self, started: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "token_ids", "messages", "add_special_tokens", "return_token_strs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _generation_pb2.TokenIds
    messages: _generation_pb2.ChatMessages
    add_special_tokens: bool
    return_token_strs: bool
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[_generation_pb2.TokenIds, _Mapping]] = ..., messages: _Optional[_Union[_generation_pb2.ChatMessages, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., return_token_strs: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "text", "max_model_len", "token_strs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    max_model_len: int
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., max_model_len: _Optional[int] = ..., token_strs: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "adapter_digest", "text", "token_ids", "messages", "params", "adapter_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    adapter_digest: str
    text: str
    token_ids: _generation_pb2.TokenIds
    messages: _generation_pb2.ChatMessages
    params: _generation_pb2.SamplingParams
    adapter_name: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., adapter_digest: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_generation_pb2.TokenIds, _Mapping]] = ..., messages: _Optional[_Union[_generation_pb2.ChatMessages, _Mapping]] = ..., params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., adapter_name: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "serving", "queue_depth", "num_running", "max_queue", "num_pages", "num_free_pages", "num_kv_pages", "num_adapter_pages", "resident_adapters", "host_adapters", "max_model_len")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_ADAPTER_PAGES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    HOST_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    serving: bool
    queue_depth: int
    num_running: int
    max_queue: int
    num_pages: int
    num_free_pages: int
    num_kv_pages: int
    num_adapter_pages: int
    resident_adapters: _containers.RepeatedScalarFieldContainer[str]
    host_adapters: _containers.RepeatedScalarFieldContainer[str]
    max_model_len: int
    def __init__(self, worker_id: _Optional[str] = ..., serving: _Optional[bool] = ..., queue_depth: _Optional[int] = ..., num_running: _Optional[int] = ..., max_queue: _Optional[int] = ..., num_pages: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., num_kv_pages: _Optional[int] = ..., num_adapter_pages: _Optional[int] = ..., resident_adapters: _Optional[_Iterable[str]] = ..., host_adapters: _Optional[_Iterable[str]] = ..., max_model_len: _Optional[int] = ...) -> None: ...
