"""The parallel-sampling benchmark (benchmarks/parallel_sampling_bench.py) on the demo model:
interleaved rounds reduce to medians, CPU time beside wall time, shared pages held once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import parallel_sampling_bench as bench  # noqa: E402


def test_trace_rounds_report_medians_cpu_time_and_shared_pages(tmp_path):
    bench.main(["--model", "demo", "--num-prompts", "2", "--prompt-len", "40", "56",
                "--n", "3", "--max-tokens", "3", "5", "--num-adapters", "2",
                "--num-pages", "128", "--threads", "1", "--trace-only", "--repeats", "3",
                "--allow-dirty", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "parallel_sampling_bench.json").read_text())
    assert "sampler" not in report and report["commit"] == report["machine"]["commit"]
    assert [(r["n"], r["prefix_cache"]) for r in report["runs"]] == [(3, False), (3, True)]
    for row in report["runs"]:
        assert row["repeats"] == 3 and len(row["rounds"]) == 3
        assert row["same_tokens"] == ["6/6"] * 3
        for system in ("shared", "separate"):
            per_round = sorted(r[system]["tokens_per_cpu_s"] for r in row["rounds"])
            assert row[system]["tokens_per_cpu_s"] == per_round[1]  # the median of three
            assert row[system]["cpu_s"] > 0 and row[system]["output_tokens"] > 0
        # the prompt's full pages are held once, not once per sequence
        assert row["shared"]["peak_kv_pages"] < row["separate"]["peak_kv_pages"]
        assert row["peak_kv_ratio"] == (row["shared"]["peak_kv_pages"]
                                        / row["separate"]["peak_kv_pages"])
        for system in ("shared", "separate"):  # pinned pages: KV + the cache's pinned pages
            r = row[system]
            assert r["peak_kv_pages"] <= r["peak_pinned_pages"] <= r["peak_kv_and_prefix_pages"]
            if not row["prefix_cache"]:
                assert r["peak_pinned_pages"] == r["peak_kv_pages"]


def test_sampler_only_and_trace_only_exclude_each_other():
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--sampler-only", "--trace-only"])
    assert exit_.value.code == 2
