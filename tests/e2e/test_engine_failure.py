"""Fault isolation over real gRPC (issue 13, findings 1 and 2).

1. An adapter that overflows in float32 activations fails its own request alone: a
   concurrent stream finishes and the worker goes on serving.
2. If the engine thread does die, the worker says so at once (health and liveness
   NOT_SERVING), every in-flight and queued request ends UNAVAILABLE with the reason, and the
   ``loraplex worker`` process exits non-zero so that Kubernetes restarts it.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from loraplex.server.api import WorkerRequest
from loraplex.server.client import Client, ServiceError
from loraplex.server.engine.request import SamplingParams
from loraplex.server.launch import EXIT_ENGINE_FAILED
from loraplex.server.wire.messages import worker_request_to_pb
from loraplex.server.wire.stubs import ClientStub
from loraplex.v1 import worker_pb2_grpc
from tests.e2e.harness import Cluster, read_line, wait_for
from tests.engine.test_fault_isolation import write_huge_adapter


def test_overflowing_adapter_fails_alone_over_grpc(model_dir: Path, tmp_path: Path) -> None:
    huge = write_huge_adapter(tmp_path / "huge", model_dir)
    cluster = Cluster(model_dir, tmp_path / "store")
    try:
        with cluster.client() as client:
            client.upload_adapter(huge, "huge")
            stream = client.generate_stream("a concurrent stream", max_tokens=300,
                                            ignore_eos=True)
            first = next(stream)
            assert first.token_ids
            with pytest.raises(ServiceError) as info:
                client.generate("overflow", "huge", max_tokens=8, temperature=1.0)
            # The request's own failure: not UNAVAILABLE, which would blame (and retry) workers.
            assert info.value.code != grpc.StatusCode.UNAVAILABLE
            assert "sampling failed: non-finite probabilities" in info.value.message
            rest = list(stream)
            assert rest[-1].finish_reason == "length"
            assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 300
            for i in range(3):  # the engine keeps serving, base model and adapter alike
                assert client.generate(f"later {i}", max_tokens=4).usage.completion_tokens == 4
            with pytest.raises(ServiceError, match="sampling failed"):
                client.generate("again", "huge", max_tokens=2, temperature=1.0)
            assert client.health() == "SERVING"
        cluster.wait_idle()
    finally:
        cluster.close()


def _raise(*args: object) -> None:
    raise RuntimeError("injected engine fault")


def test_engine_thread_death_turns_health_and_requests_unavailable(model_dir: Path,
                                                                   tmp_path: Path) -> None:
    cluster = Cluster(model_dir, tmp_path / "store", engine={"max_num_seqs": 1})
    worker = cluster.workers[0]
    try:
        with cluster.client() as client, grpc.insecure_channel(worker.address) as channel:
            health = ClientStub(channel)
            running = client.generate_stream("in flight", max_tokens=1500, ignore_eos=True)
            assert next(running).token_ids
            queued_error: list[ServiceError] = []

            def queued() -> None:  # max_num_seqs=1: this one waits in the engine's queue
                try:
                    client.generate("queued", max_tokens=4)
                except ServiceError as exc:
                    queued_error.append(exc)

            waiter = threading.Thread(target=queued)
            waiter.start()
            wait_for(lambda: worker.engine.scheduler.num_waiting == 1, timeout=10,
                     what="a queued request")
            worker.engine.step = _raise  # type: ignore[method-assign]  # fault injection

            with pytest.raises(ServiceError) as info:
                list(running)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert "engine failure: RuntimeError('injected engine fault')" in info.value.message
            waiter.join(30)
            assert queued_error and queued_error[0].code == grpc.StatusCode.UNAVAILABLE
            wait_for(lambda: health.health() == "NOT_SERVING", what="worker health")
            assert health.health("loraplex.liveness") == "NOT_SERVING"
            assert health.health("loraplex.v1.Worker") == "NOT_SERVING"
            with pytest.raises(ServiceError) as info:
                client.generate("after", max_tokens=2)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        cluster.close()


# The real `loraplex worker` command, with Engine.step replaced (fault injection) before it runs.
FAULTY_WORKER = """
import sys
from loraplex.server.cli import main
from loraplex.server.engine.engine import Engine

def step(self):
    raise RuntimeError("injected engine fault")

Engine.step = step
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_process_exits_non_zero_when_its_engine_dies(model_dir: Path, tmp_path: Path,
                                                     command: str) -> None:
    cmd = [sys.executable, "-c", FAULTY_WORKER, command, "--model", str(model_dir),
           "--store", f"fs:{tmp_path / 'store'}", "--port", "0", "--metrics-port", "-1",
           "--num-pages", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if command == "worker":
            address = read_line(proc, "loraplex worker listening on ", 60).rsplit(" ", 1)[-1]
            with grpc.insecure_channel(address) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                request = WorkerRequest("r1", "default", "hello", SamplingParams(max_tokens=4))
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.Generate(worker_request_to_pb(request), timeout=30))
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "injected engine fault" in (info.value.details() or "")
        else:
            line = read_line(proc, "loraplex serving ", 60)
            address = line.split(" on ", 1)[1].split(" ", 1)[0]
            with Client(address, timeout=30) as client, pytest.raises(ServiceError) as error:
                client.generate("hello", max_tokens=4)
            assert error.value.code == grpc.StatusCode.UNAVAILABLE
        assert proc.wait(30) == EXIT_ENGINE_FAILED
        assert "engine failure" in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
