"""Per-tenant quotas at the gateway: requests in flight and tokens per minute.

The policy (``Quotas``), applied after authentication, bounds and adapter resolution and before
routing, so a refused request never reaches a worker:

- **Concurrency**: a request holds one of its tenant's ``max_concurrency`` slots from admission
  until its stream ends, however it ends.
- **Tokens per minute**: each tenant has a token bucket of ``tokens_per_minute`` tokens that
  refills continuously at ``tokens_per_minute / 60`` a second. Admission charges an upper bound
  of what the request can use: its prompt (the number of token ids, or a text prompt's UTF-8
  bytes plus two special tokens: byte-level and byte-fallback tokenizers never make more
  tokens than bytes) plus ``max_tokens``. When the request ends the charge is settled to
  its real usage (the worker's ``prompt_tokens + completion_tokens``) and the rest is refunded.
  A request that ends before its first token is refunded in full; one that breaks off later
  pays its prompt bound and the tokens it streamed. Since charges are upper bounds, a tenant
  never uses more than ``tokens_per_minute * (1 + t / 60)`` tokens in any ``t`` seconds (a
  usage over its charge, which those tokenizers cannot produce, would leave the bucket in
  debt: later requests wait longer).
- Over either limit: ``RESOURCE_EXHAUSTED`` with a message naming the limit. A request that
  alone costs more than the bucket holds is refused the same way (it could never be admitted).
- ``0`` means no limit; an unlimited tenant costs no bookkeeping at all.

Limits are the gateway's defaults (``--tenant-max-concurrency``, ``--tenant-tokens-per-minute``)
overridden per tenant in the API key file (``auth.py``); a change applies to requests admitted
after it. The counts live in a backend: ``LocalQuotaBackend`` (this process: limits hold per
gateway) or ``quota_redis.RedisQuotaBackend`` (shared by every gateway on one Redis).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import NamedTuple, Protocol

import grpc

from loraplex.server.api import ChatMessages, GenerateRequest, Prompt, ServiceError, Usage

logger = logging.getLogger(__name__)

# Special tokens (BOS, EOS) a tokenizer may add to a text prompt.
TEXT_PROMPT_SPECIAL_TOKENS = 2
# What a chat template adds, estimated (a template may add any text; the charge is settled to
# the real usage when the request ends): per message (role, turn markers) and once.
CHAT_TOKENS_PER_MESSAGE = 16
CHAT_TEMPLATE_TOKENS = 128
# A refusal for requests in flight suggests this wait (one finishing frees the slot).
CONCURRENCY_RETRY_AFTER_SECONDS = 1.0


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's quota (0: unlimited).

    Attributes:
        max_concurrency: requests in flight at once.
        tokens_per_minute: prompt + completion tokens a minute (a token bucket).
    """

    max_concurrency: int = 0
    tokens_per_minute: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name}: must be >= 0 (0: unlimited)")

    @property
    def unlimited(self) -> bool:
        return not self.max_concurrency and not self.tokens_per_minute


LIMIT_NAMES = tuple(f.name for f in fields(TenantLimits))  # as the API key file names them


class Refusal(NamedTuple):
    """Why a backend refused: which limit, the tenant's requests in flight (concurrency), and
    how long until the bucket holds the cost (tokens per minute)."""

    limit: str
    in_flight: int = 0
    retry_after_seconds: float = 0.0


class QuotaBackend(Protocol):
    """Where the counts live. ``admit`` checks and takes both limits at once (all or
    nothing); ``release`` frees the slot and refunds ``refund`` tokens (negative: charges
    more)."""

    async def start(self) -> None: ...

    async def admit(self, tenant: str, limits: TenantLimits, cost: int, lease: str
                    ) -> Refusal | None: ...

    async def release(self, tenant: str, limits: TenantLimits, lease: str, refund: int
                      ) -> None: ...

    async def close(self) -> None: ...


@dataclass
class Ticket:
    """An admitted request's hold on its tenant's quota."""

    tenant: str
    limits: TenantLimits
    lease: str
    charged: int
    prompt_bound: int


def prompt_tokens_bound(prompt: Prompt) -> int:
    """An upper bound on a prompt's tokens that needs no tokenizer (see the module docstring;
    for chat messages, an estimate of what the template adds)."""
    if isinstance(prompt, ChatMessages):
        return CHAT_TEMPLATE_TOKENS + sum(
            len(m.content.encode("utf-8", "surrogatepass")) + CHAT_TOKENS_PER_MESSAGE
            for m in prompt.messages)
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8", "surrogatepass")) + TEXT_PROMPT_SPECIAL_TOKENS
    return len(prompt)


def settled_cost(ticket: Ticket, usage: Usage | None, num_streamed: int) -> int:
    """What a finished request pays: its usage, else the prompt bound and the tokens it
    streamed, else (nothing streamed) nothing."""
    if usage is not None:
        return usage.prompt_tokens + usage.completion_tokens
    if num_streamed:
        return ticket.prompt_bound + num_streamed
    return 0


