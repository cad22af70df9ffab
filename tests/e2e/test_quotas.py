"""Tenant quotas at the gateway: the bucket and slot arithmetic (no gRPC), limits per gateway,
and limits shared by two gateways through one real redis-server (leases included)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from loraplex.server.api import GenerateRequest, ServiceError, Usage
from loraplex.server.client import Client
from loraplex.server.engine.request import SamplingParams
from loraplex.server.quota import LocalQuotaBackend, Quotas, TenantLimits, prompt_tokens_bound
from loraplex.server.quota_redis import RedisQuotaBackend
from tests.e2e.harness import Cluster, counter_total, write_keys

KEYS = {"acme-key-0123456789": ("acme", False), "globex-key-0123456789": ("globex", False),
        "meter-key-0123456789": ("meter", False), "refund-key-0123456789": ("refund", False)}
ACME, GLOBEX, METER, REFUND = KEYS
# Per-tenant overrides on the key lines; every other tenant gets the gateway's defaults.
OVERRIDES = {"acme": "max_concurrency=1", "meter": "tokens_per_minute=100",
             "refund": "tokens_per_minute=1000"}
DEFAULTS = {"tenant_max_concurrency": 2, "tenant_tokens_per_minute": 0}
PROMPT = [5] * 10  # 10 tokens: with max_tokens=40 a request costs 50 of a 100-token minute


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_keys(tmp_path_factory.mktemp("keys") / "keys.txt", KEYS)
    lines = [f"{line}  {OVERRIDES.get(line.split()[1], '')}" if not line.startswith("#")
             else line for line in path.read_text().splitlines()]
    path.write_text("\n".join(lines) + "\n")
    return path


def refusal(fn: Callable[..., object], *args: object, **kwargs: object) -> str:
    """The message of a RESOURCE_EXHAUSTED refusal."""
    with pytest.raises(ServiceError) as info:
        fn(*args, **kwargs)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
    return info.value.message


def worker_requests(cluster: Cluster) -> float:
    return counter_total(cluster.workers[0].registry, "loraplex_worker_requests")


def eventually_ok(client: Client, max_tokens: int = 2, timeout: float = 5.0) -> None:
    """Retry until admitted: a cancelled stream frees its slot asynchronously."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.generate(PROMPT, max_tokens=max_tokens)
            return
        except ServiceError as exc:
            if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def held_stream(client: Client) -> Iterator:
    """A long stream that has started (its first chunk read), holding one slot."""
    stream = client.generate_stream(PROMPT, max_tokens=1500, ignore_eos=True)
    next(stream)
    return stream


# -- arithmetic, no gRPC --------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def request(prompt: str | tuple[int, ...], max_tokens: int) -> GenerateRequest:
    return GenerateRequest(prompt=prompt, params=SamplingParams(max_tokens=max_tokens))


def test_token_bucket_charges_bounds_and_settles_to_usage() -> None:
    clock = Clock()
    quotas = Quotas(TenantLimits(tokens_per_minute=120), lambda tenant: {},
                    LocalQuotaBackend(clock))

    async def run() -> None:
        assert prompt_tokens_bound("héllo") == 6 + 2  # UTF-8 bytes + BOS/EOS
        first = await quotas.admit("t", request(tuple(range(20)), 80))  # 100 of 120
        assert first is not None and first.charged == 100
        with pytest.raises(ServiceError) as info:
            await quotas.admit("t", request(tuple(range(20)), 80))
        message = info.value.message
        assert message.startswith("tokens_per_minute:") and "120 tokens per minute" in message
        assert "retry in 40.0 s" in message  # 80 missing at 2 tokens a second
        await quotas.release(first, Usage(5, 5), num_streamed=5)  # used 10: 90 back
        second = await quotas.admit("t", request(tuple(range(20)), 80))  # 110 - 100
        assert second is not None
        clock.now += 60  # a minute refills the bucket, never past its size
        await quotas.release(second, None, num_streamed=0)  # nothing streamed: all back
        assert await quotas.admit("t", request((1,), 119)) is not None
        with pytest.raises(ServiceError) as info:
            await quotas.admit("t", request((1,), 200))  # more than the bucket holds
        assert "more than the 120 tokens per minute tenant 't' may use" in info.value.message

    asyncio.run(run())


def test_slots_and_overrides() -> None:
    overrides = {"big": {"max_concurrency": 0}, "small": {"max_concurrency": 1}}
    quotas = Quotas(TenantLimits(max_concurrency=2), lambda t: overrides.get(t, {}),
                    LocalQuotaBackend())

    async def run() -> None:
        assert await quotas.admit("big", request((1,), 1)) is None  # unlimited: no ticket
        one = await quotas.admit("small", request((1,), 1))
        assert one is not None
        with pytest.raises(ServiceError) as info:
            await quotas.admit("small", request((1,), 1))
        assert info.value.message == ("max_concurrency: tenant 'small' has 1 requests in flight "
                                      "and a limit of 1; retry when one finishes")
        tickets = [await quotas.admit("other", request((1,), 1)) for _ in range(2)]
        with pytest.raises(ServiceError):
            await quotas.admit("other", request((1,), 1))
        await quotas.release(one, Usage(1, 1), 1)
        assert await quotas.admit("small", request((1,), 1)) is not None
        for ticket in tickets:
            assert ticket is not None
            await quotas.release(ticket, None, 0)
        assert await quotas.admit("other", request((1,), 1)) is not None

    asyncio.run(run())


