"""The ranks of one tensor-parallel worker: processes started and watched by the driver
(rank 0, the worker process itself), and the process groups they talk through.

Three groups, made in the same order on every rank:

* ``idle`` (gloo, no practical timeout): the two-integer header a rank waits on between
  steps. The driver may sit idle for hours; a rank waiting there costs no CPU and no GPU (a
  NCCL broadcast would spin a kernel).
* ``cpu`` (gloo, ``tensor_parallel_timeout``): the step message and the adapter shards.
* ``device`` (NCCL on CUDA, else the ``cpu`` group): the row-parallel layers' all-reduce.

A rank that dies closes its sockets, so the driver's next collective fails at once; one that
hangs makes it fail after the timeout; the driver's watcher thread notices a dead rank even
while no step runs. Every such failure is a ``RankFailure``: the engine thread ends, the
worker reports NOT_SERVING, fails its requests UNAVAILABLE and exits non-zero. A rank whose
driver is gone sees its stdin (a pipe from the driver) close and exits: none is left spinning.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from loraplex.server.engine.models.config import ModelConfig, parse_dtype
from loraplex.server.engine.models.llama import LayerWeights, LlamaModel
from loraplex.server.engine.models.loader import load_tensors
from loraplex.server.engine.parallel.sharding import Shard

logger = logging.getLogger(__name__)

OP_STEP, OP_STOP = 1, 2
IDLE_TIMEOUT = timedelta(days=30)
# The rendezvous waits for every rank process to start (Python and torch imported); loading the
# checkpoint comes after it, behind a barrier of the idle group.
MIN_RENDEZVOUS_SECONDS = 60.0
WATCH_INTERVAL_SECONDS = 0.2
STOP_GRACE_SECONDS = 10.0


class RankFailure(RuntimeError):
    """A tensor-parallel rank died, hung past the timeout, or a collective failed: the ranks
    are out of step and the worker cannot go on."""


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to start: engine-built strings and numbers, sent as JSON."""

    model_path: str
    dtype: str
    device: str  # "cpu", "cuda" or "cuda:K" (rank r takes cuda:K+r)
    kernels: str  # resolved: "torch" or "triton"
    page_size: int
    size: int
    timeout: float  # seconds
    init_method: str  # file:// rendezvous
    max_model_len: int  # for the warm-up (Triton on CUDA), as the driver's
    max_rank: int
    warmup_lora_rank: int  # 0: no adapters served

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) != {f for f in cls.__dataclass_fields__}:
            raise ValueError("rank spec: unexpected fields")
        return cls(**data)

    @property
    def warms_up(self) -> bool:
        """Whether every rank compiles its kernels before serving (Triton on CUDA), then
        meets the others at a barrier (``RankGroup.wait_ready`` on the driver)."""
        return self.device.startswith("cuda") and self.kernels == "triton"

    def device_of(self, rank: int) -> torch.device:
        if not self.device.startswith("cuda"):
            return torch.device("cpu")
        first = torch.device(self.device).index or 0
        return torch.device("cuda", first + rank)


class Groups(NamedTuple):
    idle: Any
    cpu: Any
    device: Any


def init_groups(spec: RankSpec, rank: int) -> Groups:
    """Join the rendezvous as ``rank`` and make the three groups (same order everywhere)."""
    cuda = spec.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(spec.device_of(rank))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=spec.init_method,
                            rank=rank, world_size=spec.size,
                            timeout=timedelta(seconds=max(spec.timeout, MIN_RENDEZVOUS_SECONDS)))
    timeout = timedelta(seconds=spec.timeout)
    idle = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    cpu = dist.new_group(backend="gloo", timeout=timeout)
    device = dist.new_group(backend="nccl", timeout=timeout) if cuda else cpu
    return Groups(idle, cpu, device)


def load_shard(spec: RankSpec, config: ModelConfig, rank: int) -> LlamaModel:
    """Read the checkpoint and keep this rank's shard of it, on this rank's device."""
    shard = Shard(config, spec.size, rank)
    device = spec.device_of(rank)

    def keep(w: LayerWeights) -> LayerWeights:
        s = shard.layer(w)
        for name, value in vars(s).items():
            if value is not None:
                setattr(s, name, value.to(device))
        return s

    embed, sharded, norm, lm_head = load_tensors(spec.model_path, config,
                                                 parse_dtype(spec.dtype), layer_fn=keep)
    tied = lm_head is embed
    embed = embed.to(device)
    return LlamaModel(shard.local, embed, sharded, norm.to(device),
                      embed if tied else lm_head.to(device))


