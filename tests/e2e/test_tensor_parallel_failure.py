"""A tensor-parallel rank that dies or hangs fails its worker cleanly (issue 20): health
NOT_SERVING, in-flight requests UNAVAILABLE well before their deadline, the ``loraplex
worker`` process exits non-zero, and no rank process is left behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from loraplex.server.api import WorkerRequest
from loraplex.server.client import ServiceError
from loraplex.server.engine.request import SamplingParams
from loraplex.server.launch import EXIT_ENGINE_FAILED
from loraplex.server.wire.messages import worker_request_to_pb
from loraplex.server.wire.stubs import ClientStub
from loraplex.v1 import worker_pb2_grpc
from tests.e2e.harness import Cluster, WorkerProcess, wait_for

DEADLINE = 60.0  # seconds: every failure below must arrive long before it


def _fails_unavailable(stream) -> ServiceError:
    start = time.monotonic()
    with pytest.raises(ServiceError) as info:
        list(stream)
    assert time.monotonic() - start < DEADLINE / 2
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "tensor-parallel" in info.value.message
    return info.value


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_rank_fault_mid_step_turns_the_worker_not_serving(model_dir: Path, tmp_path: Path,
                                                          fault: str) -> None:
    cluster = Cluster(model_dir, tmp_path / "store",
                      engine={"tensor_parallel_size": 2, "tensor_parallel_timeout": 8.0})
    worker = cluster.workers[0]
    rank = worker.engine.parallel.group.procs[0]
    try:
        with cluster.client(timeout=DEADLINE) as client, \
                grpc.insecure_channel(worker.address) as channel:
            health = ClientStub(channel)
            assert health.health() == "SERVING"
            stream = client.generate_stream("in flight", max_tokens=1500, ignore_eos=True)
            assert next(stream).token_ids
            # A hung rank stays alive: only the collective's timeout can notice it.
            os.kill(rank.pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
            _fails_unavailable(stream)
            wait_for(lambda: health.health() == "NOT_SERVING", timeout=30, what="health")
            assert health.health("loraplex.liveness") == "NOT_SERVING"
    finally:
        cluster.close()
    assert rank.poll() is not None  # stopped and killed by close(), never left behind


def test_rank_death_while_idle_is_noticed(model_dir: Path, tmp_path: Path) -> None:
    cluster = Cluster(model_dir, tmp_path / "store", engine={"tensor_parallel_size": 2})
    worker = cluster.workers[0]
    try:
        with grpc.insecure_channel(worker.address) as channel:
            health = ClientStub(channel)
            assert health.health() == "SERVING"
            worker.engine.parallel.group.procs[0].kill()
            wait_for(lambda: health.health() == "NOT_SERVING", timeout=30, what="health")
    finally:
        cluster.close()


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def test_worker_process_exits_non_zero_when_a_rank_dies(model_dir: Path,
                                                        tmp_path: Path) -> None:
    worker = WorkerProcess(model_dir, tmp_path / "store", "--tensor-parallel-size", "2")
    try:
        address = worker.wait_ready(120)
        ranks = _children(worker.proc.pid)
        assert len(ranks) == 1
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            request = WorkerRequest("r1", "default", "hello",
                                    SamplingParams(max_tokens=1500, ignore_eos=True))
            stream = stub.Generate(worker_request_to_pb(request), timeout=DEADLINE)
            next(stream)
            os.kill(ranks[0], signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as info:
                list(stream)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "tensor-parallel" in (info.value.details() or "")
        assert worker.proc.wait(30) == EXIT_ENGINE_FAILED
        assert "engine failure" in worker.stderr()
    finally:
        worker.kill()


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent (or init) can reap it


def test_ranks_exit_when_their_worker_is_killed(model_dir: Path, tmp_path: Path) -> None:
    worker = WorkerProcess(model_dir, tmp_path / "store", "--tensor-parallel-size", "2")
    try:
        worker.wait_ready(120)
        ranks = _children(worker.proc.pid)
        assert len(ranks) == 1 and _running(ranks[0])
        argv = Path(f"/proc/{ranks[0]}/cmdline").read_bytes().split(b"\0")
        spec = json.loads(argv[argv.index(b"loraplex.server.engine.parallel.rank") + 1])
        rendezvous = Path(spec["init_method"].removeprefix("file://")).parent
        assert rendezvous.is_dir()
    finally:
        worker.kill()  # SIGKILL: no clean stop, the rank only sees its stdin close
    wait_for(lambda: not _running(ranks[0]), timeout=60, what="the orphaned rank to exit")
    assert not rendezvous.exists()  # removed by the rank, since its driver could not
