"""The chart's topology on this machine: Redis, two workers and a gateway, each started with the
exact command line and environment the rendered chart gives its container (ConfigMaps and
Secrets resolved, ``$(VAR)`` expanded), with only hosts, ports and mount paths substituted,
then serving requests end to end through the gateway.

The values are the chart's "auth" set plus what a CPU-only cluster would set (demo model,
``device: cpu``, a small pool), so what runs here is what a pod would run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.deploy.chart import VALUE_SETS, Manifest, container, find, merge, render
from tests.deploy.pods import ContainerRun, lay_out_volumes, relocate, resolve

pytest.importorskip("loraplex.server.commands",
                    reason="loraplex.server.commands (the gRPC service's commands) is missing")

import redis  # noqa: E402

from loraplex.loadtest.local_server import free_port  # noqa: E402
from loraplex.server.api import ServiceError  # noqa: E402
from loraplex.server.auth import hash_key  # noqa: E402
from loraplex.server.client import Client  # noqa: E402
from loraplex.server.commands import write_demo_adapter  # noqa: E402

pytestmark = [pytest.mark.redis, pytest.mark.slow]

API_KEY = "lpx-" + "7f3a" * 12
TENANT = "acme"
KEYS_SECRET = "loraplex-api-keys"
VALUES = merge(VALUE_SETS["auth"], {
    "model": {"source": "demo"},
    "worker": {
        "engine": {"device": "cpu", "dtype": "float32", "kernels": "torch",
                   "poolMemoryBytes": 48 << 20, "hostCacheBytes": 64 << 20, "maxNumSeqs": 8,
                   "maxNumBatchedTokens": 256},
        "config": {"drainGrace": 10},
        "terminationGracePeriodSeconds": 30,
    },
})
START_SECONDS = 240  # two workers building the demo model on two shared cores
SECRETS = {KEYS_SECRET: {"api-keys": f"# the tenants' keys\n{hash_key(API_KEY)}  {TENANT}\n"}}


def _free_port() -> int:
    return free_port()  # below the ephemeral range: nothing outgoing takes it meanwhile


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    run: ContainerRun

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.alive():
            os.kill(self.popen.pid, sig)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)
        return int(self.popen.returncode)


@dataclass
class Topology:
    manifests: list[Manifest]
    redis: Proc
    redis_port: int
    workers: list[Proc]
    worker_ports: list[tuple[int, int]]  # (grpc, metrics)
    gateway: Proc
    gateway_ports: tuple[int, int]  # (grpc, metrics)
    cache_dirs: list[Path]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway_ports[0]}"


def _launch(name: str, run: ContainerRun, root: Path) -> Proc:
    """Start ``run`` as a process: ``loraplex`` is this venv's entry point, and the environment
    is the container's alone (plus PATH and single-threaded math for this shared machine)."""
    argv = list(run.argv)
    if argv[0] == "loraplex":
        script = Path(sys.executable).with_name("loraplex")
        argv[:1] = [str(script)] if script.exists() else [sys.executable, "-m",
                                                          "loraplex.server.cli"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **run.env}
    log = root / f"{name}.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 cwd=root, start_new_session=True)
    return Proc(name, popen, log, run)


def _local(manifests: list[Manifest], workload: Manifest, name: str, root: Path,
           subs: dict[str, str]) -> tuple[ContainerRun, dict[str, Path]]:
    """The container resolved, its volumes laid out under ``root`` and every mount path and
    ``subs`` (cluster address -> local address) substituted."""
    run = resolve(manifests, workload, name, SECRETS)
    dirs = lay_out_volumes(run, root, manifests, SECRETS)

    def local(text: str) -> str:
        for cluster, here in subs.items():
            text = text.replace(cluster, here)
        return relocate(text, dirs)

    run.argv = [local(a) for a in run.argv]
    run.env = {k: local(v) for k, v in run.env.items()}
    return run, dirs


