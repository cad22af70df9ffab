"""A real ``redis-server`` for tests: its own directory, a free loopback port, stopped by pid
(shared by the store and end-to-end suites)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from loraplex.loadtest.local_server import free_port

REDIS_BIN = shutil.which("redis-server")


def _free_port() -> int:
    return free_port()  # below the ephemeral range: nothing outgoing takes it meanwhile


class RedisServer:
    """A ``redis-server`` in its own directory on a free port, controlled by pid."""

    def __init__(self, workdir: Path, *args: str, password: str | None = None,
                 tls: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.args = args
        self.password = password
        self.tls = tls
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}localhost:{self.port}/0?ssl_ca_certs={self.tls['ca']}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        log = self.workdir / "redis.log"
        log.write_text("")
        port_args = ["--port", str(self.port)]
        if self.tls:
            port_args = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file",
                         self.tls["cert"], "--tls-key-file", self.tls["key"],
                         "--tls-ca-cert-file", self.tls["ca"], "--tls-auth-clients", "no"]
        cmd = [REDIS_BIN or "redis-server", *port_args, "--bind", "127.0.0.1",
               "--dir", str(self.workdir), "--logfile", str(log), "--save", "",
               "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no",
               *(["--requirepass", self.password] if self.password else []), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if "Ready to accept connections" in log.read_text(errors="replace"):
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not start: {log.read_text()[-2000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