# -- one gateway ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, key_file: Path):
    c = Cluster(model_dir, tmp_path_factory.mktemp("store"), keys=key_file, gateway=DEFAULTS)
    yield c
    c.close()


def test_concurrency_limit_per_gateway(cluster: Cluster) -> None:
    with cluster.client(ACME) as acme, cluster.client(GLOBEX) as globex:
        for _ in range(3):  # a finished request frees its slot at once
            assert acme.generate(PROMPT, max_tokens=2).usage.completion_tokens == 2
        stream = held_stream(acme)
        before = worker_requests(cluster)
        message = refusal(acme.generate, PROMPT, max_tokens=2)
        assert message.startswith("max_concurrency: tenant 'acme'") and "limit of 1" in message
        # Refused at the gateway: the worker never saw it, nothing was queued.
        assert worker_requests(cluster) == before
        assert cluster.workers[0].service.num_active == 1  # type: ignore[union-attr]
        # Another tenant has its own slots (the default, 2).
        other = [held_stream(globex), held_stream(globex)]
        assert "limit of 2" in refusal(globex.generate, PROMPT, max_tokens=2)
        for s in (stream, *other):
            s.close()  # type: ignore[attr-defined]
        eventually_ok(acme)
        eventually_ok(globex)
    refused = cluster.gateway.registry.get_sample_value(
        "loraplex_gateway_quota_refusals_total", {"tenant": "acme", "limit": "max_concurrency"})
    assert refused == 1
    cluster.wait_idle()


def test_tokens_per_minute_per_gateway(cluster: Cluster) -> None:
    with cluster.client(METER) as meter:
        for _ in range(2):
            out = meter.generate(PROMPT, max_tokens=40, ignore_eos=True)
            assert out.usage.prompt_tokens + out.usage.completion_tokens == 50
        before = worker_requests(cluster)
        message = refusal(meter.generate, PROMPT, max_tokens=40, ignore_eos=True)
        assert message.startswith("tokens_per_minute: tenant 'meter' is over its limit of 100")
        assert "more than" in refusal(meter.generate, PROMPT, max_tokens=200)
        assert worker_requests(cluster) == before


def test_unused_tokens_are_refunded(cluster: Cluster) -> None:
    with cluster.client(REFUND) as client:
        # Charged 10 + 980 of 1000; cancelled after a few tokens, it pays only for those.
        stream = client.generate_stream(PROMPT, max_tokens=980, ignore_eos=True)
        next(stream)
        assert "tokens_per_minute" in refusal(client.generate, PROMPT, max_tokens=40)
        stream.close()  # type: ignore[attr-defined]
        # Costs 410: admitted once the unused tokens come back, not by refill (17 a second).
        eventually_ok(client, max_tokens=400)
    cluster.wait_idle()


# -- two gateways, one Redis ----------------------------------------------------------------
def test_two_gateways_share_one_limit_through_redis(model_dir: Path, key_file: Path,
                                                    redis_url: str) -> None:
    first = Cluster(model_dir, redis_url, keys=key_file, gateway=DEFAULTS)
    second = None
    try:
        # A second gateway in front of the same worker, on the same Redis.
        second = Cluster(model_dir, redis_url, num_workers=0, keys=key_file, gateway=DEFAULTS,
                         extra_workers=(first.workers[0].address,))
        with first.client(ACME) as a1, second.client(ACME) as a2:
            stream = held_stream(a1)
            assert "limit of 1" in refusal(a2.generate, PROMPT, max_tokens=2)
            assert "limit of 1" in refusal(a1.generate, PROMPT, max_tokens=2)
            stream.close()  # type: ignore[attr-defined]
            eventually_ok(a2)
            assert a1.generate(PROMPT, max_tokens=2).usage.completion_tokens == 2
        with first.client(METER) as m1, second.client(METER) as m2:
            m1.generate(PROMPT, max_tokens=40, ignore_eos=True)
            m2.generate(PROMPT, max_tokens=40, ignore_eos=True)
            assert "limit of 100" in refusal(m1.generate, PROMPT, max_tokens=40)
            assert "limit of 100" in refusal(m2.generate, PROMPT, max_tokens=40)
        first.wait_idle()
    finally:
        if second is not None:
            second.close()
        first.close()


def test_a_crashed_gateways_slots_expire_and_live_ones_are_renewed(redis_url: str) -> None:
    limits = TenantLimits(max_concurrency=1)

    async def run() -> None:
        crashed = RedisQuotaBackend.from_url(redis_url, lease_seconds=0.4)
        other = RedisQuotaBackend.from_url(redis_url, lease_seconds=0.4)
        await crashed.start()
        try:
            assert await crashed.admit("acme", limits, 0, "crashed:1") is None
            await asyncio.sleep(1.2)  # three leases long: the refresher keeps it
            refused = await other.admit("acme", limits, 0, "other:1")
            assert refused is not None and refused.limit == "max_concurrency"
            await crashed.close()  # gone without releasing, as a killed gateway would be
            start = time.monotonic()
            while await other.admit("acme", limits, 0, "other:1") is not None:
                assert time.monotonic() - start < 0.4 + 0.5, "the lease did not expire"
                await asyncio.sleep(0.02)
            await other.release("acme", limits, "other:1", 0)
            assert await other.admit("acme", limits, 0, "other:2") is None  # freed at once
        finally:
            await other.close()

    asyncio.run(run())
