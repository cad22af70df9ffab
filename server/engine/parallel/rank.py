"""A non-driver tensor-parallel rank: ``python -m loraplex.server.engine.parallel.rank SPEC R``.

It loads its shard, waits for the pool's size, then runs every step the driver broadcasts:
the same forward pass on its shard of the weights and of every page, the row-parallel layers'
all-reduces with the other ranks. It never samples and never schedules; it keeps no state but
its pool and the resolved views of the adapters in it.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist

from loraplex.kernels import huge_pages
from loraplex.kernels.layout import adapter_layout
from loraplex.server.engine.adapter_cache import ResidentAdapter
from loraplex.server.engine.lora import LoraBatch
from loraplex.server.engine.model_runner import ModelRunner
from loraplex.server.engine.models.config import ModelConfig, parse_dtype
from loraplex.server.engine.pager import Pager
from loraplex.server.engine.parallel.group import (
    OP_STOP,
    Groups,
    RankSpec,
    init_groups,
    load_shard,
)
from loraplex.server.engine.parallel.protocol import SegmentSpec, decode
from loraplex.server.engine.warmup import warm_up

logger = logging.getLogger(__name__)

# Resolved adapters a rank keeps (an evicted adapter's entry lingers until its pages are
# refilled or it ages out; a batch holds far fewer distinct adapters than this).
MAX_ADAPTERS = 512


def _leave(spec: RankSpec, status: int) -> None:
    # A killed driver cannot remove its rendezvous directory; its ranks outlive it briefly.
    shutil.rmtree(Path(spec.init_method.removeprefix("file://")).parent, ignore_errors=True)
    os._exit(status)


def _exit_with_driver(spec: RankSpec) -> None:
    # The driver holds the write end of our stdin: EOF means it is gone (or stopping us).
    sys.stdin.buffer.read()
    _leave(spec, 1)


def copy_region(pools: torch.Tensor, pages: tuple[int, ...], region: torch.Tensor) -> None:
    """Write ``region [num_layers, n]`` into ``pages`` laid end to end, in every layer."""
    n, e = region.shape[1], pools.shape[2]
    full = n // e
    region = region.to(pools.device)
    if full:
        index = torch.tensor(pages[:full], device=pools.device)
        pools.index_copy_(1, index, region[:, :full * e].reshape(-1, full, e))
    if n > full * e:
        pools[:, pages[full], :n - full * e].copy_(region[:, full * e:])


class RankLoop:
    """Receives steps and runs them, until the driver says stop."""

    def __init__(self, spec: RankSpec, rank: int, groups: Groups) -> None:
        self.spec = spec
        self.groups = groups
        config = ModelConfig.from_pretrained(spec.model_path)
        self.model = load_shard(spec, config, rank)
        dist.barrier(group=groups.idle)
        sizes = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(sizes, 0, group=groups.idle)
        num_pages, page_elems = sizes.tolist()
        pools = huge_pages.zeros((config.num_layers, num_pages, page_elems),
                                 parse_dtype(spec.dtype), spec.device_of(rank))
        self.runner = ModelRunner(self.model, pools, spec.page_size, spec.kernels)
        self.runner.all_reduce = self._all_reduce
        if spec.warms_up:
            # The same variants as the driver's warm-up, on pages of a pager of its own (the
            # warm-up runs the model without collectives), then the barrier the driver joins.
            warm_up(self.runner, Pager(num_pages), spec.max_model_len,
                    spec.warmup_lora_rank or None, spec.max_rank)
            dist.barrier(group=groups.idle)
        # Resolved adapters by (pages, rank, modules, scale), least recently used first,
        # forgotten when a fill overwrites any of their pages (the CPU LoRA path caches views
        # and copies of their blocks on them) or beyond MAX_ADAPTERS.
        self._adapters: OrderedDict[tuple[object, ...], ResidentAdapter] = OrderedDict()

    def _all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.groups.device)

    def serve(self) -> None:
        header = torch.zeros(2, dtype=torch.int64)
        while True:
            dist.broadcast(header, 0, group=self.groups.idle)
            op, size = header.tolist()
            if op == OP_STOP:
                return
            data = torch.empty(size, dtype=torch.int64)
            dist.broadcast(data, 0, group=self.groups.cpu)
            self.step(data)

    @torch.inference_mode()
    def step(self, data: torch.Tensor) -> None:
        msg = decode(data)
        pools = self.runner.pools
        for fill in msg.fills:
            region = torch.empty(pools.shape[0], fill.num_elems, dtype=pools.dtype)
            dist.scatter(region, None, src=0, group=self.groups.cpu)
            touched = set(fill.pages)
            self._adapters = OrderedDict((k, a) for k, a in self._adapters.items()
                                         if touched.isdisjoint(a.pages))
            copy_region(pools, fill.pages, region)
        with self.runner.device_context():
            self.runner.forward(msg.tokens, self._lora(msg.segments, len(msg.tokens.input_ids)))

    def _lora(self, segments: list[SegmentSpec], num_tokens: int) -> LoraBatch | None:
        if not segments:
            return None
        adapters: list[ResidentAdapter | None] = []
        seg_lens: list[int] = []
        row = 0
        for s in segments:
            if s.lo > row:
                adapters.append(None)
                seg_lens.append(s.lo - row)
            adapters.append(self._resident(s))
            seg_lens.append(s.hi - s.lo)
            row = s.hi
        if row < num_tokens:
            adapters.append(None)
            seg_lens.append(num_tokens - row)
        return LoraBatch(self.model.config, self.runner.pools, self.runner.lora_ops, adapters,
                         seg_lens)

    def _resident(self, s: SegmentSpec) -> ResidentAdapter:
        key = (s.pages, s.rank, s.modules, s.scale)
        adapter = self._adapters.get(key)
        if adapter is None:
            layout = adapter_layout(s.rank, s.modules, self.model.config.module_shapes())
            adapter = self._adapters[key] = ResidentAdapter("", layout, s.scale, s.pages)
            while len(self._adapters) > MAX_ADAPTERS:
                self._adapters.popitem(last=False)
        self._adapters.move_to_end(key)
        return adapter


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-rank %(message)s")
    spec = RankSpec.from_json(argv[0])
    rank = int(argv[1])
    threading.Thread(target=_exit_with_driver, args=(spec,), daemon=True).start()
    try:
        groups = init_groups(spec, rank)
        RankLoop(spec, rank, groups).serve()
    except Exception:
        # Often the driver's death seen first as a broken collective, before the stdin
        # watcher sees its EOF: this path removes the rendezvous too (the group is over).
        logger.exception("tensor-parallel rank %d failed", rank)
        _leave(spec, 1)
    dist.destroy_process_group()
    logging.shutdown()
    # Not a normal interpreter exit: the stdin watcher thread is blocked in a read.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
