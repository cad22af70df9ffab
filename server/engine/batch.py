"""The types that pass between the step's stages: the scheduler's view of adapters
(``AdmissionGate``) and the copies it reserves (``AdapterLoad``), its ``ScheduledBatch`` for the
runner, and what comes back to ``Scheduler.update`` (``Accepted``) and goes on to the output
processor (``TokenUpdate``, ``StepUpdate``). No tensors: the scheduler's tests run without any.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from loraplex.server.engine.request import Request, RequestStatus, TokenLogprob
from loraplex.server.engine.step_cost import StepShape


class AdapterLoad(NamedTuple):
    """An adapter copy the runner performs before the step's forward pass: ``digest``'s
    weights from the host cache into ``page_ids`` (allocated and pinned at admission)."""

    digest: str
    page_ids: tuple[int, ...]


class AdmissionGate(Protocol):
    """What the scheduler asks before admitting a request beyond its KV pages (the adapter
    cache implements it: an adapter must be loaded and its pages held while a request runs)."""

    def ready(self, request: Request) -> bool: ...

    def pages_needed(self, request: Request) -> int: ...

    def pages_to_load(self, request: Request) -> int: ...

    def acquire(self, request: Request) -> AdapterLoad | None:
        """Pin the request's adapter; when it is not resident, allocate its pages and return
        the copy to perform (the scheduler puts it in the batch; nothing is copied here)."""
        ...

    def release(self, request: Request) -> None: ...

    def begin_step(self) -> None: ...

    def take_failures(self) -> dict[str, str]:
        """Digests whose load failed since the last call, with the reason."""
        ...

    def host_pages(self, digest: str) -> int | None:
        """Pages the adapter takes in the pool, once known (in the host cache)."""
        ...


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work: ``requests[i]`` computes its next ``num_new_tokens[i]`` tokens."""

    requests: list[Request]
    num_new_tokens: list[int]
    preempted: list[Request]
    # (source, destination) KV pages the runner copies, in every layer, before the forward
    # pass: a sequence's first write into a page it shares with its siblings.
    page_copies: list[tuple[int, int]] = field(default_factory=list)
    shape: StepShape = StepShape()  # what its time is predicted from (step_cost.py)
    # Adapter weights the runner copies into their (already reserved) pages first.
    adapter_loads: list[AdapterLoad] = field(default_factory=list)
    # Waiting requests that can never run, with why; the scheduler has finished them
    # (FINISHED_ERROR) and only their outputs remain to report.
    refused: list[tuple[Request, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Accepted(NamedTuple):
    """Tokens a request accepts after a step, in order: one sampled token today; the forced
    tokens of jump-forward; later the accepted prefix of a speculative draft."""

    request: Request
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class TokenUpdate(NamedTuple):
    """What ``accept`` appended to a request: a prefix of the offered tokens (it stops at
    the first that finishes the request) and the finish, if one needs no text."""

    request: Request
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    status: RequestStatus | None


class StepUpdate(NamedTuple):
    """``update``'s result: the tokens appended, and the requests that failed in it (their
    error set, already finished)."""

    tokens: list[TokenUpdate]
    failed: list[Request]
