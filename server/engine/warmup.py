"""Kernel warm-up: compile every Triton kernel variant the worker can launch before it reports
ready, so that no kernel compiles inside a serving step.

The variants form a finite set fixed by the config (``loraplex/kernels/variants.py``:
batch-dependent compile-time constants come from the buckets of ``loraplex/kernels/buckets.py``).
Warm-up visits all of it, in three parts:

1. two model steps over dummy sequences (a mixed one: a prefill chunk and a decode, each with
   and without a LoRA segment; then a decode-only one). They compile ``write_kv``, decode and
   prefill attention and whatever else the forward pass runs (cuBLAS, torch kernels);
2. a decode-only step with the attention's keys split, for the split variant of decode and
   its merge kernel (only when the context is long enough for a plan to split);
3. with adapters, one launch of every LoRA shrink and expand variant (each plan of
   ``lora_variants``) on the dummy adapter's pages, with ``x`` and ``y`` laid out as the
   model's projections lay them out.

Parts 2 and 3 run with ``--kernels triton`` only (the references compile nothing). The pages
come from the pager's free list and all go back to it; nothing else is touched (no request,
no prefix-cache entry, no adapter-manager state). The dummy adapter is all zeros, so the
results are meaningless and thrown away.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable

import torch

from loraplex.kernels.layout import AdapterLayout, adapter_layout
from loraplex.kernels.metadata import AttentionMetadata
from loraplex.kernels.variants import LoraVariant, ModuleGeometry, lora_variants
from loraplex.server.engine.adapter_cache import ResidentAdapter
from loraplex.server.engine.lora import LoraBatch
from loraplex.server.engine.model_runner import ModelRunner
from loraplex.server.engine.models.config import LORA_MODULES, ModelConfig
from loraplex.server.engine.models.llama import ForwardContext, module_slices
from loraplex.server.engine.pager import PageKind, Pager

logger = logging.getLogger(__name__)

WARMUP_DIGEST = "warmup"  # never a real digest (those are 64 hex characters)


def module_geometry(config: ModelConfig) -> dict[str, ModuleGeometry]:
    """Each LoRA module's ``x`` and ``y`` layout in the model's forward pass (``llama.py``):
    ``x`` a contiguous ``[T, d_in]``, ``y`` a column slice of its fused group's output."""
    slices = module_slices(config)
    widths: dict[str, int] = {}
    for group, _, end in slices.values():
        widths[group] = max(widths.get(group, 0), end)
    shapes = config.module_shapes()
    return {m: ModuleGeometry(shapes[m][0], shapes[m][1], widths[slices[m][0]], slices[m][1])
            for m in LORA_MODULES}


