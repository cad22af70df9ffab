"""Tenant quotas shared by every gateway on one Redis (the adapter store's server).

Key layout (``P`` is the prefix; the braces keep a tenant's keys in one hash slot):

    P:quota:{<tenant>}:leases   sorted set   lease id -> expiry (ms, Redis server time)
    P:quota:{<tenant>}:tokens   hash         level (tokens in the bucket), ts (ms)

Each step is one Lua script, so it is atomic across gateways, and times come from Redis'
``TIME`` so gateways' clocks need not agree:

- ``ADMIT`` drops expired leases, checks the tenant's live leases against ``max_concurrency``
  and its refilled bucket against the cost, and only if both pass adds the lease and takes
  the tokens.
- ``RELEASE`` removes the lease and refunds the tokens.
- ``REFRESH`` pushes the expiry of every lease a gateway still holds; each gateway runs it
  every ``lease_seconds / 3``.

A crashed gateway's slots therefore free themselves at most ``lease_seconds`` after its last
refresh. A lease only ever expires while its gateway cannot reach Redis for that long; its
request then stops counting (the tenant may briefly exceed ``max_concurrency``), which errs
toward serving. A bucket key expires once the bucket would be full again (a missing bucket is
a full one), and a lease set once its last lease has expired, so idle tenants leave nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import grpc
import redis
import redis.asyncio

from loraplex.server.api import ServiceError
from loraplex.server.quota import Refusal, TenantLimits

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "loraplex"
REFRESH_BATCH = 500  # leases per REFRESH call, so one call never holds Redis for long

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
_BUCKET = """
local function level_of(key, tpm, now)
  local b = redis.call('HMGET', key, 'level', 'ts')
  if not b[1] then return tpm end
  return math.min(tpm, tonumber(b[1]) + (now - tonumber(b[2])) * tpm / 60000)
end
local function set_level(key, level, tpm, now)
  if level >= tpm then
    redis.call('DEL', key)
    return
  end
  redis.call('HSET', key, 'level', tostring(level), 'ts', tostring(now))
  redis.call('PEXPIRE', key, math.ceil((tpm - level) * 60000 / tpm) + 1000)
end
local function keep_for(key, ms)
  if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, ms) end
end
"""
# KEYS: 1 leases, 2 tokens. ARGV: 1 max_concurrency, 2 tokens_per_minute, 3 cost, 4 lease id,
# 5 lease ms (0 means unlimited). Returns {0} admitted, {1, in flight}, or {2, ms to wait}.
ADMIT = _NOW + _BUCKET + """
local maxc, tpm, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local lease_ms = tonumber(ARGV[5])
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  local n = redis.call('ZCARD', KEYS[1])
  if n >= maxc then return {1, n} end
end
if tpm > 0 then
  local level = level_of(KEYS[2], tpm, now)
  if level < cost then return {2, math.ceil((cost - level) * 60000 / tpm)} end
  set_level(KEYS[2], level - cost, tpm, now)
end
if maxc > 0 then
  redis.call('ZADD', KEYS[1], now + lease_ms, ARGV[4])
  keep_for(KEYS[1], lease_ms)
end
return {0}
"""
# KEYS: 1 leases, 2 tokens. ARGV: 1 lease id, 2 tokens_per_minute, 3 refund.
RELEASE = _NOW + _BUCKET + """
redis.call('ZREM', KEYS[1], ARGV[1])
local tpm, refund = tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm > 0 and refund ~= 0 then
  set_level(KEYS[2], math.min(tpm, level_of(KEYS[2], tpm, now) + refund), tpm, now)
end
return 0
"""
# KEYS: lease sets. ARGV: 1 lease ms, then the lease id held in each KEYS[i].
# ZADD XX: a lease released (or expired) meanwhile is not brought back.
REFRESH = _NOW + _BUCKET + """
local ms = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', now + ms, ARGV[i + 1])
  keep_for(key, ms)
end
return 0
"""


class RedisQuotaBackend:
    """Quota counts in Redis (see the module docstring).

    Args:
        client: a ``redis.asyncio`` client.
        lease_seconds: how long a slot outlives its gateway's last refresh.
        prefix: the key prefix (the adapter store's, by default).
    """

    def __init__(self, client: redis.asyncio.Redis, lease_seconds: float = 15.0,
                 prefix: str = DEFAULT_PREFIX) -> None:
        if lease_seconds <= 0:
            raise ValueError("lease_seconds: must be > 0")
        self.client = client
        self.lease_ms = max(1, round(lease_seconds * 1000))
        self.prefix = prefix
        self._admit = client.register_script(ADMIT)
        self._release = client.register_script(RELEASE)
        self._refresh = client.register_script(REFRESH)
        self._leases: dict[str, str] = {}  # lease id -> its lease set, while its request runs
        self._refresher: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisQuotaBackend:
        """A backend on the Redis at ``url`` (the same URL forms as the adapter store)."""
        client = redis.asyncio.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
        return cls(client, **kwargs)

    def _keys(self, tenant: str) -> list[str]:
        base = f"{self.prefix}:quota:{{{tenant}}}"
        return [f"{base}:leases", f"{base}:tokens"]

    async def start(self) -> None:
        """Start refreshing this gateway's leases (on the running loop)."""
        if self._refresher is None:
            self._refresher = asyncio.create_task(self._refresh_loop())

    async def close(self) -> None:
        """Stop refreshing and disconnect; leases still held expire after ``lease_seconds``."""
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None
        await self.client.aclose()

    async def admit(self, tenant: str, limits: TenantLimits, cost: int, lease: str
                    ) -> Refusal | None:
        keys = self._keys(tenant)
        try:
            result = await self._admit(keys=keys, args=[
                limits.max_concurrency, limits.tokens_per_minute, cost, lease, self.lease_ms])
        except redis.RedisError as exc:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"quota store: {type(exc).__name__}: {exc}") from None
        code = int(result[0])
        if code == 1:
            return Refusal("max_concurrency", in_flight=int(result[1]))
        if code == 2:
            return Refusal("tokens_per_minute", retry_after_seconds=int(result[1]) / 1000)
        if limits.max_concurrency:
            self._leases[lease] = keys[0]
        return None

    async def release(self, tenant: str, limits: TenantLimits, lease: str, refund: int
                      ) -> None:
        # Forgotten before the ZREM: a refresh racing it then renews it at most before the
        # ZREM (ZADD XX never brings a removed lease back).
        self._leases.pop(lease, None)
        await self._release(keys=self._keys(tenant),
                            args=[lease, limits.tokens_per_minute, refund])

    async def refresh(self) -> None:
        """Renew every lease this gateway holds."""
        held = list(self._leases.items())
        for i in range(0, len(held), REFRESH_BATCH):
            batch = held[i:i + REFRESH_BATCH]
            await self._refresh(keys=[key for _, key in batch],
                                args=[self.lease_ms, *(lease for lease, _ in batch)])

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            try:
                await self.refresh()
            except redis.RedisError as exc:
                logger.warning("quota leases not refreshed (%s: %s); they expire %.1f s after "
                               "the last refresh", type(exc).__name__, exc, self.lease_ms / 1000)
