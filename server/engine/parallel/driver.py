"""The driver rank: the worker process's engine with its shard of the model.

The scheduler, pager, prefix cache and adapter host cache run here once. Each step the
driver's runner sends the batch (``protocol.py``) and the shards of adapters copied into
pages since the last step to the other ranks, then runs its own shard of the forward pass;
only the driver computes logits (lm_head is replicated: ``sharding.py``).
"""

from __future__ import annotations

import atexit

import torch
import torch.distributed as dist

from loraplex.kernels.layout import AdapterLayout
from loraplex.server.config import EngineConfig
from loraplex.server.engine.adapter_cache import HostAdapter
from loraplex.server.engine.lora import LoraBatch
from loraplex.server.engine.model_runner import ModelRunner, StepTokens
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.models.llama import LlamaModel
from loraplex.server.engine.parallel.group import RankFailure, RankGroup, load_shard
from loraplex.server.engine.parallel.protocol import FillSpec, SegmentSpec, StepMessage, encode
from loraplex.server.engine.parallel.sharding import Shard, check_tensor_parallel


class DriverSharding:
    """``adapter_cache.PoolSharding``: each adapter copied into pages is cut into its ``N``
    shards; rank 0's goes into this pool now, the others' with the next step."""

    def __init__(self, config: ModelConfig, size: int) -> None:
        self.shards = [Shard(config, size, r) for r in range(size)]
        self._fills: list[tuple[FillSpec, list[torch.Tensor]]] = []

    def pool_layout(self, layout: AdapterLayout) -> AdapterLayout:
        return self.shards[0].adapter_layout(layout)

    def local_region(self, host: HostAdapter, pages: list[int]) -> torch.Tensor:
        regions = [s.adapter(host.flat, host.layout) for s in self.shards]
        self._fills.append((FillSpec(regions[0].shape[1], tuple(pages)), regions))
        return regions[0]

    def take_fills(self) -> list[tuple[FillSpec, list[torch.Tensor]]]:
        fills, self._fills = self._fills, []
        return fills


class DriverRunner(ModelRunner):
    """``ModelRunner`` whose forward pass first sends the step to the other ranks.

    Any failure inside a tensor-parallel forward pass is a ``RankFailure``: the other ranks
    are then inside (or waiting for) a collective this rank will not join, so no later step
    could line up with them.
    """

    def __init__(self, model: LlamaModel, pools: torch.Tensor, page_size: int, kernels: str,
                 group: RankGroup, sharding: DriverSharding) -> None:
        super().__init__(model, pools, page_size, kernels)
        self.group = group
        self.sharding = sharding
        self.all_reduce = group.all_reduce

    def forward(self, step: StepTokens, lora: LoraBatch | None) -> torch.Tensor:
        self.group.check()
        segments = [SegmentSpec(lo, hi, a.layout.rank, a.layout.modules, a.scale, a.pages)
                    for lo, hi, a in (lora.segments if lora is not None else [])]
        fills = self.sharding.take_fills()
        message = encode(StepMessage(step, segments, [f for f, _ in fills]))
        try:
            self.group.send_step(message, [regions for _, regions in fills])
            return super().forward(step, lora)
        except Exception as exc:
            self.group.fail(f"tensor-parallel step failed: {exc}")
            raise RankFailure(self.group.failed) from exc


class TensorParallel:
    """The engine's handle on its ranks: the driver's shard, its runner, the adapter sharding.

    Raises ``ValueError`` (naming ``tensor_parallel_size``) before anything starts when the
    model cannot be split that way or the devices are missing.
    """

    def __init__(self, config: EngineConfig, model_path: str, model_config: ModelConfig,
                 kernels: str, max_model_len: int, lora: bool) -> None:
        size = config.tensor_parallel_size
        check_tensor_parallel(model_config, size)
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size: this process already runs a "
                             "tensor-parallel engine (torch.distributed has one default group "
                             "per process; close it first)")
        if config.device.startswith("cuda"):
            first = torch.device(config.device).index or 0
            if torch.cuda.device_count() < first + size:
                raise ValueError(f"tensor_parallel_size: {size} ranks from {config.device} "
                                 f"need {first + size} GPUs; {torch.cuda.device_count()} are "
                                 "visible")
        self.group = RankGroup(str(model_path), config.dtype, config.device, kernels,
                               config.page_size, size, config.tensor_parallel_timeout,
                               max_model_len, config.max_rank,
                               min(16, config.max_rank) if lora else 0)
        atexit.register(self.close)
        try:
            self.model = load_shard(self.group.spec, model_config, 0)
            self.group.wait_ready()
        except BaseException:
            self.close()
            raise
        self.sharding = DriverSharding(model_config, size)

    @property
    def failed(self) -> str | None:
        """Why the ranks cannot go on, once one has failed."""
        return self.group.failed

    def check(self) -> None:
        self.group.check()

    def runner(self, pools: torch.Tensor, kernels: str) -> DriverRunner:
        """The driver's runner over ``pools``; the other ranks allocate pools of its shape."""
        self.group.send_pool(pools.shape[1], pools.shape[2])
        return DriverRunner(self.model, pools, self.group.spec.page_size, kernels, self.group,
                            self.sharding)

    def close(self) -> None:
        self.group.close()
