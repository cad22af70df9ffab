"""``loraplex serve`` in a subprocess on a free loopback port, for one-command benchmarks and
the end-to-end test.

    with LocalServer(model="demo", serve_args=["--scheduling", "vtc"]) as server:
        log = asyncio.run(run_grpc(trace, server.address, config))

The server gets its own adapter store (a temporary data directory unless ``data_dir`` is
given), so a benchmark's uploads never land in the user's store; the model cache is shared
(``LORAPLEX_CACHE_DIR``) unless ``env`` overrides it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from loraplex.loadtest.runner import wait_ready


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalServer:
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
        self.model = model
        self.serve_args = list(serve_args)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_port = free_port()
        self.http_url = f"http://127.0.0.1:{self.http_port}/v1"  # the OpenAI API's base URL
        self.startup_timeout_s = startup_timeout_s
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="loraplex-lt-")
            data_dir = self._tmp.name
        self.data_dir = Path(data_dir)
        self.env = dict(os.environ, LORAPLEX_DATA_DIR=str(self.data_dir), **(env or {}))
        self.log_path = self.data_dir / "server.log"
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        """The server process's id (for CPU accounting); RuntimeError when not running."""
        if self._proc is None:
            raise RuntimeError("loraplex serve is not running")
        return self._proc.pid

    def __enter__(self) -> LocalServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "loraplex.server.cli", "serve", "--model", self.model,
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
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
