"""``AdapterStore.watch_stored``: a Redis store announces each committed put on ``P:stored``
to every watcher (gateways warm the adapter on a worker, whoever pushed it), across restarts
of the server; the ``fs:`` store announces nothing. Against real redis-server processes."""

from __future__ import annotations

import logging
import queue
import time

import pytest
import redis

from loraplex.adapter_store.errors import AdapterStoreError
from loraplex.adapter_store.format import load_adapter
from loraplex.adapter_store.fs_store import FsAdapterStore
from loraplex.adapter_store.redis_store import RedisAdapterStore

pytestmark = pytest.mark.redis


def _next(q: queue.Queue[str], timeout: float = 10.0) -> str:
    return q.get(timeout=timeout)


def test_a_put_by_another_client_reaches_every_watcher(redis_url, make_adapter, base_config):
    adapter = load_adapter(make_adapter("a", seed=1), base_config)
    gateways = [RedisAdapterStore.from_url(redis_url, base_config) for _ in range(2)]
    pusher = RedisAdapterStore.from_url(redis_url, base_config)  # the CLI's own connection
    seen: list[queue.Queue[str]] = [queue.Queue(), queue.Queue()]
    stops = [g.watch_stored(q.put) for g, q in zip(gateways, seen, strict=True)]
    try:
        record = pusher.put("acme", "tuned", adapter)
        assert [_next(q) for q in seen] == [record.digest, record.digest]
        # each put is announced, a new version of the same weights too
        pusher.put("acme", "tuned", adapter)
        assert [_next(q) for q in seen] == [record.digest, record.digest]
        assert all(q.empty() for q in seen)
    finally:
        for stop in stops:
            stop()
        for store in (*gateways, pusher):
            store.close()


def test_what_is_not_a_digest_is_dropped_and_a_failing_callback_keeps_the_watch(
        redis_url, make_adapter, base_config, caplog):
    store = RedisAdapterStore.from_url(redis_url, base_config)
    seen: queue.Queue[str] = queue.Queue()
    calls = []

    def callback(digest: str) -> None:
        calls.append(digest)
        if len(calls) == 1:
            raise RuntimeError("the watcher's own bug")
        seen.put(digest)

    stop = store.watch_stored(callback)
    raw = redis.Redis.from_url(redis_url)
    try:
        with caplog.at_level(logging.WARNING, logger="loraplex.adapter_store.redis_store"):
            raw.publish("loraplex:stored", b"../../etc/passwd")
            raw.publish("loraplex:stored", b"\xff" * 64)
            first = store.put("default", "a", load_adapter(make_adapter("a", seed=1),
                                                           base_config))
            second = store.put("default", "b", load_adapter(make_adapter("b", seed=2),
                                                            base_config))
            assert _next(seen) == second.digest
        assert calls == [first.digest, second.digest]
        assert "'../../etc/passwd', not a digest" in caplog.text
        assert "not a digest" in caplog.text.split("etc/passwd")[1]  # the bytes too
        assert "callback failed for " + first.digest in caplog.text
    finally:
        stop()
        raw.close()
        store.close()


def test_the_watch_survives_a_redis_restart(redis_factory, make_adapter, base_config):
    server = redis_factory()
    watcher = RedisAdapterStore.from_url(server.url, base_config)
    seen: queue.Queue[str] = queue.Queue()
    stop = watcher.watch_stored(seen.put)
    try:
        server.kill()
        server.start()  # same port, nothing persisted
        pusher = RedisAdapterStore.from_url(server.url, base_config)
        adapter = load_adapter(make_adapter("a", seed=3), base_config)
        # published until the watch is subscribed again (a put while it reconnects is
        # missed: Pub/Sub keeps nothing)
        deadline = time.monotonic() + 30
        got = None
        while got is None and time.monotonic() < deadline:
            digest = pusher.put("default", "a", adapter).digest
            try:
                got = seen.get(timeout=1.0)
            except queue.Empty:
                pass
        assert got == digest
        pusher.close()
    finally:
        stop()
        watcher.close()


def test_a_stopped_watch_calls_nothing(redis_url, make_adapter, base_config):
    store = RedisAdapterStore.from_url(redis_url, base_config)
    seen: queue.Queue[str] = queue.Queue()
    stop = store.watch_stored(seen.put)
    adapter = load_adapter(make_adapter("a", seed=1), base_config)
    store.put("default", "a", adapter)
    _next(seen)
    stop()
    raw = redis.Redis.from_url(redis_url)
    assert raw.pubsub_numsub("loraplex:stored") == [(b"loraplex:stored", 0)]
    store.put("default", "a", adapter)
    time.sleep(0.5)
    assert seen.empty()
    raw.close()
    store.close()


def test_a_user_without_channel_rights_can_put_but_not_watch(redis_factory, make_adapter,
                                                            base_config, caplog):
    server = redis_factory()
    admin = redis.Redis.from_url(server.url)
    # keys and commands, no Pub/Sub channels (Redis 7's default for a new user)
    admin.execute_command("ACL", "SETUSER", "pusher", "on", ">pw", "~*", "+@all",
                          "resetchannels")
    url = f"redis://pusher:pw@127.0.0.1:{server.port}/0"
    store = RedisAdapterStore.from_url(url, base_config)
    with caplog.at_level(logging.WARNING, logger="loraplex.adapter_store.redis_store"):
        record = store.put("default", "a", load_adapter(make_adapter("a"), base_config))
    assert store.resolve("default", "a").digest == record.digest  # the version stands
    assert f"could not announce adapter {record.digest}" in caplog.text
    assert "loads at its first request" in caplog.text
    with pytest.raises(AdapterStoreError, match="NoPermission|NOPERM"):
        store.watch_stored(lambda digest: None)
    store.close()
    admin.close()


def test_the_fs_store_announces_nothing(tmp_path, base_config):
    assert FsAdapterStore(tmp_path / "store", base_config).watch_stored(lambda d: None) is None
