"""Pool sizing on CUDA: a profiling forward pass at the step's largest size measures the peak
memory of its activations, and the pool gets what is left (vLLM's ``profile_run``).

Without it the pool would take a fraction of the memory free after the weights load, and the
first full step (``max_num_batched_tokens`` tokens: the MLP's ``[T, 2 * intermediate]``, the
logits of every sampling row, the LoRA intermediates) could run out of memory mid-serve. On
CPU the pool keeps ``pool_memory_bytes``; the pass itself runs anywhere (tests run it on CPU).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from loraplex.kernels.layout import adapter_layout, kv_page_elems
from loraplex.server.engine.adapter_cache import ResidentAdapter
from loraplex.server.engine.lora import LoraBatch
from loraplex.server.engine.model_runner import ModelRunner
from loraplex.server.engine.models.config import LORA_MODULES
from loraplex.server.engine.models.llama import LlamaModel
from loraplex.server.engine.warmup import run_dummy_step

PROFILE_DIGEST = "profile"  # never a real digest (those are 64 hex characters)


class ProfileResult(NamedTuple):
    """What the profiling pass ran and measured."""

    num_tokens: int
    num_seqs: int
    lora_rank: int | None
    peak_activation_bytes: int | None  # None off CUDA (nothing measures it there)


def profile_batch(max_num_batched_tokens: int, max_num_seqs: int,
                  max_model_len: int) -> list[int]:
    """Query lengths of the largest step: ``max_num_batched_tokens`` tokens over as many
    sequences as a step may run (so as many logits rows as it may sample), each within the
    context. Pure."""
    for name, value in (("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len)):
        if value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value}")
    num_seqs = max(min(max_num_seqs, max_num_batched_tokens),
                   -(-max_num_batched_tokens // max_model_len))
    base, extra = divmod(max_num_batched_tokens, num_seqs)
    return [base + (s < extra) for s in range(num_seqs)]


def pool_pages(free_bytes: int, activation_bytes: int, utilization: float,
               bytes_per_page: int) -> int:
    """Pages of ``bytes_per_page`` in ``utilization`` of the free memory, less the step's
    activation peak. Pure.

    Raises:
        ValueError: when that holds fewer than 2 pages (naming what to change).
    """
    if bytes_per_page < 1 or free_bytes < 0 or activation_bytes < 0:
        raise ValueError("pool_pages: sizes must be positive")
    budget = int(free_bytes * utilization) - activation_bytes
    num_pages = max(budget, 0) // bytes_per_page
    if num_pages < 2:
        raise ValueError(f"gpu_memory_utilization: {utilization} of {free_bytes} free bytes, "
                         f"less {activation_bytes} bytes of activations, holds fewer than 2 "
                         f"pages of {bytes_per_page} bytes (lower max_num_batched_tokens or "
                         f"raise gpu_memory_utilization)")
    return int(num_pages)


@torch.inference_mode()
def profile_run(model: LlamaModel, page_size: int, kernels: str, q_lens: list[int],
                lora_rank: int | None) -> ProfileResult:
    """Run one forward pass of ``q_lens`` prefill tokens (logits for each sequence's last) on a
    temporary pool of its own, with a zero adapter of ``lora_rank`` on every LoRA module over
    every token (None: no LoRA); measure the activations' peak on CUDA.

    The temporary pool holds one sequence's KV pages, which every dummy sequence shares (their
    K/V are never read for a real result), and the adapter's pages; it and everything the pass
    allocated are freed before this returns. Nothing of the engine (pager, caches) is touched.
    """
    config, device = model.config, model.device
    page_elems = kv_page_elems(page_size, config.num_kv_heads, config.head_dim)
    kv_pages = -(-max(q_lens) // page_size)
    layout = None
    if lora_rank:
        layout = adapter_layout(lora_rank, LORA_MODULES, config.module_shapes())
    adapter_pages = layout.num_pages(page_elems) if layout is not None else 0
    cuda = device.type == "cuda"
    pools = torch.zeros(config.num_layers, kv_pages + adapter_pages, page_elems,
                        dtype=model.dtype, device=device)  # [layers, pages, page_elems]
    runner = ModelRunner(model, pools, page_size, kernels)
    lora = None
    if layout is not None:
        adapter = ResidentAdapter(PROFILE_DIGEST, layout, 1.0,
                                  tuple(range(kv_pages, kv_pages + adapter_pages)))
        lora = LoraBatch(config, pools, runner.lora_ops, [adapter], [sum(q_lens)])
    tables = [list(range(kv_pages))] * len(q_lens)
    peak = None
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with runner.device_context():
        logits = run_dummy_step(runner, tables, q_lens, list(q_lens), lora, runner.attention)
        torch.log_softmax(logits, dim=-1)  # the sampler's widest op: logprobs of every row
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    del runner, lora, pools, logits
    if cuda:
        torch.cuda.empty_cache()  # so that the free memory measured next includes it
    return ProfileResult(sum(q_lens), len(q_lens), lora_rank, peak)
