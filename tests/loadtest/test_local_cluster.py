"""``LocalCluster``: ``loraplex worker`` processes behind a ``loraplex gateway`` process, as a
deployment runs them (benchmarks measure this shape beside ``loraplex serve``'s one
process). Started for real on loopback: an upload through the gateway lands in the store the
workers read, requests over gRPC and HTTP are served, and the pids are the processes."""

from __future__ import annotations

import json
import socket
import urllib.request

import psutil
import pytest

from loraplex.loadtest import local_server
from loraplex.loadtest.local_server import LocalCluster
from loraplex.server.client import Client
from loraplex.server.commands import write_demo_adapter


def test_free_ports_lie_below_the_ephemeral_range():
    # A port from bind(0) is an ephemeral one, which an outgoing connection made while the
    # servers start (a worker's) can take before the gateway binds it: the cluster then failed
    # to start. free_port's lie below the range the kernel hands out, and bind.
    low = local_server._ephemeral_low()
    with socket.socket() as out:
        out.bind(("127.0.0.1", 0))
        assert out.getsockname()[1] >= low  # what bind(0) gives: in the range
    ports = {local_server.free_port() for _ in range(8)}
    assert len(ports) > 1 and all(1024 <= p < low for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_gateway_and_two_workers_serve_an_uploaded_adapter(tmp_path):
    demo_adapter_dir = write_demo_adapter(tmp_path / "lora", "demo")
    with LocalCluster("demo", worker_args=["--max-rank", "16"], workers=2,
                      data_dir=tmp_path / "data",
                      env={"LORAPLEX_CACHE_DIR": str(tmp_path / "cache"),
                           "OMP_NUM_THREADS": "1", "LORAPLEX_API_KEY": ""}) as cluster:
        commands = [psutil.Process(pid).cmdline() for pid in cluster.pids]
        assert [c[c.index("loraplex.server.cli") + 1] for c in commands] == [
            "worker", "worker", "gateway"]
        assert commands[2][commands[2].index("--workers") + 1] == ",".join(
            cluster.worker_addresses)
        with Client(cluster.address, api_key="") as client:
            assert client.health() == "SERVING"
            client.upload_adapter(demo_adapter_dir, "tuned")
            base = client.generate("hello there", max_tokens=6, ignore_eos=True)
            tuned = client.generate("hello there", adapter="tuned", max_tokens=6,
                                    ignore_eos=True)
        assert len(base.token_ids) == len(tuned.token_ids) == 6
        body = json.dumps({"model": "tuned", "prompt": "hello there", "max_tokens": 6,
                           "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"{cluster.http_url}/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            completion = json.loads(response.read())
        assert completion["usage"]["completion_tokens"] == 6
        assert completion["choices"][0]["text"] == tuned.text
        output = cluster.output()
        assert "--- worker0" in output and "--- gateway" in output
        assert "Traceback" not in output, output
    assert not cluster._procs  # all stopped


def test_a_worker_that_cannot_start_is_reported_with_its_output(tmp_path):
    with pytest.raises(RuntimeError, match="worker0 exited") as exc:
        with LocalCluster("demo", worker_args=["--max-num-seqs", "0"], data_dir=tmp_path,
                          env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=60):
            pass
    assert "--- worker0" in str(exc.value)


def test_workers_must_be_at_least_one():
    with pytest.raises(ValueError, match="workers must be >= 1"):
        LocalCluster("demo", workers=0)