def _rank_command(spec: RankSpec, rank: int) -> list[str]:
    return [sys.executable, "-m", "loraplex.server.engine.parallel.rank", spec.to_json(),
            str(rank)]


class RankGroup:
    """The driver's side: starts ranks ``1..N-1``, joins them as rank 0, watches them."""

    def __init__(self, model_path: str, dtype: str, device: str, kernels: str, page_size: int,
                 size: int, timeout: float, max_model_len: int, max_rank: int,
                 warmup_lora_rank: int) -> None:
        self._dir = tempfile.mkdtemp(prefix="loraplex-tp-")
        self.spec = RankSpec(model_path, dtype, device, kernels, page_size, size, timeout,
                             "file://" + str(Path(self._dir) / "rendezvous"), max_model_len,
                             max_rank, warmup_lora_rank)
        self.failed: str | None = None
        self._closing = threading.Event()
        # stdin is a pipe the rank watches: when this process ends, however, the rank ends.
        self.procs = [subprocess.Popen(_rank_command(self.spec, r), stdin=subprocess.PIPE)
                      for r in range(1, size)]
        self._watcher = threading.Thread(target=self._watch, name="loraplex-tp-watch",
                                         daemon=True)
        self._watcher.start()
        try:
            self.groups = init_groups(self.spec, 0)
        except BaseException:
            self.close()
            raise

    def _watch(self) -> None:
        while not self._closing.wait(WATCH_INTERVAL_SECONDS):
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._closing.is_set():
                    self.fail(f"tensor-parallel rank {rank} exited with status {code}")
                    return

    def fail(self, reason: str) -> None:
        """Mark the group broken (the first reason is kept)."""
        if self.failed is None:
            self.failed = reason
            logger.error("%s: the worker stops serving", reason)

    def check(self) -> None:
        """Raise ``RankFailure`` if a rank has failed."""
        if self.failed is not None:
            raise RankFailure(self.failed)

    def wait_ready(self) -> None:
        """Until every rank has loaded its shard (or warmed up; or one has died)."""
        self._guarded(dist.barrier, group=self.groups.idle)

    def send_pool(self, num_pages: int, page_elems: int) -> None:
        self._guarded(dist.broadcast, torch.tensor([num_pages, page_elems]), 0,
                      group=self.groups.idle)

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.groups.device)

    def send_step(self, message: torch.Tensor, fills: list[list[torch.Tensor]]) -> None:
        """Broadcast one step's message, then scatter each fill's per-rank shards."""
        dist.broadcast(torch.tensor([OP_STEP, message.numel()]), 0, group=self.groups.idle)
        dist.broadcast(message, 0, group=self.groups.cpu)
        for shards in fills:
            dist.scatter(torch.empty_like(shards[0]), shards, src=0, group=self.groups.cpu)

    def _guarded(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        self.check()
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            self.fail(f"tensor-parallel ranks failed: {exc}")
            raise RankFailure(self.failed) from exc

    def close(self) -> None:
        """Stop every rank: ask them to stop if the group is healthy, kill any left after a
        grace period, and leave the process group (idempotent)."""
        if self._closing.is_set():
            return
        self._closing.set()
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:  # not yet seen by the watcher: no stop message to it
                self.fail(f"tensor-parallel rank {rank} exited with status {proc.returncode}")
        if self.failed is None and hasattr(self, "groups"):
            try:
                dist.broadcast(torch.tensor([OP_STOP, 0]), 0, group=self.groups.idle)
            except Exception:
                logger.warning("tensor-parallel stop message failed; killing the ranks")
        if self.failed is None:
            for proc in self.procs:
                try:
                    proc.wait(STOP_GRACE_SECONDS)
                except subprocess.TimeoutExpired:
                    break
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()  # a rank still alive exits on its stdin's EOF
            try:
                proc.wait(1.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._dir, ignore_errors=True)
