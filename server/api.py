"""The service's messages as dataclasses: what ``wire/messages.py`` makes of the protobuf
messages of ``proto/loraplex/v1`` and back.
The gateway, the workers and the client speak only these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

import grpc

from loraplex.server.params import ChatMessage, ChatMessages, SamplingParams, TokenLogprob

__all__ = ["FINISH_REASONS", "MAX_MESSAGE_BYTES", "AdapterQuery", "ChatMessage", "ChatMessages",
           "Completion", "FileHeader", "GenerateChunk", "GenerateRequest", "Prompt",
           "SamplingParams", "SequenceOutput", "ServiceError", "Timing", "TokenLogprob",
           "TokenizeRequest", "TokenizeResult", "Tool", "ToolCall", "ToolChoice",
           "UploadMetadata", "UploadPart", "Usage", "WorkerRequest", "WorkerStatus"]

# Finish reasons a stream can end with; "abort" and "error" become gRPC statuses instead.
FINISH_REASONS = ("stop", "length")
# The largest gRPC message either side sends or accepts (servers and clients alike).
MAX_MESSAGE_BYTES = 64 << 20

# A prompt: text, token ids, or a conversation to render with the model's chat template.
Prompt: TypeAlias = str | tuple[int, ...] | ChatMessages


# Whose fault a status is, sent as the ``loraplex-origin`` trailer of every status a loraplex
# handler returns on purpose (see ``wire/services.py``).
ORIGIN_REQUEST = "request"  # this request's own error: the server itself is fine
ORIGIN_SERVER = "server"  # the server refuses any work now (draining, its engine failed)


class ServiceError(Exception):
    """A call ends with this gRPC status code and message.

    Raised by the gateway and worker implementations (the conversion layer turns it into the
    call's status, the HTTP layer into an OpenAI error) and by the client (from the status the
    server sent).

    Attributes:
        origin: raising side: ``ORIGIN_SERVER`` for a refusal of any work, else the request's
            own error (``None`` is sent as ``ORIGIN_REQUEST``). Receiving side: what the
            peer's ``loraplex-origin`` trailer said, or ``None`` when it had none: the status
            came from the transport (connection refused or reset, a killed process), not from
            a loraplex handler.
        cause: a short label for the failure metrics (``""``: the code says it all).
        retry_after_seconds: when a retry may succeed (RESOURCE_EXHAUSTED: quotas, full
            queues); the HTTP API sends it as ``Retry-After``.
    """

    def __init__(self, code: grpc.StatusCode, message: str, *, origin: str | None = None,
                 cause: str = "", retry_after_seconds: float | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.origin = origin
        self.cause = cause
        self.retry_after_seconds = retry_after_seconds


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, a description, and the JSON schema of its
    arguments as JSON text (``""``: no arguments)."""

    name: str
    description: str = ""
    parameters: str = ""


@dataclass(frozen=True)
class ToolChoice:
    """Which call the output makes: ``mode`` ``"required"`` / ``"none"`` / ``"auto"``, or
    ``function``, the name of the tool to call (at most one of the two set)."""

    mode: str = ""
    function: str = ""


