"""A request's state inside a worker: ``Request`` is the one object that passes between the
scheduler, the pager, the model runner and the sampler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraplex.server.params import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MIN_TEMPERATURE,
    SamplingParams,
    TokenLogprob,
)

if TYPE_CHECKING:
    from loraplex.server.engine.spec.state import SpecState
    from loraplex.server.engine.structured import GrammarState

__all__ = ["MAX_LOGIT_BIAS", "MAX_LOGIT_BIAS_TOKENS", "MAX_LOGPROBS", "MAX_N", "MAX_PENALTY",
           "MAX_REPETITION_PENALTY", "MAX_STOP_STRINGS", "MAX_STOP_STRING_LEN",
           "MIN_TEMPERATURE", "Request", "RequestOutput", "RequestStatus", "SamplingParams",
           "TokenLogprob"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass
class Request:
    """One generation inside the engine.

    The scheduler's only invariant: a request has ``num_tokens`` known tokens (prompt and
    outputs so far) and ``num_computed_tokens`` whose KV is in its pages. Each step closes
    part of that gap; when it closes, the sampler appends a token.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter_digest: str | None = None
    tenant: str = "default"
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    page_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    num_charged_tokens: int = 0  # tokens counted as service for fairness (never twice)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Entry i: prompt token i + 1 given the tokens before it (filled during prefill, kept
    # across preemption: recompute never appends twice).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    generator: torch.Generator | None = None
    group_id: str = ""  # the request the client sent, when this is one of its n children
    index: int = 0  # which of the n sequences

    @property
    def output_id(self) -> str:
        """The id outputs are reported under: the client's request (all n children share it)."""
        return self.group_id or self.request_id
    grammar: GrammarState | None = None  # structured output: its compiled grammar and matcher
    # Speculative decoding: its proposer context and adaptive k, and this step's draft (the
    # tokens verified after the last known one; never part of the known tokens).
    spec: SpecState | None = None
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_token(self, token: int, logprob: TokenLogprob | None) -> None:
        self.output_token_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)

    def stop_status(self, token: int, eos_token_ids: frozenset[int],
                    max_model_len: int | None) -> RequestStatus | None:
        """How the request finishes with ``token``, its last appended, by a rule that needs
        no text: its grammar completes (its matcher accepts the token here), a stop token,
        EOS unless ``ignore_eos``, ``max_tokens``, the model's length; None: it goes on."""
        params = self.params
        if self.grammar is not None and self.grammar.accept(self, token):
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or (
                max_model_len is not None and self.num_tokens >= max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None


@dataclass
class RequestOutput:
    """What one step produced for one request (incremental: only the new tokens and text)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # with the first token
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    index: int = 0  # the sequence, of the request's n
    # Speculative decoding, on the final output: draft tokens verified and accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
