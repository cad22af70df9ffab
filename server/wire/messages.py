"""Protobuf messages <-> the service's dataclasses (``server/api.py``, ``server/params.py``).

``*_from_pb`` / ``*_to_pb`` pairs, one per message the wire carries; a malformed message raises
``ValueError`` naming the field. Only ``server/wire/`` imports the generated ``*_pb2`` code
(design.md §3: the wire stops at the edge).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from loraplex.adapter_store.store import AdapterVersion
from loraplex.server.api import (
    ChatMessage,
    ChatMessages,
    Completion,
    FileHeader,
    GenerateChunk,
    GenerateRequest,
    Prompt,
    SequenceOutput,
    Timing,
    TokenizeRequest,
    TokenizeResult,
    Tool,
    ToolCall,
    ToolChoice,
    UploadMetadata,
    UploadPart,
    Usage,
    WorkerRequest,
    WorkerStatus,
)
from loraplex.server.params import SamplingParams, StructuredOutput, TokenLogprob
from loraplex.v1 import adapters_pb2, generation_pb2, worker_pb2

_FINISH_TO_PB = {"stop": generation_pb2.FINISH_REASON_STOP,
                 "length": generation_pb2.FINISH_REASON_LENGTH,
                 "tool_calls": generation_pb2.FINISH_REASON_TOOL_CALLS}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}
_DEFAULT_PARAMS = SamplingParams()
# The trailer every deliberate status carries (see services.py).
ORIGIN_KEY = "loraplex-origin"


def sampling_params_from_pb(m: generation_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the engine's defaults. Raises ``ValueError``."""
    return SamplingParams(
        max_tokens=m.max_tokens if m.HasField("max_tokens") else _DEFAULT_PARAMS.max_tokens,
        temperature=m.temperature, top_k=m.top_k,
        top_p=m.top_p if m.HasField("top_p") else _DEFAULT_PARAMS.top_p,
        seed=m.seed if m.HasField("seed") else None,
        stop_token_ids=tuple(m.stop_token_ids), stop=tuple(m.stop), ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        min_tokens=m.min_tokens, presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        repetition_penalty=(m.repetition_penalty if m.HasField("repetition_penalty")
                            else _DEFAULT_PARAMS.repetition_penalty),
        logit_bias=tuple(sorted(m.logit_bias.items())), min_p=m.min_p,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        n=m.n if m.HasField("n") else _DEFAULT_PARAMS.n,
        structured=structured_from_pb(m.structured) if m.HasField("structured") else None)


def structured_from_pb(m: generation_pb2.StructuredOutput) -> StructuredOutput:
    """Raises ``ValueError`` for an empty constraint or one over the bounds."""
    which = m.WhichOneof("constraint")
    if which is None:
        raise ValueError("structured: set one of json_schema, json_object, regex, choice or "
                         "grammar")
    if which == "json_object":
        if not m.json_object:
            raise ValueError("structured.json_object: must be true when set")
        return StructuredOutput("json_object")
    if which == "choice":
        return StructuredOutput("choice", choices=tuple(m.choice.choices))
    return StructuredOutput(which, getattr(m, which))


def structured_to_pb(s: StructuredOutput) -> generation_pb2.StructuredOutput:
    if s.kind == "json_object":
        return generation_pb2.StructuredOutput(json_object=True)
    if s.kind == "choice":
        return generation_pb2.StructuredOutput(
            choice=generation_pb2.Choices(choices=list(s.choices)))
    return generation_pb2.StructuredOutput(**{s.kind: s.value})


def sampling_params_to_pb(p: SamplingParams) -> generation_pb2.SamplingParams:
    m = generation_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        stop_token_ids=list(p.stop_token_ids), stop=list(p.stop), ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, logit_bias=dict(p.logit_bias), min_p=p.min_p)
    if p.repetition_penalty != _DEFAULT_PARAMS.repetition_penalty:
        m.repetition_penalty = p.repetition_penalty
    if p.seed is not None:
        m.seed = p.seed
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        m.prompt_logprobs = p.prompt_logprobs
    if p.n != _DEFAULT_PARAMS.n:
        m.n = p.n
    if p.structured is not None:
        m.structured.CopyFrom(structured_to_pb(p.structured))
    return m