@dataclass(frozen=True)
class ToolCall:
    """One call the output made: its id, the tool's name and the arguments' JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class GenerateRequest:
    """A public generation request.

    Attributes:
        prompt: text, token ids, or chat messages (``ChatMessages``).
        params: sampling parameters.
        adapter: ``"name"``, ``"name@version"`` or ``""`` for the base model.
        request_id: echoed back in every chunk; the gateway assigns one when empty.
        tools / tool_choice: tool calling (``gateway_tools.py``); the gateway turns them into
            a structured-output constraint, so workers never see them.
    """

    prompt: Prompt
    params: SamplingParams = field(default_factory=SamplingParams)
    adapter: str = ""
    request_id: str = ""
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None


@dataclass(frozen=True)
class WorkerRequest:
    """A generation request as the gateway hands it to a worker: the adapter is resolved to its
    digest and the tenant rides along (prefix-cache keys, fairness, metrics)."""

    request_id: str
    tenant: str
    prompt: Prompt
    params: SamplingParams
    adapter_digest: str | None = None
    adapter_name: str = ""  # "tenant/name@version" of the digest, for router metrics only


@dataclass(frozen=True)
class TokenizeRequest:
    """A prompt to encode as generation would (text, or messages through the chat template),
    or token ids to decode: the OpenAI API's ``/tokenize`` and ``/detokenize``.

    ``add_special_tokens``: for text, the tokenizer's special tokens (BOS, ...) as a
    completion's prompt gets them; ``return_token_strs``: for text or messages, each token's
    vocabulary string as well."""

    prompt: Prompt
    add_special_tokens: bool = True
    return_token_strs: bool = False


@dataclass(frozen=True)
class TokenizeResult:
    """The prompt's token ids (token ids: the request's own) and, for token ids, their text
    with special tokens kept (else empty); the model's context length; with
    ``return_token_strs``, each token's vocabulary string (else empty)."""

    token_ids: tuple[int, ...]
    text: str = ""
    max_model_len: int = 0
    token_strs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Usage:
    """A request's token counts (on its last chunk; output and drafts summed over its n).

    ``draft_tokens``: speculative draft tokens verified; ``accepted_draft_tokens``: those
    accepted (``<= draft_tokens``; both 0 without speculation). The OpenAI HTTP API's
    ``usage`` shows neither (vLLM-compatible clients expect its keys only)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass(frozen=True)
class Timing:
    """Seconds: queued at the worker, until the first token, until the last token."""

    queue_seconds: float = 0.0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0


@dataclass
class GenerateChunk:
    """One step's new tokens of a request; the last chunk has a finish reason, usage and
    timing."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" on the last chunk
    usage: Usage | None = None
    timing: Timing | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # with the first token
    index: int = 0  # which of the request's n sequences
    tool_calls: list[ToolCall] = field(default_factory=list)  # with finish reason "tool_calls"

    @property
    def finished(self) -> bool:
        """This chunk ends its sequence (with n > 1, the stream ends after all n)."""
        return self.finish_reason is not None


@dataclass
class SequenceOutput:
    """One of a request's n sequences, whole."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, chunk: GenerateChunk) -> None:
        """Append a chunk of this sequence."""
        self.token_ids.extend(chunk.token_ids)
        self.text += chunk.text
        self.logprobs.extend(chunk.logprobs)
        self.tool_calls.extend(chunk.tool_calls)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason


@dataclass
class Completion:
    """A whole generation (the unary ``Generate`` response, or a stream gathered up).

    The top-level fields are sequence 0's (with n > 1 too); ``sequences`` holds all n by
    index, sequence 0 included (filled by ``gather``, and by the client from a response)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    timing: Timing = field(default_factory=Timing)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    sequences: list[SequenceOutput] = field(default_factory=list)

    def add(self, chunk: GenerateChunk) -> None:
        """Append a chunk of the same request (its index not looked at: one sequence)."""
        self.token_ids.extend(chunk.token_ids)
        self.text += chunk.text
        self.logprobs.extend(chunk.logprobs)
        self.tool_calls.extend(chunk.tool_calls)
        self._add_request_fields(chunk)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason

    def gather(self, chunk: GenerateChunk) -> None:
        """Append a chunk of any of the request's sequences: to ``sequences[chunk.index]``,
        and sequence 0's to the top-level fields too."""
        if chunk.index == 0:
            self.add(chunk)
        else:
            self._add_request_fields(chunk)
        while len(self.sequences) <= chunk.index:
            self.sequences.append(SequenceOutput(len(self.sequences)))
        self.sequences[chunk.index].add(chunk)

    def _add_request_fields(self, chunk: GenerateChunk) -> None:
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.timing is not None:
            self.timing = chunk.timing


@dataclass(frozen=True)
class WorkerStatus:
    """A worker's report to the gateway's router (see ``worker.proto``)."""

    worker_id: str
    serving: bool
    queue_depth: int
    num_running: int
    max_queue: int
    num_pages: int = 0
    num_free_pages: int = 0
    num_kv_pages: int = 0
    num_adapter_pages: int = 0
    resident_adapters: tuple[str, ...] = ()
    host_adapters: tuple[str, ...] = ()
    max_model_len: int = 0


@dataclass(frozen=True)
class UploadMetadata:
    """The first message of an upload: the name to store under (and, for admins, a tenant)."""

    name: str
    tenant: str = ""
    uploader: str = ""


@dataclass(frozen=True)
class FileHeader:
    """Announces one uploaded file; ``size`` bytes of chunks follow."""

    name: str
    size: int
    sha256: str


UploadPart = UploadMetadata | FileHeader | bytes


@dataclass(frozen=True)
class AdapterQuery:
    """``List`` / ``Get`` / ``Delete``: ``ref`` is ``name`` or ``name@version`` (a name filter
    for ``List``, empty for all); ``tenant`` empty means the caller's."""

    ref: str = ""
    tenant: str = ""
