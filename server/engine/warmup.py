"""Kernel warm-up: run the model on dummy steps before a worker reports ready, so that Triton
compiles its kernels then rather than inside the first requests' steps.

Two steps over the same dummy sequences cover every kernel the serving path launches (except
the split-keys merge of decode attention, which only long contexts pick):

1. mixed: a prefill chunk and a decode, each with and without a LoRA segment. Segments of many
   tokens take the ``sgmv`` LoRA path; the step launches ``write_kv`` and both attention kernels;
2. decode-only: one token per sequence, so the LoRA ops take the ``bgmv`` path.

The pages come from the pager's free list and all go back to it; nothing else is touched (no
request, no prefix-cache entry, no adapter-manager state). The dummy adapter is all zeros, so
the steps' results are meaningless and thrown away. Other batch shapes can pick other block
sizes (other compiled variants); those compile on first use, from Triton's on-disk cache after
the first run on a machine.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from loraplex.kernels.layout import adapter_layout
from loraplex.kernels.metadata import AttentionMetadata
from loraplex.server.engine.adapter_cache import ResidentAdapter
from loraplex.server.engine.lora import LoraBatch
from loraplex.server.engine.model_runner import ModelRunner
from loraplex.server.engine.models.config import LORA_MODULES
from loraplex.server.engine.models.llama import ForwardContext
from loraplex.server.engine.pager import PageKind, Pager

logger = logging.getLogger(__name__)

WARMUP_DIGEST = "warmup"  # never a real digest (those are 64 hex characters)


@torch.inference_mode()
def warm_up(runner: ModelRunner, pager: Pager, max_model_len: int, lora_rank: int | None,
            chunk: int = 64) -> bool:
    """Run the two dummy steps on borrowed free pages, then give the pages back.

    Args:
        runner: the engine's model runner (its model, pools and kernels are used).
        pager: the engine's pager; it must have enough free pages (nothing is evicted).
        max_model_len: the context served; the dummy sequences stay within it.
        lora_rank: rank of the dummy adapter on every LoRA module, or None for no LoRA segment
            (an engine without adapters never launches the LoRA kernels).
        chunk: tokens of the dummy prefill chunk.
    Returns:
        Whether it ran (False, with a warning, when too few pages are free).
    """
    start = time.perf_counter()
    config, page_size, pools = runner.model.config, runner.page_size, runner.pools
    chunk = max(1, min(chunk, max_model_len - 2))
    # per segment (the dummy adapter's, the base model's): a prefill and a decode sequence
    segments: list[str | None] = [None]
    layout = None
    if lora_rank:
        segments.insert(0, WARMUP_DIGEST)
        layout = adapter_layout(lora_rank, LORA_MODULES, config.module_shapes())
    num_seqs = 2 * len(segments)
    pages_per_seq = -(-(chunk + 2) // page_size)
    num_adapter_pages = layout.num_pages(pools.shape[2]) if layout is not None else 0
    if num_seqs * pages_per_seq + num_adapter_pages > pager.num_free:
        logger.warning("kernel warm-up skipped: %d free pages, %d needed", pager.num_free,
                       num_seqs * pages_per_seq + num_adapter_pages)
        return False
    kv_pages = pager.allocate(num_seqs * pages_per_seq)
    adapter_pages = pager.allocate(num_adapter_pages, PageKind.ADAPTER)
    try:
        adapter = None
        if layout is not None:
            pools.index_fill_(1, torch.tensor(adapter_pages, device=pools.device), 0)
            adapter = ResidentAdapter(WARMUP_DIGEST, layout, 1.0, tuple(adapter_pages))
        tables = [kv_pages[i * pages_per_seq:(i + 1) * pages_per_seq] for i in range(num_seqs)]
        # (q_lens, seq_lens) per step: prefill 0..chunk-1 and decode at chunk, then one more
        # token of each; sequences 2s and 2s+1 form segment s
        for q_lens, seq_lens in (([chunk, 1] * len(segments), [chunk, chunk + 1] * len(segments)),
                                 ([1, 1] * len(segments), [chunk + 1, chunk + 2] * len(segments))):
            seg_lens = [q_lens[2 * s] + q_lens[2 * s + 1] for s in range(len(segments))]
            lora = None
            if adapter is not None:
                lora = LoraBatch(config, pools, runner.lora_ops,
                                 [adapter if d else None for d in segments], seg_lens)
            with runner.device_context():
                _run(runner, tables, q_lens, seq_lens, lora)
        if pools.device.type == "cuda":
            torch.cuda.synchronize(pools.device)  # compiled and run before "ready"
    finally:
        pager.free(kv_pages + adapter_pages)
    logger.info("kernel warm-up: %.1f s", time.perf_counter() - start)
    return True


def _run(runner: ModelRunner, tables: list[list[int]], q_lens: list[int], seq_lens: list[int],
         lora: LoraBatch | None) -> None:
    device = runner.device
    meta = AttentionMetadata.build(tables, q_lens, seq_lens, runner.page_size, device)
    positions = [p for q, n in zip(q_lens, seq_lens) for p in range(n - q, n)]
    vocab = runner.model.config.vocab_size
    ids = torch.tensor([p % vocab for p in positions], dtype=torch.long, device=device)
    pos = torch.tensor(positions, dtype=torch.long, device=device)
    ctx = ForwardContext(meta, runner.pools, runner.page_size, runner.write_kv,
                         runner.attention, lora)
    hidden = runner.model.forward(ids, pos, ctx)  # [T, hidden]
    last = [end - 1 for end in itertools.accumulate(q_lens)]  # each sequence's last token
    runner.model.compute_logits(hidden[torch.tensor(last, device=device)])