class Quotas:
    """The gateway's quota policy over a backend (see the module docstring).

    Args:
        defaults: every tenant's limits unless overridden.
        overrides: per-tenant overrides (``{field: value}``) for a tenant, e.g.
            ``KeyRing.tenant_limits``.
        backend: where the counts live.
        on_refusal: called with (tenant, limit name) for each refusal (metrics).
    """

    def __init__(self, defaults: TenantLimits, overrides: Callable[[str], Mapping[str, int]],
                 backend: QuotaBackend,
                 on_refusal: Callable[[str, str], None] | None = None) -> None:
        self.defaults = defaults
        self.overrides = overrides
        self.backend = backend
        self._on_refusal = on_refusal or (lambda tenant, limit: None)
        self._gateway_id = uuid.uuid4().hex[:12]
        self._releases: set[asyncio.Task[None]] = set()

    def limits_for(self, tenant: str) -> TenantLimits:
        return replace(self.defaults, **self.overrides(tenant))

    async def admit(self, tenant: str, request: GenerateRequest) -> Ticket | None:
        """Take a slot and charge the request's token bound (None: the tenant is unlimited).

        Raises:
            ServiceError: RESOURCE_EXHAUSTED naming the limit; UNAVAILABLE if the quota
                backend cannot be reached.
        """
        limits = self.limits_for(tenant)
        if limits.unlimited:
            return None
        prompt_bound = prompt_tokens_bound(request.prompt)
        # The n sequences of one request are one request: one slot, all their tokens.
        cost = (prompt_bound + request.params.max_tokens * request.params.n
                if limits.tokens_per_minute else 0)
        tpm = limits.tokens_per_minute
        if tpm and cost > tpm:
            self._on_refusal(tenant, "tokens_per_minute")
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"tokens_per_minute: this request may use {cost} tokens (prompt + n * "
                f"max_tokens), "
                f"more than the {tpm} tokens per minute tenant {tenant!r} may use; lower "
                "max_tokens or shorten the prompt"))
        lease = f"{self._gateway_id}:{uuid.uuid4().hex}"
        refusal = await self.backend.admit(tenant, limits, cost, lease)
        if refusal is None:
            return Ticket(tenant, limits, lease, cost, prompt_bound)
        self._on_refusal(tenant, refusal.limit)
        if refusal.limit == "max_concurrency":
            message = (f"max_concurrency: tenant {tenant!r} has {refusal.in_flight} requests "
                       f"in flight and a limit of {limits.max_concurrency}; retry when one "
                       "finishes")
        else:
            message = (f"tokens_per_minute: tenant {tenant!r} is over its limit of {tpm} "
                       f"tokens per minute (this request may use {cost}); retry in "
                       f"{refusal.retry_after_seconds:.1f} s")
        retry_after = (refusal.retry_after_seconds if refusal.limit == "tokens_per_minute"
                       else CONCURRENCY_RETRY_AFTER_SECONDS)
        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message,
                           retry_after_seconds=retry_after)

    async def release(self, ticket: Ticket, usage: Usage | None, num_streamed: int) -> None:
        """Free the slot and settle the charge (never raises: a backend failure is logged, and
        a Redis lease then expires on its own)."""
        refund = ticket.charged - settled_cost(ticket, usage, num_streamed) \
            if ticket.limits.tokens_per_minute else 0
        # Shielded: a handler cancelled while releasing must not leave the slot taken.
        task = asyncio.ensure_future(self._release(ticket, refund))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        await asyncio.shield(task)

    async def _release(self, ticket: Ticket, refund: int) -> None:
        try:
            await self.backend.release(ticket.tenant, ticket.limits, ticket.lease, refund)
        except Exception:
            logger.exception("quota release for tenant %r failed", ticket.tenant)


class LocalQuotaBackend:
    """Counts in this process: each gateway enforces the limits on its own traffic.

    Args:
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._in_flight: Counter[str] = Counter()
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def _level(self, tenant: str, tpm: int, now: float) -> float:
        level, at = self._buckets.get(tenant, (float(tpm), now))
        return min(float(tpm), level + (now - at) * tpm / 60.0)

    async def admit(self, tenant: str, limits: TenantLimits, cost: int, lease: str
                    ) -> Refusal | None:
        # No await between the checks and the updates: atomic on the event loop.
        maxc, tpm = limits.max_concurrency, limits.tokens_per_minute
        if maxc and self._in_flight[tenant] >= maxc:
            return Refusal("max_concurrency", in_flight=self._in_flight[tenant])
        if tpm:
            now = self._clock()
            level = self._level(tenant, tpm, now)
            if level < cost:
                return Refusal("tokens_per_minute",
                               retry_after_seconds=(cost - level) * 60.0 / tpm)
            self._buckets[tenant] = (level - cost, now)
        if maxc:
            self._in_flight[tenant] += 1
        return None

    async def release(self, tenant: str, limits: TenantLimits, lease: str, refund: int
                      ) -> None:
        if limits.max_concurrency:
            self._in_flight[tenant] -= 1
            if self._in_flight[tenant] <= 0:
                del self._in_flight[tenant]
        tpm = limits.tokens_per_minute
        if tpm and refund:
            now = self._clock()
            self._buckets[tenant] = (min(float(tpm), self._level(tenant, tpm, now) + refund),
                                     now)


def open_quota_backend(store_spec: str, lease_seconds: float) -> QuotaBackend:
    """The backend for a gateway whose adapter store is ``store_spec``: Redis (shared by every
    gateway on it) when the store is Redis, this process otherwise."""
    if store_spec.startswith(("redis://", "rediss://", "unix://")):
        from loraplex.server.quota_redis import RedisQuotaBackend

        return RedisQuotaBackend.from_url(store_spec, lease_seconds=lease_seconds)
    return LocalQuotaBackend()
