"""A short load run against a real ``loraplex serve --model demo`` over loopback gRPC: two
tenants with their own API keys and adapters (uploaded by the load tester), open loop with
warm-up. It must finish with zero errors and a consistent Little's law."""

from __future__ import annotations

import hashlib
import json

import pytest

from loraplex.loadtest.cli import main as loadtest_main
from loraplex.loadtest.local_server import LocalServer
from loraplex.loadtest.records import RunLog
from loraplex.server.client import Client

KEYS = {"acme": "key-acme-0123456789abcdef", "globex": "key-globex-0123456789abcdef"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lt-serve")
    hashes = ";".join(f"{hashlib.sha256(k.encode()).hexdigest()} {t}" for t, k in KEYS.items())
    with LocalServer("demo", ["--api-key-hashes", hashes], data_dir=root / "data",
                     env={"LORAPLEX_CACHE_DIR": str(root / "cache"), "OMP_NUM_THREADS": "1",
                          "LORAPLEX_API_KEY": ""}) as srv:
        yield srv
        assert "Traceback" not in srv.output(), srv.output()


def test_load_run_against_loraplex_serve(server, tmp_path):
    address = server.address
    out = tmp_path / "run"
    code = loadtest_main([
        "run", "--system", "loraplex", "--address", address, "--model", "demo",
        "--adapters-dir", str(tmp_path / "adapters"), "--adapter-rank", "4",
        "--num-requests", "90", "--rate", "8", "--num-adapters", "3", "--base-fraction", "0.2",
        "--prompt-len", "uniform:8:48", "--output-len", "uniform:4:12",
        "--tenants", "acme=2,globex=1", "--tenant-keys",
        ",".join(f"{t}={k}" for t, k in KEYS.items()), "--warmup", "10",
        "--max-duration", "40", "--drain-timeout", "20", "--request-timeout", "30",
        "--slo-ttft-ms", "2000", "--little-tolerance", "0.15", "--seed", "4", "--no-progress",
        "--out", str(out)])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    s = report["summary"]
    assert s["num_errors"] == 0, s["errors"]
    assert s["num_ok"] == 80 and report["warmup"]["num_requests"] == 10
    law = report["littles_law"]
    assert law["consistent"], law
    assert set(report["by_tenant"]) == {"acme", "globex"}
    log = RunLog.load(out / "log.jsonl")
    want = {r["id"]: r["output_len"] for r in _trace_lines(log)}
    for r in log.records:
        assert r.ok and r.num_output_tokens == want[r.request_id] and r.num_prompt_tokens > 0
        assert r.token_times == sorted(r.token_times) and r.send_time < r.token_times[0]
    # each tenant's adapters were uploaded into its own namespace
    for tenant, key in KEYS.items():
        used = {r.adapter for r in log.records if r.tenant == tenant and r.adapter}
        with Client(address, api_key=key) as client:
            assert used <= {v.name for v in client.list_adapters()}
    assert (out / "latency_cdf.png").stat().st_size > 0


def test_the_same_trace_over_grpc_http_and_a_plain_openai_server(server, tmp_path, capsys):
    out = tmp_path / "wires"
    code = loadtest_main([
        "run", "--systems", "loraplex,loraplex-http,openai", "--address", server.address,
        "--http-url", server.http_url, "--openai-url", server.http_url, "--model", "demo",
        "--adapters-dir", str(tmp_path / "adapters"), "--adapter-rank", "4",
        "--num-requests", "24", "--rate", "6", "--num-adapters", "2", "--base-fraction", "0.25",
        "--prompt-len", "uniform:8:32", "--output-len", "uniform:6:12",
        "--tenants", "acme=1", "--tenant-keys", f"acme={KEYS['acme']}",
        "--max-duration", "30", "--drain-timeout", "20", "--request-timeout", "30",
        "--seed", "7", "--no-progress", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    logs = {name: RunLog.load(out / name / "log.jsonl")
            for name in ("loraplex", "loraplex-http", "openai")}
    want = {r["id"]: r["output_len"] for r in _trace_lines(logs["loraplex"])}
    for name, log in logs.items():
        assert len(log.records) == 24, name
        assert log.meta["system"] == name
        for r in log.records:
            assert r.ok, (name, r.status, r.error)
            assert r.num_output_tokens == want[r.request_id], name
            assert r.num_prompt_tokens > 0
            # stamped as the events came: one time per token, not one for the whole stream
            assert r.token_times == sorted(r.token_times) and r.send_time < r.token_times[0]
            assert len(set(r.token_times)) > 1, (name, r.token_times)
    # "openai" was told nothing of loraplex: the base model's name came from /v1/models
    assert logs["openai"].meta["base_model"] == "demo"
    assert logs["loraplex-http"].meta["target"] == server.http_url
    for name in logs:  # reported side by side
        assert name in printed.split("wrote")[-2]


def test_pid_is_the_serve_process(server):
    """``LocalServer.pid`` names the ``loraplex serve`` process itself (benchmarks read its CPU
    time from it)."""
    import psutil

    proc = psutil.Process(server.pid)
    cmdline = proc.cmdline()
    assert "serve" in cmdline and cmdline[cmdline.index("--port") + 1] == str(server.port)
    assert proc.cpu_times().user > 0  # it loaded the model: CPU time to account for


def _trace_lines(log: RunLog) -> list[dict]:
    from loraplex.loadtest.trace import TraceConfig, generate_trace

    trace = generate_trace(TraceConfig.from_dict(log.meta["trace_config"]))
    return [{"id": r.request_id, "output_len": r.output_len} for r in trace.requests]
