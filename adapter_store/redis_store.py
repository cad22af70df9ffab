"""The Redis backend (for clusters): chunked blobs, manifest last, atomic version numbers.

A put streams the blob in chunks (4 MiB by default, far under Redis's 512 MB value cap) to
expiring staging keys, each chunk's CRC-32 noted, then one Lua script (``redis_scripts.COMMIT``)
checks every staged chunk is still there, renames them into place, writes the manifest and
allocates the version (``INCR``) and its record. Until that script runs nothing is visible; if
the client or the server dies first, the staging keys expire. A fetch reads the manifest,
then the chunks (pipelined), checks each chunk's length and CRC, and verifies the whole blob
against the digest: a missing or damaged chunk is an :class:`AdapterStoreError`, never a wrong
adapter. The key layout is in ``redis_scripts.py``. Run Redis with AOF persistence
(``appendonly yes``); ``appendfsync always`` makes an acknowledged put survive a crash.

After the commit a put publishes its digest on ``P:stored``; ``watch_stored`` subscribes
(gateways warm the adapter on a worker, whoever pushed it). Pub/Sub is fire and forget: a
watcher disconnected at that moment misses the message, and that adapter loads at its first
request as it would unwatched.

Needs one Redis server (or a primary with replicas): the scripts touch keys of several hash
slots, so Redis Cluster is not supported.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from loraplex.adapter_store import redis_scripts
from loraplex.adapter_store.blob import adapter_from_blob, rechunk, verified_pieces
from loraplex.adapter_store.errors import AdapterNotFound, AdapterStoreError
from loraplex.adapter_store.format import CanonicalAdapter
from loraplex.adapter_store.store import AdapterStore, AdapterVersion, Progress, check_digest
from loraplex.server.engine.models.config import ModelConfig

DEFAULT_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 256 << 20
DEFAULT_PREFIX = "loraplex"
STAGING_TTL_S = 24 * 3600
PIPELINE_CHUNKS = 4  # chunks per round trip, each way
WATCH_POLL_S = 1.0  # how long the watch thread blocks for a message before checking stop
WATCH_RETRY_S = 2.0  # after the watch lost its connection, before trying again

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RedisAdapterStore(AdapterStore):
    """Adapters in Redis; see the module docstring.

    Args:
        client: a redis-py client (``decode_responses=False``); its pool is shared by threads.
        base_config: as for :class:`AdapterStore`.
        prefix: the key prefix (several deployments can share one database).
        chunk_bytes: blob chunk size for puts (fetches follow each blob's manifest).
        pipeline_chunks: chunks sent or read per round trip.
        label: how errors name the server (never includes a password).
    """

    def __init__(self, client: redis.Redis, base_config: ModelConfig | None = None, *,
                 prefix: str = DEFAULT_PREFIX, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 pipeline_chunks: int = PIPELINE_CHUNKS, label: str = "redis") -> None:
        super().__init__(base_config)
        if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES or pipeline_chunks < 1:
            raise ValueError("chunk_bytes must be in [1, 256 MiB], pipeline_chunks >= 1")
        if ":" in prefix:
            raise ValueError("prefix must not contain ':'")
        self.client = client
        self.prefix = prefix
        self.chunk_bytes = chunk_bytes
        self.pipeline_chunks = pipeline_chunks
        self.label = label
        self._commit = client.register_script(redis_scripts.COMMIT)
        self._delete_script = client.register_script(redis_scripts.DELETE)

    @classmethod
    def from_url(cls, url: str, base_config: ModelConfig | None = None,
                 **kwargs: Any) -> RedisAdapterStore:
        """Connect with a pooled client and check the server answers (``PING``).

        ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` for TLS (query
        parameters such as ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``), or
        ``unix://path?db=N``; query parameters override the defaults here.

        Raises:
            AdapterStoreError: unreachable, or authentication failed.
        """
        try:
            client = redis.Redis.from_url(
                url, socket_connect_timeout=5, socket_timeout=60, health_check_interval=30,
                socket_read_size=1 << 20,  # chunks are MiBs: fewer recv() calls and copies
                retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 2))
        except ValueError as e:
            raise ValueError(f"redis URL: {e}") from e
        conn = client.connection_pool.connection_kwargs
        where = conn.get("path") or f"{conn.get('host', '?')}:{conn.get('port', '?')}"
        store = cls(client, base_config, label=f"redis {where}/{conn.get('db', 0)}", **kwargs)
        store._call(client.ping)
        return store

    def close(self) -> None:
        """Disconnect the pool."""
        self.client.close()

    def _put(self, adapter: CanonicalAdapter, record: AdapterVersion,
             progress: Progress | None) -> AdapterVersion:
        token = secrets.token_hex(16)
        staged: list[str] = []
        crcs: list[int] = []
        nbytes = 0
        try:
            pipe = self.client.pipeline(transaction=False)
            pending = 0
            for chunk in rechunk(verified_pieces(adapter), self.chunk_bytes):
                key = self._k(f"upload:{token}:{len(staged)}")
                pipe.set(key, chunk, ex=STAGING_TTL_S)
                staged.append(key)
                crcs.append(zlib.crc32(chunk))
                nbytes += len(chunk)
                pending += len(chunk)
                if len(pipe) >= self.pipeline_chunks:
                    self._call(pipe.execute)
                    if progress is not None:
                        progress(pending)
                    pending = 0
            if len(pipe):
                self._call(pipe.execute)
                if progress is not None:
                    progress(pending)
            digest = record.digest
            manifest = {"nbytes": nbytes, "chunk_bytes": self.chunk_bytes, "crc32": crcs}
            blob = self._k(f"blob:{digest}")
            keys = [blob, f"{blob}:refs", self._k(f"tenant:{record.tenant}:names"),
                    self._versions_key(record.tenant, record.name),
                    self._versions_key(record.tenant, record.name) + ":next",
                    self._k(f"upload:{token}:committed"),
                    *staged, *(f"{blob}:{i}" for i in range(len(staged)))]
            args = [len(staged), json.dumps(manifest), record.name,
                    json.dumps(record.to_record()), f"{record.tenant}/{record.name}@",
                    f"{blob}:", STAGING_TTL_S]
            version = int(self._call(lambda: self._commit(keys=keys, args=args)))
        except BaseException:
            self._discard(staged)
            raise
        self._announce(record.digest)
        return dataclasses.replace(record, version=version)

    def _announce(self, digest: str) -> None:
        """Publish a committed put's digest (``watch_stored``). The version stands whatever
        happens here: a failure is logged, not raised."""
        try:
            self.client.publish(self._k("stored"), digest)
        except redis.RedisError as e:
            logger.warning("%s: could not announce adapter %s to watching gateways (%s: %s); "
                           "it loads at its first request", self.label, digest,
                           type(e).__name__, e)

    def watch_stored(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Subscribe to ``P:stored`` on a daemon thread; ``callback`` gets each valid digest
        (anything else published there is logged and dropped). A lost connection is retried
        every ``WATCH_RETRY_S`` and subscribes again (logged once until a message comes
        through); what was published meanwhile is missed.

        Raises:
            AdapterStoreError: the first subscription failed (nothing is watched).
        """
        pubsub = self.client.pubsub()  # the thread ignores confirmations; the first is read here
        channel = self._k("stored")
        failing = threading.Event()  # logged once per outage

        def deliver(message: dict[str, Any]) -> None:
            failing.clear()
            data = message.get("data")
            try:
                digest = check_digest(data.decode("ascii") if isinstance(data, bytes)
                                      else str(data))
            except (ValueError, UnicodeDecodeError):
                logger.warning("%s: %s carried %r, not a digest; ignored", self.label, channel,
                               data[:80] if isinstance(data, bytes | str) else data)
                return
            try:
                callback(digest)
            except Exception:  # the watcher's bug must not end the watch
                logger.exception("%s: the stored-adapter callback failed for %s", self.label,
                                 digest)

        def lost(exc: BaseException, *_: object) -> None:
            if not failing.is_set():
                failing.set()
                logger.warning("%s: watching %s failed (%s: %s); retrying every %.0f s",
                               self.label, channel, type(exc).__name__, exc, WATCH_RETRY_S)
            time.sleep(WATCH_RETRY_S)

        def subscribe() -> None:  # SUBSCRIBE's reply (or refusal) comes as its first message
            pubsub.subscribe(**{channel: deliver})
            reply = pubsub.get_message(ignore_subscribe_messages=False, timeout=5.0)
            if not isinstance(reply, dict) or reply.get("type") != "subscribe":
                raise redis.ConnectionError(f"SUBSCRIBE {channel} not confirmed ({reply!r})")

        try:
            self._call(subscribe)
        except AdapterStoreError:
            pubsub.close()
            raise
        thread = pubsub.run_in_thread(sleep_time=WATCH_POLL_S, daemon=True,
                                      exception_handler=lost)
        thread.name = "loraplex-store-watch"
        return lambda: thread.stop(timeout=WATCH_POLL_S + WATCH_RETRY_S + 1.0)

    def _versions(self, tenant: str, name: str) -> list[AdapterVersion]:
        raw = self._call(lambda: self.client.hgetall(self._versions_key(tenant, name)))
        out = []
        for version, doc in raw.items():
            try:
                out.append(AdapterVersion.from_record(tenant, name, int(version),
                                                      json.loads(doc)))
            except ValueError as e:
                raise AdapterStoreError(f"{self.label}: metadata of {name}@{version!r} is "
                                        f"corrupt ({e})") from e
        return out

    def _names(self, tenant: str) -> list[str]:
        raw = self._call(lambda: self.client.smembers(self._k(f"tenant:{tenant}:names")))
        return [n.decode() if isinstance(n, bytes) else n for n in raw]

    def _delete(self, tenant: str, name: str, version: int | None) -> list[AdapterVersion]:
        keys = [self._versions_key(tenant, name), self._k(f"tenant:{tenant}:names")]
        args = [name, "" if version is None else str(version), self.prefix, f"{tenant}/{name}@"]
        flat = self._call(lambda: self._delete_script(keys=keys, args=args))
        out = []
        for v, doc in zip(flat[::2], flat[1::2]):
            try:
                out.append(AdapterVersion.from_record(tenant, name, int(v), json.loads(doc)))
            except (ValueError, AdapterStoreError):
                continue  # a corrupt record is deleted all the same; nothing to report
        return out

    def _fetch(self, digest: str) -> CanonicalAdapter:
        blob = self._k(f"blob:{digest}")
        raw = self._call(lambda: self.client.hget(blob, "manifest"))
        if raw is None:
            raise AdapterNotFound(f"no adapter with digest {digest}")
        nbytes, chunk_bytes, crcs = self._parse_manifest(digest, raw)
        buf = bytearray(nbytes)
        for start in range(0, len(crcs), self.pipeline_chunks):
            pipe = self.client.pipeline(transaction=False)
            batch = range(start, min(start + self.pipeline_chunks, len(crcs)))
            for i in batch:
                pipe.get(f"{blob}:{i}")
            for i, data in zip(batch, self._call(pipe.execute)):
                want = min(chunk_bytes, nbytes - i * chunk_bytes)
                if data is None:
                    self._broken(digest, f"chunk {i} of {len(crcs)} is missing")
                if len(data) != want or zlib.crc32(data) != crcs[i]:
                    self._broken(digest, f"chunk {i} of {len(crcs)} is corrupt (length or "
                                 "CRC-32 mismatch)")
                buf[i * chunk_bytes:i * chunk_bytes + want] = data
        return adapter_from_blob(buf, digest)

    def _parse_manifest(self, digest: str, raw: bytes | str) -> tuple[int, int, list[int]]:
        try:
            doc = json.loads(raw)
            nbytes, chunk_bytes, crcs = doc["nbytes"], doc["chunk_bytes"], doc["crc32"]
            if (type(nbytes) is not int or type(chunk_bytes) is not int
                    or not 1 <= chunk_bytes <= MAX_CHUNK_BYTES
                    or not isinstance(crcs, list) or nbytes < 0
                    or len(crcs) != -(-nbytes // chunk_bytes)
                    or not all(type(c) is int for c in crcs)):
                raise ValueError("inconsistent sizes")
        except (ValueError, KeyError, TypeError) as e:
            self._broken(digest, f"manifest is corrupt ({e})")
        return nbytes, chunk_bytes, crcs

    def _discard(self, keys: list[str]) -> None:
        # Best effort: if Redis is gone the staging keys expire on their own.
        try:
            if keys:
                self.client.delete(*keys)
        except redis.RedisError:
            pass

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except redis.AuthenticationError as e:
            hint = "" if self.client.connection_pool.connection_kwargs.get("password") else \
                "; the URL gives no password: redis://[user]:PASSWORD@host:port/db"
            raise AdapterStoreError(f"{self.label}: authentication failed ({e}{hint})") from e
        except redis.RedisError as e:
            raise AdapterStoreError(f"{self.label}: {type(e).__name__}: {e}") from e

    def _broken(self, digest: str, reason: str) -> NoReturn:
        raise AdapterStoreError(f"{self.label}: adapter blob {digest}: {reason}")

    def _k(self, suffix: str) -> str:
        return f"{self.prefix}:{suffix}"

    def _versions_key(self, tenant: str, name: str) -> str:
        return self._k(f"tenant:{tenant}:adapter:{name}")
