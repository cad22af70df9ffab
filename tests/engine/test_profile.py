"""Pool sizing after a profiling forward pass: the pure parts (the profiled step's shape, pages
from free memory less the activations' peak), the pass itself on CPU, and on a GPU the engine
sizing its pool from it."""

from __future__ import annotations

import pytest
import torch

from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.lora import LoraBatch
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.models.loader import load_weights
from loraplex.server.engine.profile import pool_pages, profile_batch, profile_run

GiB, MiB = 1 << 30, 1 << 20


@pytest.mark.parametrize("tokens,seqs,context", [
    (2048, 256, 4096), (2048, 256, 2), (7, 256, 4096), (100, 3, 40), (1, 1, 1), (8192, 1, 1024)])
def test_profile_batch_is_the_largest_step(tokens: int, seqs: int, context: int) -> None:
    q_lens = profile_batch(tokens, seqs, context)
    assert sum(q_lens) == tokens  # every token a step may compute
    assert max(q_lens) <= context and min(q_lens) >= 1 and max(q_lens) - min(q_lens) <= 1
    # as many sampling rows as a step may have, unless the context forces more sequences
    assert len(q_lens) == max(min(seqs, tokens), -(-tokens // context))


def test_profile_batch_refuses_empty_sizes() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        profile_batch(16, 0, 32)


def test_pool_pages_leaves_room_for_the_activations() -> None:
    assert pool_pages(10 * GiB, 0, 0.9, 2 * MiB) == 9 * GiB // (2 * MiB)
    assert pool_pages(10 * GiB, 1 * GiB, 0.9, 2 * MiB) == 8 * GiB // (2 * MiB)
    assert pool_pages(10 * GiB, 1 * GiB + 1, 0.9, 2 * MiB) == 8 * GiB // (2 * MiB) - 1
    with pytest.raises(ValueError, match="gpu_memory_utilization.*max_num_batched_tokens"):
        pool_pages(10 * GiB, 9 * GiB, 0.9, 2 * MiB)  # the activations take it all
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        pool_pages(3 * MiB, 0, 1.0, 2 * MiB)


def test_profile_run_on_cpu_runs_the_largest_step_with_max_rank_lora(tiny_llama, monkeypatch):
    config = ModelConfig.from_pretrained(tiny_llama)
    model = load_weights(tiny_llama, config, torch.float32, torch.device("cpu"))
    rows: list[int] = []
    real = LoraBatch.__call__

    def spy(self, layer, group, x, y):
        rows.append(x.shape[0])
        return real(self, layer, group, x, y)

    monkeypatch.setattr(LoraBatch, "__call__", spy)
    q_lens = profile_batch(96, 8, 40)
    result = profile_run(model, 4, "torch", q_lens, lora_rank=64)
    assert result == (96, 8, 64, None)  # nothing measures a CPU's peak
    assert rows == [96] * (4 * config.num_layers)  # every LoRA group of every layer, all tokens
    rows.clear()
    assert profile_run(model, 4, "torch", q_lens, lora_rank=None) == (96, 8, None, None)
    assert not rows


def test_cpu_engine_keeps_pool_memory_bytes(tiny_llama):
    engine = Engine(EngineConfig(model=str(tiny_llama), pool_memory_bytes=1 << 20,
                                 scheduler=SchedulerConfig(page_size=4)))
    assert engine.profile is None
    bytes_per_page = engine.page_elems * engine.model_config.num_layers * 4
    assert engine.pager.num_pages == (1 << 20) // bytes_per_page


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_cuda_engine_sizes_its_pool_after_a_profiling_pass(tiny_llama):
    config = ModelConfig.from_pretrained(tiny_llama)
    model = load_weights(tiny_llama, config, torch.float32, torch.device("cuda"))
    small, large = (profile_run(model, 16, "triton", profile_batch(t, 256, 256), 64)
                    for t in (64, 4096))
    assert 0 < small.peak_activation_bytes < large.peak_activation_bytes
    engine = Engine(EngineConfig(model=str(tiny_llama), device="cuda", kernels="triton",
                                 gpu_memory_utilization=0.02,
                                 scheduler=SchedulerConfig(max_num_batched_tokens=512)))
    assert engine.profile is not None and engine.profile.num_tokens == 512
    assert engine.profile.peak_activation_bytes > 0
    free, _ = torch.cuda.mem_get_info()
    assert engine.pager.num_pages >= 2
    assert engine.pager.num_pages * engine.page_elems * config.num_layers * 4 < free
    assert engine.pager.stats().num_free == engine.pager.num_pages  # warm-up gave back its pages
