"""``loraplex serve`` in a subprocess, driven by ``loraplex generate``, ``demo-adapter`` and
``adapters push --server``; SIGTERM drains it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.server.cli import main as cli_main
from loraplex.server.client import Client
from tests.e2e.harness import read_line


def test_serve_generate_push_and_sigterm(model_dir: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplex.server.cli", "serve", "--model", str(model_dir),
         "--port", "0", "--metrics-port", "0", "--http-port", "0", "--num-pages", "128",
         "--store", f"fs:{tmp_path / 'store'}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "LORAPLEX_DRAIN_GRACE": "5"})
    try:
        banner = read_line(proc, "loraplex serving ", timeout=60)
        address = banner.split(" on ", 1)[1].split(" ", 1)[0]

        assert cli_main(["generate", "--server", address, "--max-tokens", "6", "--seed", "1",
                         "Hello"]) == 0
        out, err = capsys.readouterr()
        assert "[length: " in err and " + 6 completion tokens" in err
        with Client(address, api_key="") as client:
            assert out.rstrip("\n") == client.generate("Hello", max_tokens=6, seed=1).text
        assert cli_main(["generate", "--server", address, "--max-tokens", "6", "--system",
                         "Be brief.", "--chat", "Hello"]) == 0
        out, err = capsys.readouterr()
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
        with Client(address, api_key="") as client:
            assert out.rstrip("\n") == client.generate(messages=chat, max_tokens=6).text
        assert cli_main(["generate", "--server", address, "--system", "x", "Hello"]) == 2
        capsys.readouterr()
        assert cli_main(["generate", "--server", address, "--max-tokens", "20", "--regex",
                         "[0-9]{3}-[a-z]{2}", "Hello"]) == 0
        out, err = capsys.readouterr()
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", out.rstrip("\n")) and "[stop: " in err
        assert cli_main(["generate", "--server", address, "--grammar", "root ::= (",
                         "Hello"]) == 1
        _, err = capsys.readouterr()
        assert "INVALID_ARGUMENT: structured.grammar: does not compile" in err

        args = ["--max-tokens", "4", "--logit-bias", "65=100", "--min-tokens", "2",
                "--repetition-penalty", "1.2", "--presence-penalty", "0.5",
                "--frequency-penalty", "0.5", "--min-p", "0.1"]
        assert cli_main(["generate", "--server", address, *args, "Hello"]) == 0
        out, _ = capsys.readouterr()
        with Client(address, api_key="") as client:
            forced = client.generate("Hello", max_tokens=4, logit_bias={65: 100.0})
        assert forced.token_ids == [65] * 4 and out.rstrip("\n") == forced.text
        assert cli_main(["generate", "--server", address, "--logit-bias", "65", "Hello"]) == 1
        assert cli_main(["generate", "--server", address, "--min-p", "2", "Hello"]) == 1
        _, err = capsys.readouterr()
        assert "--logit-bias: expected TOKEN=BIAS" in err and "min_p: must be in [0, 1]" in err

        adapter = tmp_path / "demo-lora"
        assert cli_main(["demo-adapter", str(adapter), "--model", str(model_dir)]) == 0
        assert cli_main(["adapters", "push", "--server", address, "--name", "demo",
                         str(adapter)]) == 0
        out, _ = capsys.readouterr()
        assert "pushed default/demo@1 sha256:" in out
        assert cli_main(["generate", "--server", address, "--adapter", "demo",
                         "--max-tokens", "4", "Hello"]) == 0
        assert cli_main(["generate", "--server", address, "--adapter", "missing",
                         "Hello"]) == 1
        _, err = capsys.readouterr()
        assert "NOT_FOUND: adapter 'missing' not found" in err
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(20)
        finally:
            proc.kill()
    assert rc == 0, proc.stderr.read() if proc.stderr else ""


def test_environment_variables_set_flag_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex.server.cli import build_parser

    monkeypatch.setenv("LORAPLEX_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("LORAPLEX_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("LORAPLEX_WORKERS", "a:1,b:2")
    monkeypatch.setenv("LORAPLEX_PORT", "6000")
    args = build_parser().parse_args(["worker", "--port", "7000"])
    assert (args.max_num_seqs, args.enable_prefix_caching, args.port) == (3, False, 7000)
    args = build_parser().parse_args(["gateway"])
    assert (args.workers, args.port) == ("a:1,b:2", 6000)
    monkeypatch.setenv("LORAPLEX_ALLOW_UNAUTHENTICATED", "maybe")
    monkeypatch.setenv("LORAPLEX_DTYPE", "float64")
    assert cli_main(["serve"]) == 2  # reported before anything starts
    monkeypatch.setenv("LORAPLEX_MAX_QUEUE", "many")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])
