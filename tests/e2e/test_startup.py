"""The first minutes with the real commands: start-up mistakes are one line on stderr and a
non-zero exit (no traceback, before the model loads), two ``loraplex serve`` share a host,
and ``loraplex generate`` says how to pass a key a server wants."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.server.cli import main as cli_main
from tests.e2e.harness import Cluster, read_line, write_keys

CLI = [sys.executable, "-m", "loraplex.server.cli"]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port some other process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _fails(*args: str, timeout: float = 60.0) -> str:
    """Run a command that must fail at start; its one stderr line."""
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["serve", "worker", "gateway"])
def test_a_taken_grpc_port_is_one_line_naming_port_and_flag(
        command: str, taken_port: int, model_dir: Path, tmp_path: Path) -> None:
    extra = ["--workers", "127.0.0.1:1"] if command == "gateway" else []
    line = _fails(command, "--model", str(model_dir), "--store", f"fs:{tmp_path}",
                  "--port", str(taken_port), "--metrics-port", "-1", *extra)
    assert line.startswith(f"loraplex {command}: --port {taken_port}: ")
    assert "already in use" in line


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_a_taken_metrics_port_is_one_line_naming_port_and_flag(
        command: str, taken_port: int, model_dir: Path, tmp_path: Path) -> None:
    line = _fails(command, "--model", str(model_dir), "--store", f"fs:{tmp_path}",
                  "--port", "0", "--metrics-port", str(taken_port))
    assert line.startswith(f"loraplex {command}: --metrics-port {taken_port}: ")
    assert "already in use" in line


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_an_unreadable_key_file_stops_the_server(command: str, model_dir: Path,
                                                 tmp_path: Path) -> None:
    missing = tmp_path / "no-such-keys"
    extra = ["--workers", "127.0.0.1:1"] if command == "gateway" else []
    line = _fails(command, "--model", str(model_dir), "--store", f"fs:{tmp_path}",
                  "--port", "0", "--api-keys", str(missing), *extra)
    assert line == f"loraplex {command}: --api-keys {missing}: cannot read it (No such file " \
        "or directory)"


@pytest.mark.parametrize("command", ["serve", "worker", "gateway"])
def test_a_missing_model_path_is_named(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    extra = ["--workers", "127.0.0.1:1"] if command == "gateway" else []
    line = _fails(command, "--model", str(missing), "--store", f"fs:{tmp_path}",
                  "--port", "0", *extra)
    assert line.startswith(f"loraplex {command}: ") and str(missing) in line
    assert "does not exist" in line or "no config.json" in line


def _serve(model_dir: Path, store: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CLI, "serve", "--model", str(model_dir), "--port", "0", "--http-port", "0",
         "--num-pages", "64", "--store", f"fs:{store}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "LORAPLEX_DRAIN_GRACE": "1"})


def test_two_servers_with_default_metrics_ports_share_a_host(model_dir: Path,
                                                             tmp_path: Path) -> None:
    procs = [_serve(model_dir, tmp_path / f"store{i}") for i in range(2)]
    try:
        metrics = []
        for proc in procs:
            read_line(proc, "loraplex serving ", timeout=90)
            line = read_line(proc, "metrics: http://127.0.0.1:", timeout=10)
            metrics.append(int(line.rsplit(":", 1)[1].split("/", 1)[0]))
            assert proc.poll() is None
        assert metrics[0] != metrics[1]
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            finally:
                proc.kill()


def test_generate_without_a_key_says_how_to_pass_one(
        model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPLEX_API_KEY", raising=False)
    keys = write_keys(tmp_path / "keys", {"sk-acme": ("acme", False)})
    cluster = Cluster(model_dir, tmp_path / "store", keys=keys)
    try:
        assert cli_main(["generate", "--server", cluster.address, "Hello"]) == 1
        err = capsys.readouterr().err
        assert "UNAUTHENTICATED" in err
        assert "pass --api-key KEY or set LORAPLEX_API_KEY" in err
        assert cli_main(["generate", "--server", cluster.address, "--api-key", "sk-acme",
                         "--max-tokens", "2", "Hello"]) == 0
        assert cli_main(["generate", "--server", cluster.address, "--api-key", "sk-acme",
                         "--max-tokens", "2", "--chat", "Hello"]) == 0
        out, err = capsys.readouterr()
        assert "[" in err and " completion tokens" in err
    finally:
        cluster.close()


def test_a_port_taken_after_the_check_is_still_one_clear_error(
        taken_port: int, model_dir: Path, tmp_path: Path) -> None:
    """The race the early check cannot close: grpc's bare "Failed to bind" becomes a
    ``StartupError`` naming the port and the flag."""
    import asyncio

    from loraplex.adapter_store.store import open_store
    from loraplex.server.auth import KeyRing
    from loraplex.server.engine.models.config import ModelConfig
    from loraplex.server.gateway import Gateway, GatewayConfig
    from loraplex.server.startup import StartupError

    base = ModelConfig.from_pretrained(model_dir)
    store = open_store(f"fs:{tmp_path}", base)
    gateway = Gateway(GatewayConfig(port=taken_port, workers=("127.0.0.1:1",)), store, base,
                      KeyRing())
    try:
        with pytest.raises(StartupError, match=f"--port {taken_port}: cannot listen on "):
            asyncio.run(gateway.start())
    finally:
        asyncio.run(gateway.stop())
        store.close()
