"""benchmarks/adapter_switch_bench.py on a one-layer random model: a run after a switch of
adapter sets copies the evicted adapters in (counted by the engine's stats), the run after it
copies nothing, and the report says so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import adapter_switch_bench  # noqa: E402


def test_switch_runs_copy_adapters_in_and_steady_runs_do_not(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "cache"))
    report = adapter_switch_bench.main([
        "--model", "random", "--num-layers", "1", "--ns", "64", "512", "--num-requests", "32",
        "--max-tokens", "2", "--rounds", "1", "--out", str(tmp_path / "out")])
    runs = report["runs"]
    assert [(r["n"], r["run"]) for r in runs] == [
        (64, "switch"), (64, "steady"), (512, "switch"), (512, "steady")]
    assert all(r["copies_in"] == 0 and r["copy_in_s"] == 0 for r in runs if r["run"] == "steady")
    after_64 = runs[2]  # the 512 set after the 64 set: the pool holds one set beside the KV
    assert after_64["copies_in"] > 0 and after_64["copy_in_s"] > 0
    assert all(r["tok_s"] > 0 for r in runs)
    written = json.loads((tmp_path / "out" / "adapter_switch.json").read_text())
    assert written["summary"]["copies_per_switch"] > 0
    assert written["runs"] == runs


def test_one_adapter_set_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        adapter_switch_bench.parse_args(["--ns", "64", "64"])
    assert exit_.value.code == 2
    assert "at least two different adapter sets" in capsys.readouterr().err
