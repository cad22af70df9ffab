"""Shared test set-up: single-threaded torch, offline Hugging Face, deterministic seeds, and
the real redis-server fixtures of the store and end-to-end suites."""

from __future__ import annotations

import os
from collections.abc import Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.redis_server import REDIS_BIN, RedisServer  # noqa: E402

# Triton kernels run under the interpreter when there is no GPU; it must be set before any
# kernel module is imported (the engine imports them lazily with --kernels triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """The redis-server binary (skipped, with the reason, without it; CI installs it)."""
    if REDIS_BIN is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; CI does)")
    return REDIS_BIN


@pytest.fixture(scope="session")
def redis_server(redis_binary: str, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[RedisServer]:
    """One real redis-server shared by the session (each test gets it flushed)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's redis-server, flushed for this test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url
