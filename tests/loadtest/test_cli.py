"""The command line: trace files, reports of saved logs, usage errors, and the ``bench``
group for the ``loraplex`` command."""

from __future__ import annotations

import argparse
import json

import pytest

from loraplex.loadtest.cli import build_parser, main, register
from loraplex.loadtest.records import RequestRecord, RunLog
from loraplex.loadtest.trace import Trace


def test_trace_command_writes_the_trace_it_describes(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["trace", "--num-requests", "25", "--rate", "5", "--adapters", "skewed:0.8",
                 "--num-adapters", "4", "--tenants", "a=1,b=3", "--seed", "9",
                 "-o", str(out)]) == 0
    trace = Trace.load(out)
    assert len(trace) == 25 and trace.config.adapters == "skewed:0.8"
    assert trace.config.tenants == (("a", 1.0), ("b", 3.0))
    assert "25 requests" in capsys.readouterr().out
    again = tmp_path / "u.jsonl"
    main(["trace", "--num-requests", "25", "--rate", "5", "--adapters", "skewed:0.8",
          "--num-adapters", "4", "--tenants", "a=1,b=3", "--seed", "9", "-o", str(again)])
    assert out.read_bytes() == again.read_bytes()


def test_scenario_trace(tmp_path):
    out = tmp_path / "nn.jsonl"
    assert main(["trace", "--scenario", "noisy-neighbour", "--num-requests", "44",
                 "-o", str(out)]) == 0
    assert Trace.load(out).tenants() == ["noisy", "quiet"]


def test_report_command_compares_logs(tmp_path, capsys):
    paths = []
    for i, ttft in enumerate((0.1, 0.3)):
        log = RunLog([RequestRecord(f"r{k}", "t", "", k * 0.5, k * 0.5, k * 0.5 + 1.0,
                                    [k * 0.5 + ttft, k * 0.5 + 1.0]) for k in range(10)],
                     {"system": f"sys{i}"})
        paths.append(tmp_path / f"log{i}.jsonl")
        log.save(paths[-1])
    out = tmp_path / "cmp"
    assert main(["report", *map(str, paths), "--labels", "a", "b", "--slo-ttft-ms", "200",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "== a" in text and "== b" in text
    reports = [json.loads((out / f"report-{i}.json").read_text()) for i in range(2)]
    assert [r["summary"]["goodput"]["fraction"] for r in reports] == [1.0, 0.0]
    assert (out / "latency_cdf.png").exists()


def test_usage_errors_exit_2(tmp_path, capsys):
    assert main(["trace", "--adapters", "pareto", "-o", str(tmp_path / "x")]) == 2
    assert "adapters" in capsys.readouterr().err
    assert main(["trace", "--tenants", "a", "-o", str(tmp_path / "x")]) == 2


def test_register_adds_bench_to_a_parser(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="loraplex")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "trace", "--num-requests", "3", "-o",
                              str(tmp_path / "t.jsonl")])
    assert args.func(args) == 0 and len(Trace.load(tmp_path / "t.jsonl")) == 3
    args = parser.parse_args(["bench", "--help"])
    with pytest.raises(SystemExit) as exit_:
        args.func(args)
    assert exit_.value.code == 0 and "loraplex bench" in capsys.readouterr().out
    parsed = build_parser().parse_args(["run", "--systems", "loraplex-engine,transformers-mixed",
                                        "--scenario", "shared-prefix",
                                        "--no-enable-prefix-caching"])
    assert parsed.systems == "loraplex-engine,transformers-mixed"
    assert parsed.enable_prefix_caching is False
