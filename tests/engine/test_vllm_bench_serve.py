"""benchmarks/vllm_bench_serve.py (issue 21: vLLM's own ``vllm bench serve`` against both
servers): the client's command line is the same for loraplex and vLLM but for the server's
address and base-model name, the summary's medians and ratios, and the checks made before
anything starts. The runs themselves need the peer venv (``make bench-peers``), which CI does
not build; docs/benchmarks.md quotes them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vllm_bench_serve as vbs  # noqa: E402
import vllm_peer  # noqa: E402


@pytest.fixture
def peer_venv(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".installed").write_text("vllm 0.32.0 torch 2.13.0+cpu\n")
    monkeypatch.setattr(vllm_peer, "PEER_VENV", venv)
    return venv


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_both_servers_get_the_same_client_command_but_address_and_model(peer_venv, tmp_path):
    args = vbs.parse_args(["--num-adapters", "4", "--rates", "1,inf", "--seed", "7",
                           "--input-len", "100", "--output-len", "20"])
    a = vbs.client_argv(args, "http://127.0.0.1:1", "loraplex-base", "/tok", 1.0, tmp_path,
                        "a.json")
    b = vbs.client_argv(args, "http://127.0.0.1:2", "/models/x", "/tok", 1.0, tmp_path,
                        "a.json")
    assert a[0] == str(peer_venv / "bin" / "python")
    diff = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
    assert diff == [("http://127.0.0.1:1", "http://127.0.0.1:2"), ("loraplex-base", "/models/x")]
    # the trace: vLLM's random dataset at our lengths and seed, EOS ignored, greedy, every
    # request one of the N adapters
    assert a[a.index("bench"):a.index("bench") + 2] == ["bench", "serve"]
    assert _flag(a, "--dataset-name") == "random"
    assert (_flag(a, "--random-input-len"), _flag(a, "--random-output-len")) == ("100", "20")
    assert (_flag(a, "--seed"), _flag(a, "--temperature"), _flag(a, "--request-rate")) == (
        "7", "0", "1")
    assert "--ignore-eos" in a
    assert _flag(a, "--random-prefix-len") == "0"  # no shared prefix unless asked
    shared = vbs.client_argv(vbs.parse_args(["--prefix-len", "256"]), "u", "m", "/tok", 1.0,
                             tmp_path, "p.json")
    assert _flag(shared, "--random-prefix-len") == "256"
    # with prefix caching on, each run its own prompts (no run replays the last one's cached
    # prompts), the same runs for both servers; off, every run the same trace
    cached = vbs.parse_args(["--prefix-len", "256", "--prefix-caching", "--seed", "7"])
    seeds = [_flag(vbs.client_argv(cached, u, "m", "/tok", 1.0, tmp_path, "p.json", run=r),
                   "--seed") for r in (1, 2) for u in ("a", "b")]
    assert seeds == ["8", "8", "9", "9"]
    assert _flag(vbs.client_argv(args, "u", "m", "/tok", 1.0, tmp_path, "p.json", run=2),
                 "--seed") == "7"
    i = a.index("--lora-modules")
    assert a[i + 1:i + 5] == ["lt-0000", "lt-0001", "lt-0002", "lt-0003"]
    inf = vbs.client_argv(args, "u", "m", "/tok", float("inf"), tmp_path, "b.json",
                          num_prompts=8)
    assert (_flag(inf, "--request-rate"), _flag(inf, "--num-prompts")) == ("inf", "8")


def test_the_base_model_alone_names_no_adapter(peer_venv, tmp_path):
    args = vbs.parse_args(["--num-adapters", "0"])
    assert "--lora-modules" not in vbs.client_argv(args, "u", "m", "/tok", 2.0, tmp_path, "r")
    # the -base systems: the same trace with every request the base model's
    args = vbs.parse_args(["--num-adapters", "64", "--phases", "loraplex,vllm-base"])
    lora = vbs.client_argv(args, "u", "m", "/tok", 2.0, tmp_path, "r")
    base = vbs.client_argv(args, "u", "m", "/tok", 2.0, tmp_path, "r", base=True)
    assert base == lora[:lora.index("--lora-modules")]


def _run(system: str, rate: str, tok_s: float, cpu_s: float, tokens: int, ttft: float,
         itl99: float) -> dict:
    result = {k: 1.0 for k in vbs.METRICS}
    result.update(output_throughput=tok_s, p50_ttft_ms=ttft, p99_itl_ms=itl99,
                  total_output_tokens=tokens, failed=0, prompts_realigned=False)
    return {"system": system, "rate": rate, "cpu_s": cpu_s, "result": result}


def test_summary_takes_medians_and_ratios_put_loraplex_over_vllm():
    runs = [_run("loraplex", "1", 100.0, 10.0, 1000, 50.0, 80.0),
            _run("loraplex", "1", 120.0, 12.0, 1000, 70.0, 100.0),
            _run("loraplex", "1", 140.0, 14.0, 1000, 60.0, 90.0),
            _run("vllm", "1", 60.0, 30.0, 1000, 240.0, 300.0)]
    summary = vbs.summarize(runs)
    mine = summary["1"]["loraplex"]
    assert (mine["runs"], mine["output_throughput"], mine["p50_ttft_ms"]) == (3, 120.0, 60.0)
    assert mine["cpu_s_per_token"] == pytest.approx(0.012)
    q = vbs.ratios(summary)["1 loraplex/vllm"]
    assert q["tok_s"] == pytest.approx(2.0)
    assert q["tok_per_cpu_s"] == pytest.approx(0.030 / 0.012)
    assert q["ttft_p50"] == pytest.approx(0.25)
    assert q["itl_p99"] == pytest.approx(0.3)
    text = vbs.table(summary)
    assert "rate 1: loraplex / vllm: tok/s 2.00x, per CPU s 2.50x" in text
    assert "WARNING" not in text


def test_a_realigned_trace_is_flagged():
    runs = [_run("loraplex", "inf", 1.0, 1.0, 10, 1.0, 1.0), _run("vllm", "inf", 1.0, 1.0, 10,
                                                                   1.0, 1.0)]
    runs[1]["result"]["prompts_realigned"] = True
    assert "re-aligned the prompts of vllm at inf" in vbs.table(vbs.summarize(runs))


def test_each_pair_that_ran_gets_its_ratio():
    summary = vbs.summarize([_run("loraplex", "2", 1.0, 1.0, 10, 1.0, 1.0)])
    assert vbs.ratios(summary) == {}
    summary = vbs.summarize([_run("loraplex", "2", 90.0, 1.0, 10, 1.0, 1.0),
                             _run("loraplex-base", "2", 100.0, 1.0, 10, 1.0, 1.0),
                             _run("vllm-base", "2", 80.0, 1.0, 10, 1.0, 1.0)])
    q = vbs.ratios(summary)
    assert sorted(q) == ["2 loraplex-base/vllm-base", "2 loraplex/vllm-base"]
    assert q["2 loraplex/vllm-base"]["tok_s"] == pytest.approx(90 / 80)
    assert q["2 loraplex-base/vllm-base"]["tok_s"] == pytest.approx(100 / 80)


@pytest.mark.parametrize("argv, message", [
    (["--phases", "loraplex,sglang"], "--phases: 'sglang' is not one of loraplex, vllm"),
    (["--rates", "1,fast"], "--rates: numbers or inf"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--threads", "0"], "--threads"),
    (["--split-workers", "0"], "--split-workers"),
    (["--prefix-len", "-1"], "--prefix-len must be >= 0"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        vbs.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_without_the_peer_venv_it_names_make_bench_peers(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_peer, "PEER_VENV", tmp_path / "no-venv")
    with pytest.raises(SystemExit, match="make bench-peers"):
        vbs.main(["--model", "demo", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()  # nothing built, nothing written


def test_the_split_deployment_is_compared_with_vllm_base_and_with_serve():
    runs = [_run("loraplex", "1", 100.0, 10.0, 1000, 60.0, 90.0),
            _run("loraplex-split", "1", 110.0, 12.0, 1000, 50.0, 80.0),
            _run("vllm-base", "1", 100.0, 20.0, 1000, 55.0, 85.0)]
    q = vbs.ratios(vbs.summarize(runs))
    assert sorted(q) == ["1 loraplex-split/loraplex", "1 loraplex-split/vllm-base",
                         "1 loraplex/vllm-base"]
    assert q["1 loraplex-split/loraplex"]["tok_s"] == pytest.approx(1.1)
    assert q["1 loraplex-split/loraplex"]["tok_per_cpu_s"] == pytest.approx(10 / 12)
    assert q["1 loraplex-split/vllm-base"]["ttft_p50"] == pytest.approx(50 / 55)
    assert vbs.parse_args(["--phases", "loraplex-split,loraplex-split-base"]).phases


def test_cpu_seconds_of_several_process_trees_add_up():
    import os

    import psutil

    me = psutil.Process(os.getpid())
    cpu = vbs.processes_cpu_s([os.getpid(), os.getppid()])
    assert f"{me.name()}:{me.pid}" in cpu
    assert f"{me.parent().name()}:{me.ppid()}" in cpu
    assert cpu[f"{me.name()}:{me.pid}"] > 0