def _wait(what: str, proc: Proc, ready: Any, timeout: float = START_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            pytest.fail(f"{what} exited ({proc.popen.returncode}):\n{_tail(proc.log)}")
        try:
            if ready():
                return
        except (OSError, grpc.RpcError, ServiceError, redis.RedisError):
            pass
        time.sleep(0.25)
    pytest.fail(f"{what} not ready after {timeout:.0f} s:\n{_tail(proc.log)}")


def _health(address: str, service: str = "") -> str:
    with Client(address, api_key="") as client:
        return client.health(service, timeout=2.0)


def _start_redis(manifests: list[Manifest], root: Path) -> tuple[Proc, int]:
    sts = find(manifests, "StatefulSet", "-redis")
    port = _free_port()
    run, dirs = _local(manifests, sts, "redis", root / "redis", {})
    conf = next(p for p in dirs.values() if (p / "redis.conf").exists()) / "redis.conf"
    text = conf.read_text()
    for line in ("bind * -::*", f"port {container(sts, 'redis')['ports'][0]['containerPort']}"):
        assert re.search(rf"^{re.escape(line)}$", text, re.M), line
    text = text.replace("bind * -::*", "bind 127.0.0.1").replace("port 6379", f"port {port}")
    conf.write_text(relocate(text, dirs))
    proc = _launch("redis", run, root)
    client = redis.Redis(port=port, password=run.env["REDIS_PASSWORD"])
    _wait("redis", proc, client.ping, timeout=30)
    client.close()
    return proc, port


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    assert shutil.which("redis-server"), "redis-server is needed (apt-get install redis-server)"
    root = tmp_path_factory.mktemp("topology")
    manifests = render(VALUES)
    procs: list[Proc] = []
    try:
        redis_proc, redis_port = _start_redis(manifests, root)
        procs.append(redis_proc)
        redis_host = f"{find(manifests, 'Service', '-redis')['metadata']['name']}.serving.svc."
        subs = {f"{redis_host}cluster.local:6379": f"127.0.0.1:{redis_port}"}

        sts = find(manifests, "StatefulSet", "-worker")
        workers, ports, caches = [], [], []
        for i in range(sts["spec"]["replicas"]):
            grpc_port, metrics_port = _free_port(), _free_port()
            run, dirs = _local(manifests, sts, "worker", root / f"worker-{i}", subs)
            assert (run.env["LORAPLEX_HOST"], run.env["LORAPLEX_PORT"]) == ("0.0.0.0", "50061")
            run.env.update(LORAPLEX_HOST="127.0.0.1", LORAPLEX_PORT=str(grpc_port),
                           LORAPLEX_METRICS_PORT=str(metrics_port))
            workers.append(_launch(f"worker-{i}", run, root))
            ports.append((grpc_port, metrics_port))
            caches.append(dirs["/var/cache/loraplex"])
        procs.extend(workers)
        for proc, (grpc_port, _) in zip(workers, ports):
            _wait(proc.name, proc, lambda p=grpc_port: _health(f"127.0.0.1:{p}") == "SERVING")

        deploy = find(manifests, "Deployment", "-gateway")
        gateway_port, gateway_metrics = _free_port(), _free_port()
        worker_target = f"{sts['spec']['serviceName']}.serving.svc.cluster.local:50061"
        subs[worker_target] = ",".join(f"127.0.0.1:{p}" for p, _ in ports)
        run, _ = _local(manifests, deploy, "gateway", root / "gateway", subs)
        assert run.env["LORAPLEX_WORKERS"] == subs[worker_target]
        run.env.update(LORAPLEX_HOST="127.0.0.1", LORAPLEX_PORT=str(gateway_port),
                       LORAPLEX_METRICS_PORT=str(gateway_metrics))
        gateway = _launch("gateway", run, root)
        procs.append(gateway)
        _wait("gateway", gateway, lambda: _health(f"127.0.0.1:{gateway_port}") == "SERVING")
        yield Topology(manifests, redis_proc, redis_port, workers, ports, gateway,
                       (gateway_port, gateway_metrics), caches)
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_redis_runs_the_charts_config(topology: Topology) -> None:
    password = topology.redis.run.env["REDIS_PASSWORD"]
    client = redis.Redis(port=topology.redis_port, password=password, decode_responses=True)
    try:
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    finally:
        client.close()
    anonymous = redis.Redis(port=topology.redis_port)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    # The password reached redis through a file, never its command line.
    assert password not in " ".join(topology.redis.run.argv)


def _metrics(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        return bytes(resp.read())


def test_pods_answer_their_probes(topology: Topology) -> None:
    """What the kubelet would see: gRPC health SERVING for the server (startup, readiness) and
    for loraplex.liveness (liveness), and /metrics, on the ports the chart's probes name."""
    for (grpc_port, metrics_port), cache in zip(topology.worker_ports, topology.cache_dirs):
        assert _health(f"127.0.0.1:{grpc_port}") == "SERVING"
        assert _health(f"127.0.0.1:{grpc_port}", "loraplex.liveness") == "SERVING"
        assert b"loraplex_worker_queue_depth" in _metrics(metrics_port)
        # The demo model was built in the cache emptyDir, not on the (read-only) root.
        assert any(cache.glob("demo-llama-*/model.safetensors")), list(cache.iterdir())
    grpc_port, metrics_port = topology.gateway_ports
    assert _health(f"127.0.0.1:{grpc_port}") == "SERVING"
    assert b"loraplex_gateway_worker_up" in _metrics(metrics_port)


def test_requests_end_to_end_through_the_gateway(topology: Topology,
                                                 tmp_path: Path) -> None:
    with Client(topology.address, api_key="not-a-key", timeout=30) as stranger:
        with pytest.raises(ServiceError) as refused:
            stranger.generate("hello", max_tokens=2)
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED

    with Client(topology.address, api_key=API_KEY, timeout=120) as client:
        unary = client.generate("The quick brown fox", max_tokens=8, ignore_eos=True)
        assert len(unary.token_ids) == 8 and unary.finish_reason == "length"
        streamed = [t for chunk in client.generate_stream("The quick brown fox", max_tokens=8,
                                                          ignore_eos=True)
                    for t in chunk.token_ids]
        assert streamed == unary.token_ids

        adapter = write_demo_adapter(tmp_path / "demo-lora", "demo", rank=8)
        record = client.upload_adapter(adapter, "support-bot")
        assert (record.tenant, record.name, record.version) == (TENANT, "support-bot", 1)
        tuned = client.generate("The quick brown fox", "support-bot", max_tokens=8,
                                ignore_eos=True)
        assert len(tuned.token_ids) == 8 and tuned.token_ids != unary.token_ids
        assert [a.name for a in client.list_adapters()] == ["support-bot"]

    store = redis.Redis(port=topology.redis_port,
                        password=topology.redis.run.env["REDIS_PASSWORD"])
    assert store.dbsize() > 0  # the adapter lives in the chart's Redis
    store.close()


def test_no_secret_reaches_the_logs(topology: Topology) -> None:
    password = topology.redis.run.env["REDIS_PASSWORD"]
    for proc in (topology.gateway, *topology.workers, topology.redis):
        text = proc.log.read_text(errors="replace")
        assert password not in text, proc.name
        assert API_KEY not in text, proc.name


def test_a_draining_worker_leaves_and_the_gateway_routes_around_it(topology: Topology) -> None:
    sts = find(topology.manifests, "StatefulSet", "-worker")
    spec = sts["spec"]["template"]["spec"]
    pre_stop = int(container(sts, "worker")["lifecycle"]["preStop"]["exec"]["command"][1])
    budget = spec["terminationGracePeriodSeconds"] - pre_stop
    leaving = topology.workers[0]
    start = time.monotonic()
    os.kill(leaving.popen.pid, signal.SIGTERM)  # what the kubelet sends after preStop
    try:
        leaving.popen.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not drain within {budget} s:\n{_tail(leaving.log)}")
    assert time.monotonic() - start < budget
    with Client(topology.address, api_key=API_KEY, timeout=120) as client:
        for prompt in ("Once upon a time", "def fibonacci(n):", "Multi-tenant"):
            for adapter in ("", "support-bot"):
                out = client.generate(prompt, adapter, max_tokens=4, ignore_eos=True)
                assert len(out.token_ids) == 4
