"""benchmarks/serve_bench.py with many adapters (issue 21's N = 64 / 512 over HTTP): the
traces draw from ``--num-adapters``, and exactly the adapters they name are written (ranks 8
and 16 by index) and handed to the systems (vLLM's ``--max-loras`` is their number)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import serve_bench  # noqa: E402


def test_only_the_adapters_the_traces_name_are_written(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "cache"))
    args = serve_bench.parse_args(["--model", "demo", "--num-adapters", "64",
                                   "--adapter-popularity", "zipf:1", "--num-requests", "24",
                                   "--out", str(tmp_path / "out")])
    bench = serve_bench.Bench(args)
    named = {r.adapter for t in (bench.trace, bench.open_trace, bench.warmup)
             for r in t.requests if r.adapter}
    assert set(bench.adapter_dirs) == named
    assert 8 < len(named) < 64  # beyond the old fixed 8, short of every one of the 64
    assert all(int(name.rsplit("-", 1)[1]) < 64 for name in named)
    root = next(iter(bench.adapter_dirs.values())).parent
    assert sorted(p.name for p in root.iterdir()) == sorted(named)  # nothing else written
    for name, path in bench.adapter_dirs.items():
        rank = json.loads((path / "adapter_config.json").read_text())["r"]
        assert rank == (8 if int(name.rsplit("-", 1)[1]) % 2 == 0 else 16), name


def test_the_default_is_the_eight_uniform_adapters_of_issue_22(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "cache"))
    args = serve_bench.parse_args(["--model", "demo", "--out", str(tmp_path / "out")])
    assert (args.num_adapters, args.adapter_popularity) == (8, "uniform")
    bench = serve_bench.Bench(args)
    assert sorted(bench.adapter_dirs) == [f"lt-{i:04d}" for i in range(8)]