def _prompt_from_pb(m: Any) -> Prompt:
    which = m.WhichOneof("prompt")
    if which == "text":
        return str(m.text)
    if which == "token_ids":
        return tuple(m.token_ids.ids)
    if which == "messages":
        return ChatMessages(tuple(ChatMessage(c.role, c.content) for c in m.messages.messages))
    raise ValueError("prompt: set one of text, token_ids or messages")


def _set_prompt(m: Any, prompt: Prompt | list[int]) -> None:
    if isinstance(prompt, str):
        m.text = prompt
    elif isinstance(prompt, ChatMessages):
        # CopyFrom, not extend: an empty conversation must still set the oneof member.
        m.messages.CopyFrom(generation_pb2.ChatMessages(messages=[
            generation_pb2.ChatMessage(role=c.role, content=c.content)
            for c in prompt.messages]))
    else:
        m.token_ids.ids.extend(prompt)


def _tool_choice_from_pb(m: generation_pb2.GenerateRequest) -> ToolChoice | None:
    if not m.HasField("tool_choice"):
        return None
    which = m.tool_choice.WhichOneof("choice")
    if which is None:
        raise ValueError("tool_choice: set mode or function")
    return ToolChoice(**{which: getattr(m.tool_choice, which)})


def generate_request_from_pb(m: generation_pb2.GenerateRequest) -> GenerateRequest:
    return GenerateRequest(prompt=_prompt_from_pb(m), params=sampling_params_from_pb(m.params),
                           adapter=m.adapter, request_id=m.request_id,
                           tools=tuple(Tool(t.name, t.description, t.parameters)
                                       for t in m.tools),
                           tool_choice=_tool_choice_from_pb(m))


def generate_request_to_pb(r: GenerateRequest) -> generation_pb2.GenerateRequest:
    m = generation_pb2.GenerateRequest(
        adapter=r.adapter, request_id=r.request_id, params=sampling_params_to_pb(r.params),
        tools=[generation_pb2.Tool(name=t.name, description=t.description,
                                   parameters=t.parameters) for t in r.tools])
    if r.tool_choice is not None:
        # CopyFrom: an empty choice must still mark the field as set
        m.tool_choice.CopyFrom(generation_pb2.ToolChoice(
            **{k: v for k, v in (("mode", r.tool_choice.mode),
                                 ("function", r.tool_choice.function)) if v}))
    _set_prompt(m, r.prompt)
    return m


def worker_request_from_pb(m: worker_pb2.WorkerGenerateRequest) -> WorkerRequest:
    return WorkerRequest(request_id=m.request_id, tenant=m.tenant, prompt=_prompt_from_pb(m),
                         params=sampling_params_from_pb(m.params),
                         adapter_digest=m.adapter_digest or None,
                         adapter_name=m.adapter_name)


def worker_request_to_pb(r: WorkerRequest) -> worker_pb2.WorkerGenerateRequest:
    m = worker_pb2.WorkerGenerateRequest(request_id=r.request_id, tenant=r.tenant,
                                         adapter_digest=r.adapter_digest or "",
                                         adapter_name=r.adapter_name,
                                         params=sampling_params_to_pb(r.params))
    _set_prompt(m, r.prompt)
    return m


