"""The benchmarks' vLLM peer systems (benchmarks/vllm_peer.py) as engine_bench.py and
lora_bench.py ask for them: a missing peer venv is a clear error before anything is built."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import engine_bench  # noqa: E402
import lora_bench  # noqa: E402
import vllm_peer  # noqa: E402


@pytest.mark.parametrize("bench, system", [(engine_bench, "vllm-base"), (lora_bench, "vllm")])
def test_a_vllm_system_without_the_peer_venv_names_make_bench_peers(bench, system, tmp_path,
                                                                    monkeypatch, capsys):
    monkeypatch.setattr(vllm_peer, "PEER_VENV", tmp_path / "no-venv")
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--systems", "loraplex", system])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "make bench-peers" in err and f"--systems {system}" in err
    assert str(tmp_path / "no-venv") in err

    # without a vLLM system the venv is not needed; with it installed the system is accepted
    assert bench.parse_args(["--systems", "loraplex"]).systems == ["loraplex"]
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").write_text("vllm 0.32.0 torch 2.13.0+cpu\n")
    monkeypatch.setattr(vllm_peer, "PEER_VENV", venv)
    assert bench.parse_args(["--systems", "loraplex", system]).systems == ["loraplex", system]


def test_engine_bench_keeps_its_default_systems(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_peer, "PEER_VENV", tmp_path / "no-venv")
    assert engine_bench.parse_args([]).systems == ["loraplex", "transformers"]
