"""In-process and subprocess loraplex servers for the end-to-end tests (real gRPC on
loopback)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from loraplex.adapter_store.store import AdapterStore, open_store
from loraplex.server.auth import KeyRing, hash_key
from loraplex.server.client import Client
from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.stats import EngineStats
from loraplex.server.gateway import Gateway, GatewayConfig
from loraplex.server.quota import open_quota_backend
from loraplex.server.worker import WorkerConfig, WorkerServer, build_engine

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]


class LoopThread:
    """An asyncio loop on its own thread (servers live there; tests call from the main
    thread, so blocking clients never run on the servers' loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def engine_config(model_dir: Path, **overrides: Any) -> EngineConfig:
    sched_fields = SchedulerConfig.__dataclass_fields__
    sched = {k: overrides.pop(k) for k in list(overrides) if k in sched_fields}
    overrides.setdefault("num_pages", 256)
    return EngineConfig(model=str(model_dir), scheduler=SchedulerConfig(**sched), **overrides)


class Cluster:
    """Workers (in this process, each with its engine thread) and a gateway.

    Args:
        model_dir: the base model.
        store_dir: the fs adapter store shared by the gateway and the workers, or a store spec
            (``redis://...``: tenant quotas are then shared through that Redis too).
        num_workers: in-process workers to start.
        extra_workers: addresses of workers run elsewhere (subprocesses).
        keys: API key file for the gateway (None: keyless).
        engine: EngineConfig overrides for every worker.
        worker / gateway: WorkerConfig / GatewayConfig overrides.
    """

    def __init__(self, model_dir: Path, store_dir: Path | str, num_workers: int = 1,
                 extra_workers: tuple[str, ...] = (), keys: Path | None = None,
                 engine: dict[str, Any] | None = None, worker: dict[str, Any] | None = None,
                 gateway: dict[str, Any] | None = None) -> None:
        self.loop = LoopThread()
        self.model_dir = model_dir
        self.base = ModelConfig.from_pretrained(model_dir)
        spec = store_dir if isinstance(store_dir, str) else f"fs:{store_dir}"
        self.store: AdapterStore = open_store(spec, self.base)
        self.workers: list[WorkerServer] = []
        for _ in range(num_workers):
            eng = build_engine(engine_config(model_dir, **(engine or {})), self.store)
            server = WorkerServer(eng, WorkerConfig(port=0, **(worker or {})))
            self.loop.run(server.start())
            self.workers.append(server)
        addresses = tuple(w.address for w in self.workers) + extra_workers
        # The HTTP API stays off unless a test asks for it (gateway={"http_port": 0}).
        config = GatewayConfig(**{"port": 0, "metrics_port": 0, "http_port": -1,
                                  "workers": addresses, **(gateway or {})})
        self.keys = KeyRing(path=str(keys)) if keys is not None else KeyRing()
        self.gateway = Gateway(config, self.store, self.base, self.keys,
                               quota_backend=open_quota_backend(spec, config.quota_lease_seconds))
        self.loop.run(self.gateway.start(wait_for_workers=10.0 if num_workers else 0.0))
        self.address = self.gateway.address
        self.http_url = self.gateway.http_url  # http[s]://host:port, None when off

    def client(self, api_key: str | None = None, timeout: float | None = 30.0) -> Client:
        return Client(self.address, api_key=api_key or "", timeout=timeout)

    def stats(self, i: int = 0) -> EngineStats:
        """A fresh snapshot of worker ``i``'s engine (taken on its engine thread's terms:
        the counters are plain ints read between steps)."""
        return self.workers[i].engine.stats()

    def wait_idle(self, i: int = 0, timeout: float = 5.0) -> EngineStats:
        """Wait until worker ``i`` runs and queues nothing and holds no KV pages."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats(i)
            if (s.num_running == 0 and s.num_waiting == 0 and s.pages.num_kv == 0
                    and not self.workers[i].engine.has_unfinished()):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"worker {i} not idle after {timeout} s: {s}")
            time.sleep(0.01)

    def close(self) -> None:
        try:
            self.loop.run(self.gateway.stop())
            for w in self.workers:
                self.loop.run(w.stop())
        finally:
            self.loop.close()
            self.store.close()


def write_keys(path: Path, entries: dict[str, tuple[str, bool]]) -> Path:
    """A key file: ``{key: (tenant, admin)}``; written atomically, as an operator's tools
    would."""
    lines = ["# sha256  tenant  [role]"]
    lines += [f"{hash_key(k)}  {tenant}{'  admin' if admin else ''}"
              for k, (tenant, admin) in entries.items()]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


class WorkerProcess:
    """``loraplex worker`` in a subprocess, killed by its pid."""

    def __init__(self, model_dir: Path, store_dir: Path, *args: str,
                 env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "loraplex.server.cli", "worker", "--model", str(model_dir),
               "--store", f"fs:{store_dir}", "--port", "0", "--metrics-port", "-1",
               "--num-pages", "256", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        self.address = ""

    def wait_ready(self, timeout: float = 60.0) -> str:
        line = read_line(self.proc, "loraplex worker listening on ", timeout)
        self.address = line.rsplit(" ", 1)[-1]
        return self.address

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stderr(self) -> str:
        return self.proc.stderr.read() if self.proc.stderr else ""


def read_line(proc: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    """The first stdout line starting with ``prefix`` (a thread reads, so the wait is
    bounded)."""
    found: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(prefix):
                found.append(line.strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not found:
        proc.kill()
        err = proc.stderr.read() if proc.stderr else ""
        raise AssertionError(f"no {prefix!r} line within {timeout} s; stderr:\n{err[-3000:]}")
    return found[0]


def counter_total(registry: CollectorRegistry, name: str) -> float:
    """The sum of a counter's ``_total`` samples over every label set."""
    return sum(sample.value for metric in registry.collect() if metric.name == name
               for sample in metric.samples if sample.name == f"{name}_total")


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.01)