def _logprobs_to_pb(lps: list[TokenLogprob]) -> list[generation_pb2.TokenLogprob]:
    return [generation_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[generation_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
        for lp in lps]


def _logprobs_from_pb(ms: Any) -> list[TokenLogprob]:
    return [TokenLogprob(m.token_id, m.logprob, tuple((t.token_id, t.logprob) for t in m.top))
            for m in ms]


def _finish_from_pb(value: int) -> str | None:
    return _FINISH_FROM_PB.get(value)


def _tool_calls_to_pb(calls: list[ToolCall]) -> list[generation_pb2.ToolCall]:
    return [generation_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]


def _tool_calls_from_pb(ms: Any) -> list[ToolCall]:
    return [ToolCall(m.id, m.name, m.arguments) for m in ms]


def _sequence_to_pb(s: SequenceOutput) -> generation_pb2.Sequence:
    m = generation_pb2.Sequence(index=s.index, token_ids=s.token_ids, text=s.text,
                                logprobs=_logprobs_to_pb(s.logprobs),
                                tool_calls=_tool_calls_to_pb(s.tool_calls))
    if s.finish_reason is not None:
        m.finish_reason = _FINISH_TO_PB[s.finish_reason]
    return m


def _sequence_from_pb(m: generation_pb2.Sequence) -> SequenceOutput:
    return SequenceOutput(index=m.index, token_ids=list(m.token_ids), text=m.text,
                          logprobs=_logprobs_from_pb(m.logprobs),
                          finish_reason=_finish_from_pb(m.finish_reason),
                          tool_calls=_tool_calls_from_pb(m.tool_calls))


def chunk_to_pb(c: GenerateChunk) -> generation_pb2.GenerateChunk:
    m = generation_pb2.GenerateChunk(request_id=c.request_id, token_ids=c.token_ids, text=c.text,
                                     logprobs=_logprobs_to_pb(c.logprobs),
                                     prompt_logprobs=_logprobs_to_pb(c.prompt_logprobs),
                                     index=c.index, tool_calls=_tool_calls_to_pb(c.tool_calls))
    if c.finish_reason is not None:
        m.finish_reason = _FINISH_TO_PB[c.finish_reason]
    if c.usage is not None:
        m.usage.CopyFrom(_usage_to_pb(c.usage))
    if c.timing is not None:
        m.timing.CopyFrom(_timing_to_pb(c.timing))
    return m


def chunk_from_pb(m: generation_pb2.GenerateChunk) -> GenerateChunk:
    return GenerateChunk(
        request_id=m.request_id, token_ids=list(m.token_ids), text=m.text,
        logprobs=_logprobs_from_pb(m.logprobs), finish_reason=_finish_from_pb(m.finish_reason),
        prompt_logprobs=_logprobs_from_pb(m.prompt_logprobs), index=m.index,
        tool_calls=_tool_calls_from_pb(m.tool_calls),
        usage=_usage_from_pb(m.usage) if m.HasField("usage") else None,
        timing=_timing_from_pb(m.timing) if m.HasField("timing") else None)


def completion_to_pb(c: Completion) -> generation_pb2.GenerateResponse:
    """Sequence 0 in the top-level fields; ``sequences`` only when there are several."""
    m = generation_pb2.GenerateResponse(
        request_id=c.request_id, token_ids=c.token_ids, text=c.text,
        logprobs=_logprobs_to_pb(c.logprobs), usage=_usage_to_pb(c.usage),
        timing=_timing_to_pb(c.timing), prompt_logprobs=_logprobs_to_pb(c.prompt_logprobs),
        tool_calls=_tool_calls_to_pb(c.tool_calls),
        sequences=[_sequence_to_pb(s) for s in c.sequences] if len(c.sequences) > 1 else [])
    if c.finish_reason is not None:
        m.finish_reason = _FINISH_TO_PB[c.finish_reason]
    return m


def completion_from_pb(m: generation_pb2.GenerateResponse) -> Completion:
    """``sequences`` always lists every sequence (a one-sequence response: sequence 0)."""
    c = Completion(request_id=m.request_id, token_ids=list(m.token_ids), text=m.text,
                   logprobs=_logprobs_from_pb(m.logprobs),
                   prompt_logprobs=_logprobs_from_pb(m.prompt_logprobs),
                   finish_reason=_finish_from_pb(m.finish_reason),
                   usage=_usage_from_pb(m.usage), timing=_timing_from_pb(m.timing),
                   tool_calls=_tool_calls_from_pb(m.tool_calls))
    c.sequences = ([_sequence_from_pb(s) for s in m.sequences] if m.sequences else
                   [SequenceOutput(0, list(c.token_ids), c.text, list(c.logprobs),
                                   c.finish_reason, list(c.tool_calls))])
    return c


def _copy_to_pb(pb_class: Any, obj: Any) -> Any:
    """A message from a dataclass whose fields the message has by the same names."""
    return pb_class(**{f.name: list(v) if isinstance(v := getattr(obj, f.name), tuple) else v
                       for f in fields(obj)})


def _copy_from_pb(cls: Any, m: Any) -> Any:
    """A dataclass from a message with the same field names (repeated fields as tuples)."""
    return cls(**{f.name: v if isinstance(v := getattr(m, f.name), (str, int, float, bool))
                  else tuple(v) for f in fields(cls)})


def _usage_to_pb(u: Usage) -> generation_pb2.Usage:
    return _copy_to_pb(generation_pb2.Usage, u)


def _usage_from_pb(m: generation_pb2.Usage) -> Usage:
    return _copy_from_pb(Usage, m)


def _timing_to_pb(t: Timing) -> generation_pb2.Timing:
    return _copy_to_pb(generation_pb2.Timing, t)


def _timing_from_pb(m: generation_pb2.Timing) -> Timing:
    return _copy_from_pb(Timing, m)


def worker_status_to_pb(s: WorkerStatus) -> worker_pb2.WorkerStatus:
    return _copy_to_pb(worker_pb2.WorkerStatus, s)


def worker_status_from_pb(m: worker_pb2.WorkerStatus) -> WorkerStatus:
    return _copy_from_pb(WorkerStatus, m)


def tokenize_request_from_pb(m: worker_pb2.TokenizeRequest) -> TokenizeRequest:
    return TokenizeRequest(_prompt_from_pb(m), m.add_special_tokens, m.return_token_strs)


def tokenize_request_to_pb(r: TokenizeRequest) -> worker_pb2.TokenizeRequest:
    m = worker_pb2.TokenizeRequest(add_special_tokens=r.add_special_tokens,
                                   return_token_strs=r.return_token_strs)
    _set_prompt(m, r.prompt)
    return m


def tokenize_result_to_pb(r: TokenizeResult) -> worker_pb2.TokenizeResponse:
    return worker_pb2.TokenizeResponse(token_ids=r.token_ids, text=r.text,
                                       max_model_len=r.max_model_len, token_strs=r.token_strs)


def tokenize_result_from_pb(m: worker_pb2.TokenizeResponse) -> TokenizeResult:
    return TokenizeResult(tuple(m.token_ids), m.text, m.max_model_len, tuple(m.token_strs))


def prefetch_request_from_pb(m: worker_pb2.PrefetchRequest) -> tuple[str, ...]:
    return tuple(m.digests)


def prefetch_request_to_pb(digests: Sequence[str]) -> worker_pb2.PrefetchRequest:
    return worker_pb2.PrefetchRequest(digests=digests)


def prefetch_response_to_pb(started: int) -> worker_pb2.PrefetchResponse:
    return worker_pb2.PrefetchResponse(started=started)


def prefetch_response_from_pb(m: worker_pb2.PrefetchResponse) -> int:
    return m.started


def adapter_to_pb(v: AdapterVersion) -> adapters_pb2.Adapter:
    return _copy_to_pb(adapters_pb2.Adapter, v)


def adapter_from_pb(m: adapters_pb2.Adapter) -> AdapterVersion:
    return _copy_from_pb(AdapterVersion, m)


def upload_part_from_pb(m: adapters_pb2.UploadRequest) -> UploadPart:
    which = m.WhichOneof("part")
    if which == "metadata":
        return UploadMetadata(m.metadata.name, m.metadata.tenant, m.metadata.uploader)
    if which == "file":
        return FileHeader(m.file.name, m.file.size, m.file.sha256)
    if which == "chunk":
        return bytes(m.chunk)
    raise ValueError("upload: each message must set metadata, file or chunk")


def upload_part_to_pb(part: UploadPart) -> adapters_pb2.UploadRequest:
    if isinstance(part, UploadMetadata):
        return adapters_pb2.UploadRequest(metadata=adapters_pb2.UploadMetadata(
            name=part.name, tenant=part.tenant, uploader=part.uploader))
    if isinstance(part, FileHeader):
        return adapters_pb2.UploadRequest(file=adapters_pb2.FileHeader(
            name=part.name, size=part.size, sha256=part.sha256))
    return adapters_pb2.UploadRequest(chunk=bytes(part))
