"""``loraplex serve`` in a subprocess on a free loopback port, for one-command benchmarks and
the end-to-end test; ``LocalCluster``: the deployed shape instead, ``loraplex worker``
processes behind a ``loraplex gateway`` process.

    with LocalServer(model="demo", serve_args=["--scheduling", "vtc"]) as server:
        log = asyncio.run(run_grpc(trace, server.address, config))

The server gets its own adapter store (a temporary data directory unless ``data_dir`` is
given), so a benchmark's uploads never land in the user's store; the model cache is shared
(``LORAPLEX_CACHE_DIR``) unless ``env`` overrides it. A cluster's processes share that data
directory, hence one ``fs:`` store, as pods share a Redis one.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from loraplex.loadtest.runner import wait_ready

CLI = (sys.executable, "-m", "loraplex.server.cli")


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux's
    ``ip_local_port_range``; 32768, its default, where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, chosen below the kernel's ephemeral range:
    a server started seconds later still finds it free, where a port from ``bind(0)`` could
    meanwhile become another process's outgoing connection (a gateway failed to bind its HTTP
    port so, while its two workers started). ``bind(0)``'s port where no lower one binds."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(max(1024, low - 12288), low) if low > 2048 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class _Local:
    """What ``LocalServer`` and ``LocalCluster`` share: the public ports (gRPC, HTTP), the data
    directory (a temporary one unless given) and the processes' environment."""

    def __init__(self, data_dir: str | os.PathLike[str] | None, env: Mapping[str, str] | None,
                 startup_timeout_s: float, tmp_prefix: str) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_port = free_port()
        self.http_url = f"http://127.0.0.1:{self.http_port}/v1"  # the OpenAI API's base URL
        self.startup_timeout_s = startup_timeout_s
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=tmp_prefix)
            data_dir = self._tmp.name
        self.data_dir = Path(data_dir)
        self.env = dict(os.environ, LORAPLEX_DATA_DIR=str(self.data_dir), **(env or {}))

    def _remove_tmp(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class LocalServer(_Local):
    """A ``loraplex serve`` subprocess, ready (health ``SERVING``) once entered.

    Args:
        model: ``--model`` (a directory or ``demo``).
        serve_args: more ``loraplex serve`` flags (engine, keys, limits).
        data_dir: the server's ``LORAPLEX_DATA_DIR`` (default: a temporary directory).
        env: extra environment variables for the server.
        startup_timeout_s: how long to wait for it to serve.

    Raises (on entry):
        RuntimeError: it exited or did not serve in time (its output is in the message).
    """

    def __init__(self, model: str = "demo", serve_args: Sequence[str] = (),
                 data_dir: str | os.PathLike[str] | None = None,
                 env: Mapping[str, str] | None = None, startup_timeout_s: float = 180.0
                 ) -> None:
        super().__init__(data_dir, env, startup_timeout_s, "loraplex-lt-")
        self.model = model
        self.serve_args = list(serve_args)
        self.log_path = self.data_dir / "server.log"
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        """The server process's id (for CPU accounting); RuntimeError when not running."""
        if self._proc is None:
            raise RuntimeError("loraplex serve is not running")
        return self._proc.pid

    @property
    def pids(self) -> list[int]:
        """Every server process (``LocalCluster``'s interface): the one."""
        return [self.pid]

    def __enter__(self) -> LocalServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        cmd = [*CLI, "serve", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", "-1",
               "--http-port", str(self.http_port), *self.serve_args]
        self._proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            asyncio.run(self._wait())
        except (TimeoutError, RuntimeError) as exc:
            output = self.output()
            self.stop()
            raise RuntimeError(f"loraplex serve did not start ({exc}):\n{output}") from None
        return self

    async def _wait(self) -> None:
        task = asyncio.create_task(wait_ready(self.address, self.startup_timeout_s))
        while not task.done():
            if self._proc is not None and self._proc.poll() is not None:
                task.cancel()
                raise RuntimeError(f"exited with status {self._proc.returncode}")
            await asyncio.sleep(0.2)
        task.result()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def output(self) -> str:
        """What the server printed so far."""
        try:
            return self.log_path.read_text()
        except OSError:
            return ""

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM (drain), then SIGKILL after ``grace_s``."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        self._remove_tmp()


class LocalCluster(_Local):
    """``workers`` ``loraplex worker`` processes and one ``loraplex gateway`` in front of them,
    each its own process on free loopback ports, ready (the gateway's health ``SERVING``, every
    worker's too) once entered: what a deployment runs, where ``LocalServer`` runs both in one
    process.

    Args:
        model: ``--model`` of every process (the gateway checks uploads against it).
        worker_args: more ``loraplex worker`` flags (engine, pool, limits).
        gateway_args: more ``loraplex gateway`` flags (keys, limits).
        workers: how many workers.
        data_dir, env, startup_timeout_s: as ``LocalServer``'s, shared by every process.

    Raises (on entry):
        RuntimeError: a process exited or did not serve in time (its output is in the message).
    """

    def __init__(self, model: str = "demo", worker_args: Sequence[str] = (),
                 gateway_args: Sequence[str] = (), workers: int = 1,
                 data_dir: str | os.PathLike[str] | None = None,
                 env: Mapping[str, str] | None = None, startup_timeout_s: float = 180.0
                 ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.model = model
        self.worker_args = list(worker_args)
        self.gateway_args = list(gateway_args)
        self.worker_ports = [free_port() for _ in range(workers)]
        self.worker_addresses = [f"127.0.0.1:{p}" for p in self.worker_ports]
        super().__init__(data_dir, env, startup_timeout_s, "loraplex-lc-")
        # name -> process, in start order (workers first: the gateway finds them serving)
        self._procs: dict[str, subprocess.Popen] = {}

    @property
    def pids(self) -> list[int]:
        """The processes' ids, workers first, gateway last (for CPU accounting)."""
        if not self._procs:
            raise RuntimeError("the cluster is not running")
        return [p.pid for p in self._procs.values()]

    def log_path(self, name: str) -> Path:
        """Where process ``name`` (``worker0``, ``worker1``, ..., ``gateway``) writes."""
        return self.data_dir / f"{name}.log"

    def __enter__(self) -> LocalCluster:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            for i, port in enumerate(self.worker_ports):
                self._start(f"worker{i}", [
                    "worker", "--model", self.model, "--host", "127.0.0.1", "--port", str(port),
                    "--metrics-port", "-1", "--worker-id", f"w{i}", *self.worker_args])
            # engines load in parallel; each must serve before the gateway starts
            for i, address in enumerate(self.worker_addresses):
                asyncio.run(self._wait(address, f"worker{i}"))
            self._start("gateway", [
                "gateway", "--model", self.model, "--host", "127.0.0.1", "--port",
                str(self.port), "--metrics-port", "-1", "--http-port", str(self.http_port),
                "--workers", ",".join(self.worker_addresses), *self.gateway_args])
            asyncio.run(self._wait(self.address, "gateway"))
        except (TimeoutError, RuntimeError) as exc:
            output = self.output()
            self.stop()
            raise RuntimeError(f"the local cluster did not start ({exc}):\n{output}") from None
        return self

    def _start(self, name: str, argv: list[str]) -> None:
        with open(self.log_path(name), "w") as log:
            self._procs[name] = subprocess.Popen([*CLI, *argv], env=self.env, stdout=log,
                                                 stderr=subprocess.STDOUT)

    async def _wait(self, address: str, name: str) -> None:
        task = asyncio.create_task(wait_ready(address, self.startup_timeout_s))
        while not task.done():
            for other, proc in self._procs.items():
                if proc.poll() is not None:
                    task.cancel()
                    raise RuntimeError(f"{other} exited with status {proc.returncode}")
            await asyncio.sleep(0.2)
        try:
            task.result()
        except TimeoutError as exc:
            raise TimeoutError(f"{name}: {exc}") from None

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def output(self) -> str:
        """What every process printed so far, each under its name."""
        parts = []
        for name in self._procs:
            try:
                parts.append(f"--- {name}\n{self.log_path(name).read_text()}")
            except OSError:
                pass
        return "\n".join(parts)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the gateway, then the workers (each drains), SIGKILL after ``grace_s``."""
        for name in reversed(list(self._procs)):
            proc = self._procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._procs.clear()
        self._remove_tmp()
