"""Tensor parallelism on CPU (gloo, two rank processes): greedy float32 tokens equal to
transformers + peft and to TP = 1, for a mixed batch of adapters (ranks 1..64, all seven
modules and subsets, rslora) and base requests, with the KV heads divided (4 heads, 2 KV
heads) and replicated (4 heads, 1 KV head), with the prefix cache on and with preemption;
and with biases (o and down on rank 0 only) and tied embeddings against transformers."""

from __future__ import annotations

import pytest
import torch

from loraplex.adapter_store.format import load_adapter
from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.models.config import ModelConfig
from tests.engine.test_lora_parity import LoadedSource, digests_for, run
from tests.engine.test_parity import run_staggered
from tests.helpers import (
    hf_greedy,
    make_model,
    make_peft_adapters,
    peft_greedy,
    random_prompts,
    warm_host_tier,
)


@pytest.fixture(scope="module", params=[2, 1], ids=["kv-heads-divide", "kv-heads-replicated"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"tp-kv{request.param}")
    # Seeds where EOS is never the top token: peft_greedy's min_new_tokens masks it, while
    # ignore_eos does not (other seeds differ from peft at TP = 1 already, by that alone).
    seed = {2: 21, 1: 25}[request.param]
    model = make_model(root / "model", "llama", seed=seed, num_key_value_heads=request.param)
    paths = make_peft_adapters(model, root / "adapters")
    config = ModelConfig.from_pretrained(model)
    adapters = {name: load_adapter(p, config) for name, p in paths.items()}
    names = list(paths) + [None, None, None, None, "d-r16-all"]
    prompts = random_prompts(len(names), seed=31, low=4, high=30)
    # Same adapter, same 12-token prefix, arriving later: served from the prefix cache.
    prompts[12] = prompts[3][:12] + [7, 8, 9]
    max_tokens = [6 + (i * 3) % 7 for i in range(len(names))]
    expected = peft_greedy(model, paths, prompts, names, max_tokens)
    return model, adapters, names, prompts, max_tokens, expected


def engine(model, adapters, tp: int, num_pages: int, batched: int) -> Engine:
    return Engine(EngineConfig(model=str(model), num_pages=num_pages, tensor_parallel_size=tp,
                               tensor_parallel_timeout=60, scheduler=SchedulerConfig(
                                   page_size=4, max_num_batched_tokens=batched)),
                  adapter_source=LoadedSource(adapters.values()))


def test_tp2_matches_peft_and_tp1_with_prefix_cache(setup):
    model, adapters, names, prompts, max_tokens, expected = setup
    digests = digests_for(adapters, names)
    arrivals = [(i * 2) % 7 for i in range(len(names) - 1)] + [20]
    tp1 = engine(model, adapters, 1, 800, 64)
    assert run(tp1, prompts, digests, max_tokens, arrivals) == expected
    tp2 = engine(model, adapters, 2, 800, 64)
    try:
        assert run(tp2, prompts, digests, max_tokens, arrivals) == expected
        stats = tp2.stats()
        assert stats.adapter_loads == 8 and len(stats.resident_adapters) == 8
        assert sum(stats.prefix_hit_tokens.values()) >= 12
        # Shard-sized pages on every rank: half the KV heads (or one replicated head).
        assert tp2.page_elems == 2 * 4 * 1 * 16
        with pytest.raises(ValueError, match="already runs a tensor-parallel engine"):
            engine(model, adapters, 2, 800, 64)
    finally:
        tp2.close()
    assert all(p.poll() is not None for p in tp2.parallel.group.procs)


def test_tp2_preemption_and_adapter_eviction_keep_outputs(setup):
    model, adapters, names, prompts, max_tokens, expected = setup
    digests = digests_for(adapters, names)
    # The rank-64 adapter's shard takes 176 pages of 128 elements (A of q/k/v is replicated):
    # this pool holds it and some KV, never every adapter beside the KV.
    tp2 = engine(model, adapters, 2, 188, 16)
    try:
        warm_host_tier(tp2, digests)  # the same schedule (and preemption) on any machine
        assert run(tp2, prompts, digests, max_tokens, [0] * len(names)) == expected
        assert run(tp2, prompts, digests, max_tokens, [i % 5 for i in range(len(names))]) \
            == expected
        stats = tp2.stats()
        assert stats.num_preemptions > 0
        assert stats.adapter_evictions > 0
        assert stats.pages.num_kv == 0
    finally:
        tp2.close()


def test_refuses_a_size_the_heads_do_not_divide(setup):
    model = setup[0]
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide the model's "
                                         "4 attention heads"):
        Engine(EngineConfig(model=str(model), num_pages=64, tensor_parallel_size=3))


@pytest.mark.parametrize("arch,overrides", [
    ("qwen2", {}),  # q/k/v biases: column-parallel, sliced with their rows
    ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
])
def test_tp2_biases_and_tied_embeddings_match_transformers(tmp_path, arch, overrides):
    # o and down biases live on rank 0 only: the all-reduce adds them once.
    model = make_model(tmp_path / arch, arch, seed=5, **overrides)
    prompts = random_prompts(3, seed=2, low=6, high=24)
    expected = hf_greedy(model, prompts, 8)
    tp2 = Engine(EngineConfig(model=str(model), num_pages=64, tensor_parallel_size=2,
                              scheduler=SchedulerConfig(page_size=4)))
    try:
        assert run_staggered(tp2, prompts, [8, 8, 8], [0, 1, 2]) == expected
    finally:
        tp2.close()


@pytest.mark.timeout(900)
def test_tp2_triton_kernels_match_peft(setup_small):
    # The kernels' path (segment tables, the op signature) on every rank: the Triton
    # interpreter on CPU, natively on GPUs.
    model, adapters, names, prompts, max_tokens, expected = setup_small
    device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    tp2 = Engine(EngineConfig(model=str(model), num_pages=400, kernels="triton", device=device,
                              tensor_parallel_size=2, scheduler=SchedulerConfig(
                                  page_size=4, max_num_batched_tokens=64)),
                 adapter_source=LoadedSource(adapters.values()))
    try:
        assert tp2.kernels == "triton"
        assert run(tp2, prompts, digests_for(adapters, names), max_tokens, [0, 0, 1, 2]) \
            == expected
    finally:
        tp2.close()