@torch.inference_mode()
def warm_up(runner: ModelRunner, pager: Pager, max_model_len: int, lora_rank: int | None,
            max_rank: int | None = None, chunk: int = 64) -> bool:
    """Run every kernel variant once on borrowed free pages, then give the pages back.

    Args:
        runner: the engine's model runner (its model, pools and kernels are used).
        pager: the engine's pager; it must have enough free pages (nothing is evicted).
        max_model_len: the context served; the dummy sequences stay within it.
        lora_rank: rank of the dummy adapter on every LoRA module, or None for no LoRA segment
            (an engine without adapters never launches the LoRA kernels).
        max_rank: the largest rank served (LoRA variants are enumerated up to it); defaults
            to ``lora_rank``.
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
    triton = runner.kernels == "triton"
    try:
        adapter = None
        if layout is not None:
            pools.index_fill_(1, torch.tensor(adapter_pages, device=pools.device), 0)
            adapter = ResidentAdapter(WARMUP_DIGEST, layout, 1.0, tuple(adapter_pages))
        tables = [kv_pages[i * pages_per_seq:(i + 1) * pages_per_seq] for i in range(num_seqs)]
        decode = ([1, 1] * len(segments), [chunk + 1, chunk + 2] * len(segments))
        # (q_lens, seq_lens) per step: prefill 0..chunk-1 and decode at chunk, then one more
        # token of each; sequences 2s and 2s+1 form segment s
        with runner.device_context():
            for q_lens, seq_lens in (([chunk, 1] * len(segments),
                                      [chunk, chunk + 1] * len(segments)), decode):
                seg_lens = [q_lens[2 * s] + q_lens[2 * s + 1] for s in range(len(segments))]
                lora = None
                if adapter is not None:
                    lora = LoraBatch(config, pools, runner.lora_ops,
                                     [adapter if d else None for d in segments], seg_lens)
                run_dummy_step(runner, tables, q_lens, seq_lens, lora, runner.attention)
            if triton:
                _split_decode(runner, tables, *decode, max_model_len)
                if adapter is not None and layout is not None:
                    _lora_variants(runner, adapter, layout, max_rank or layout.rank)
        if pools.device.type == "cuda":
            torch.cuda.synchronize(pools.device)  # compiled and run before "ready"
    finally:
        pager.free(kv_pages + adapter_pages)
    logger.info("kernel warm-up: %.1f s", time.perf_counter() - start)
    return True


def run_dummy_step(runner: ModelRunner, tables: list[list[int]], q_lens: list[int],
                   seq_lens: list[int], lora: LoraBatch | None,
                   attention: Callable[..., torch.Tensor]) -> torch.Tensor:
    """One forward pass over dummy tokens: sequence ``s`` computes ``q_lens[s]`` tokens ending
    at ``seq_lens[s]`` on pages ``tables[s]``. Returns each sequence's last logits
    ``[S, vocab]``."""
    device = runner.device
    meta = AttentionMetadata.build(tables, q_lens, seq_lens, runner.page_size, device)
    positions = [p for q, n in zip(q_lens, seq_lens) for p in range(n - q, n)]
    vocab = runner.model.config.vocab_size
    ids = torch.tensor([p % vocab for p in positions], dtype=torch.long, device=device)
    pos = torch.tensor(positions, dtype=torch.long, device=device)
    ctx = ForwardContext(meta, runner.pools, runner.page_size, runner.write_kv, attention, lora)
    hidden = runner.model.forward(ids, pos, ctx)  # [T, hidden]
    last = [end - 1 for end in itertools.accumulate(q_lens)]  # each sequence's last token
    return runner.model.compute_logits(hidden[torch.tensor(last, device=device)])


def _split_decode(runner: ModelRunner, tables: list[list[int]], q_lens: list[int],
                  seq_lens: list[int], max_model_len: int) -> None:
    from loraplex.kernels.attention_plan import attention_plans

    config = runner.model.config
    for plan in attention_plans(config.head_dim, runner.pools.dtype, max_model_len):
        if plan.num_splits > 1:  # the split count is a runtime argument: any plan compiles
            run_dummy_step(runner, tables, q_lens, seq_lens, None,
                 functools.partial(runner.attention, plan=plan))


def _lora_variants(runner: ModelRunner, adapter: ResidentAdapter, layout: AdapterLayout,
                   max_rank: int) -> None:
    from loraplex.kernels import sgmv

    pools, device = runner.pools, runner.device
    config = runner.model.config
    geometry = module_geometry(config)
    pool = pools[0]
    variants: list[LoraVariant] = lora_variants(
        geometry, pool.shape[1], max_rank, pools.dtype,
        pool.data_ptr() // pool.element_size())
    table = torch.tensor([adapter.pages], dtype=torch.int32, device=device)  # [1, pages]
    indptr = torch.tensor([0, 1], dtype=torch.int32, device=device)  # one token, one segment
    ranks = torch.tensor([layout.rank], dtype=torch.int32, device=device)
    scales = torch.ones(1, dtype=torch.float32, device=device)
    for v in variants:
        geo = geometry[v.module]
        if v.op == "shrink":
            x = torch.zeros(1, geo.d_in, dtype=pools.dtype, device=device)  # [T, d_in]
            offsets = torch.tensor([layout.a_offsets[v.module]], dtype=torch.int64,
                                   device=device)
            sgmv.sgmv_shrink(x, pool, table, indptr, ranks, offsets, layout.rank, plan=v.plan)
        else:
            h = torch.zeros(1, layout.rank, dtype=torch.float32, device=device)
            fused = torch.zeros(1, geo.y_stride, dtype=pools.dtype, device=device)
            offsets = torch.tensor([layout.b_offsets[v.module]], dtype=torch.int64,
                                   device=device)
            sgmv.sgmv_expand(h, pool, table, indptr, ranks, offsets, scales,
                             fused[:, geo.y_start:geo.y_start + geo.d_out], plan=v.plan)
