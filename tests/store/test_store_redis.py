"""The Redis backend against real redis-server processes: crashes, damage, AUTH, db, TLS."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import redis

from loraplex.adapter_store.errors import AdapterNotFound, AdapterStoreError
from loraplex.adapter_store.format import load_adapter
from loraplex.adapter_store.redis_store import RedisAdapterStore
from loraplex.adapter_store.store import open_store
from loraplex.server.engine.models.config import LORA_MODULES

pytestmark = pytest.mark.redis

AOF_ALWAYS = ("--appendonly", "yes", "--appendfsync", "always")


def test_sigkill_mid_upload_keeps_the_first_and_hides_the_second(redis_factory, make_adapter,
                                                                base_config):
    server = redis_factory(*AOF_ALWAYS)
    first = load_adapter(make_adapter("a", seed=1, targets=LORA_MODULES), base_config)
    second = load_adapter(make_adapter("b", seed=2, targets=LORA_MODULES), base_config)
    store = RedisAdapterStore.from_url(server.url, base_config, chunk_bytes=1024,
                                       pipeline_chunks=1)
    assert store.put("default", "first", first).version == 1
    chunks_written = []

    def kill_after_first_chunk(nbytes: int) -> None:
        chunks_written.append(nbytes)
        if len(chunks_written) == 1:
            server.kill()  # SIGKILL, by pid: no shutdown, no final fsync
    with pytest.raises(AdapterStoreError):
        store.put("default", "second", second, progress=kill_after_first_chunk)
    assert chunks_written == [1024]
    store.close()

    server.start()  # same port, same directory: replays the AOF
    store = RedisAdapterStore.from_url(server.url, base_config)
    raw = redis.Redis.from_url(server.url)
    staged = [k for k in raw.keys("loraplex:upload:*") if k.rsplit(b":", 1)[1].isdigit()]
    assert len(staged) == 1 and 0 < raw.ttl(staged[0])  # the first chunk reached the disk
    assert [(r.name, r.version, r.digest) for r in store.list("default")] == [
        ("first", 1, first.digest)]
    with pytest.raises(AdapterNotFound):
        store.resolve("default", "second")
    with pytest.raises(AdapterNotFound):
        store.fetch(second.digest)
    got = store.fetch(first.digest)
    assert got == first
    assert all(ga.equal(a) and gb.equal(b) for (ga, gb), (a, b) in
               zip(got.weights.values(), first.weights.values()))
    assert store.put("default", "second", second).version == 1
    raw.close()
    store.close()


def _chunks(client: redis.Redis, digest: str) -> list[str]:
    return sorted((k.decode() for k in client.keys(f"loraplex:blob:{digest}:*")
                   if k.decode().rsplit(":", 1)[1].isdigit()),
                  key=lambda k: int(k.rsplit(":", 1)[1]))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest", "swap"])
def test_damaged_chunk_is_detected(damage, redis_url, make_adapter, base_config):
    store = RedisAdapterStore.from_url(redis_url, base_config, chunk_bytes=512)
    adapter = load_adapter(make_adapter(), base_config)
    store.put("default", "x", adapter)
    client = redis.Redis.from_url(redis_url)
    chunks = _chunks(client, adapter.digest)
    assert len(chunks) > 3
    key = chunks[2]
    if damage == "flip":
        byte = client.getrange(key, 7, 7)[0]
        client.setrange(key, 7, bytes([byte ^ 0x04]))
    elif damage == "truncate":
        client.set(key, client.get(key)[:-1])
    elif damage == "delete":
        client.delete(key)
    elif damage == "manifest":
        client.hset(f"loraplex:blob:{adapter.digest}", "manifest", b"{not json")
    else:  # two chunks swapped: each chunk is intact, the blob is not
        a, b = client.get(chunks[1]), client.get(chunks[2])
        client.set(chunks[1], b)
        client.set(chunks[2], a)
        manifest = json.loads(client.hget(f"loraplex:blob:{adapter.digest}", "manifest"))
        manifest["crc32"][1], manifest["crc32"][2] = manifest["crc32"][2], manifest["crc32"][1]
        client.hset(f"loraplex:blob:{adapter.digest}", "manifest", json.dumps(manifest))
    with pytest.raises(AdapterStoreError, match=adapter.digest) as err:
        store.fetch(adapter.digest)
    if damage in ("flip", "truncate", "delete"):
        assert "chunk 2 " in str(err.value)
    client.close()
    store.close()


def test_delete_removes_every_key_of_an_unreferenced_blob(redis_url, make_adapter,
                                                          base_config):
    store = RedisAdapterStore.from_url(redis_url, base_config, chunk_bytes=256)
    adapter = load_adapter(make_adapter(), base_config)
    store.put("default", "x", adapter)
    store.put("default", "x", adapter)
    store.delete("default", "x")
    client = redis.Redis.from_url(redis_url)
    assert sorted(k.decode() for k in client.keys("*")) == [
        "loraplex:tenant:default:adapter:x:next"] + sorted(
        k.decode() for k in client.keys("loraplex:upload:*:committed"))
    client.close()


def test_auth_password_and_acl_user(redis_factory, make_adapter, base_config):
    server = redis_factory("--user", "alice", "on", ">wonderland", "~loraplex:*", "+@all",
                           password="s3cret")
    adapter = load_adapter(make_adapter(), base_config)
    with open_store(server.url, base_config) as store:  # default user, requirepass
        store.put("default", "x", adapter)
    host = f"127.0.0.1:{server.port}"
    with open_store(f"redis://alice:wonderland@{host}/0", base_config) as store:
        assert store.fetch(adapter.digest) == adapter
    for url in (f"redis://{host}/0", f"redis://:wrong@{host}/0",
                f"redis://alice:wrong@{host}/0"):
        with pytest.raises(AdapterStoreError) as err:
            open_store(url, base_config)
        assert "wrong" not in str(err.value) and "s3cret" not in str(err.value)


def test_databases_are_separate(redis_url, make_adapter, base_config):
    db1, db2 = redis_url.replace("/0", "/1"), redis_url.replace("/0", "/2")
    adapter = load_adapter(make_adapter(), base_config)
    with open_store(db1, base_config) as one, open_store(db2, base_config) as two:
        one.put("default", "x", adapter)
        assert two.list("default") == []
        with pytest.raises(AdapterNotFound):
            two.fetch(adapter.digest)
        assert one.resolve("default", "x").digest == adapter.digest
    with open_store(f"{redis_url}?db=1".replace("/0?", "/?"), base_config) as again:
        assert again.resolve("default", "x").digest == adapter.digest


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_tls(redis_factory, make_adapter, base_config, tmp_path):
    tls = _self_signed(tmp_path / "tls")
    server = redis_factory(tls=tls)
    adapter = load_adapter(make_adapter(), base_config)
    with open_store(server.url, base_config) as store:
        store.put("default", "x", adapter)
        assert store.fetch(adapter.digest) == adapter
    with pytest.raises(AdapterStoreError):  # plain TCP to a TLS port
        open_store(f"redis://localhost:{server.port}/0?socket_timeout=2", base_config)


def test_unreachable_server_is_a_clear_error(redis_factory):
    server = redis_factory()
    url = server.url
    server.stop()
    with pytest.raises(AdapterStoreError, match="127.0.0.1"):
        open_store(url)


def test_restart_without_persistence_never_serves_a_wrong_adapter(redis_factory, make_adapter,
                                                                  base_config):
    server = redis_factory()  # no AOF, no snapshots
    adapter = load_adapter(make_adapter(), base_config)
    store = RedisAdapterStore.from_url(server.url, base_config)
    store.put("default", "x", adapter)
    server.kill()
    with pytest.raises(AdapterStoreError):
        store.fetch(adapter.digest)
    server.start()
    with pytest.raises(AdapterNotFound):  # the pool reconnects; the data is gone
        store.fetch(adapter.digest)
    with pytest.raises(AdapterNotFound):
        store.resolve("default", "x")
    store.close()


def _self_signed(directory: Path) -> dict[str, str]:
    directory.mkdir()
    key, cert = directory / "server.key", directory / "server.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return {"cert": str(cert), "key": str(key), "ca": str(cert)}
