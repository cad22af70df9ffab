"""Kernel warm-up (run by the engine on CUDA before it reports ready), called here explicitly
with --kernels triton (under the interpreter on CPU): it launches every kernel the serving path
uses, gives back every page it borrowed, and changes no later output. With a GPU, the CUDA
engine end to end: warm-up at start, adapter copies, peft parity and seeded sampling."""

from __future__ import annotations

import pytest
import torch

from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from tests.engine.test_lora_parity import LoadedSource, digests_for, run


def _record_launches(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    from loraplex.kernels import paged_attention as pa
    from loraplex.kernels import sgmv

    seen: set[str] = set()

    def spy(module, name, kernels):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            out = real(*args, **kwargs)
            seen.update(launch.kernel.__name__ for launch in kernels(out))
            return out

        monkeypatch.setattr(module, name, wrapper)

    spy(sgmv, "shrink_launch", lambda launch: [launch])
    spy(sgmv, "expand_launch", lambda launch: [launch])
    spy(pa, "attention_launches", lambda launches: launches.values())
    return seen


@pytest.mark.timeout(900)
def test_warmup_launches_every_kernel_and_returns_its_pages(setup_small, monkeypatch):
    model, adapters, names, prompts, max_tokens, expected = setup_small
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton natively, or interpreted
    engine = Engine(EngineConfig(model=str(model), device=device, num_pages=400,
                                 kernels="triton",
                                 scheduler=SchedulerConfig(page_size=4,
                                                           max_num_batched_tokens=64)),
                    adapter_source=LoadedSource(adapters.values()))
    before = engine.pager.stats()
    assert before.num_free == before.num_pages
    launched = _record_launches(monkeypatch)
    engine.warmup()
    assert launched == {"_shrink_sgmv_kernel", "_expand_sgmv_kernel", "_shrink_bgmv_kernel",
                        "_expand_bgmv_kernel", "_decode_kernel", "_prefill_kernel"}
    assert engine.pager.stats() == before  # every borrowed page is free again
    assert engine.adapters is not None and not engine.adapters.resident_digests()
    assert engine.stats().num_steps == 0
    got = run(engine, prompts, digests_for(adapters, names), max_tokens, [0, 0, 1, 2])
    assert got == expected


@pytest.mark.timeout(900)
def test_warmup_compiles_every_variant_serving_launches(setup_small, monkeypatch):
    # Warm-up launches exactly the enumerated variant set, and a served mixed batch afterwards
    # (adapters of ranks 1, 4 and 16 and the base model, prefill chunks and decodes) launches
    # no compile key that warm-up did not: nothing would compile mid-serve.
    from loraplex.kernels.variants import serving_variants
    from loraplex.server.engine.warmup import module_geometry
    from tests.kernels.compile_keys import constexpr_part, record_compile_keys

    model, adapters, names, prompts, max_tokens, expected = setup_small
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = Engine(EngineConfig(model=str(model), device=device, num_pages=400,
                                 kernels="triton", max_rank=32,
                                 scheduler=SchedulerConfig(page_size=4,
                                                           max_num_batched_tokens=16)),
                    adapter_source=LoadedSource(adapters.values()))
    keys = record_compile_keys(monkeypatch)
    engine.warmup()
    warmed = set(keys)
    cfg, pool = engine.model_config, engine.runner.pools[0]
    enumerated = serving_variants(module_geometry(cfg), cfg.num_heads, cfg.num_kv_heads,
                                  cfg.head_dim, 4, pool.dtype, engine.max_model_len, 32,
                                  pool.data_ptr() // pool.element_size())
    assert constexpr_part(list(warmed)) == constexpr_part(enumerated)
    keys.clear()
    got = run(engine, prompts, digests_for(adapters, names), max_tokens, [0, 0, 1, 2])
    assert got == expected
    assert keys and set(keys) <= warmed, sorted(set(keys) - warmed)


def test_warmup_skips_when_pages_are_short(setup_small):
    model, *_ = setup_small
    engine = Engine(EngineConfig(model=str(model), num_pages=8, kernels="torch",
                                 scheduler=SchedulerConfig(page_size=4)))
    engine.warmup()  # needs 2 sequences of 17 pages: logs and returns
    assert engine.pager.stats().num_free == 8


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_cuda_engine_warms_up_serves_and_samples(setup_small):
    # the CUDA path end to end: warm-up in __init__, pinned adapter copies on the copy stream,
    # float32 greedy tokens identical to peft, seeded sampling with the requests' CPU generators
    from loraplex.server.engine.request import SamplingParams

    model, adapters, names, prompts, max_tokens, expected = setup_small
    engine = Engine(EngineConfig(model=str(model), device="cuda", num_pages=400,
                                 kernels="triton",
                                 scheduler=SchedulerConfig(page_size=4,
                                                           max_num_batched_tokens=64)),
                    adapter_source=LoadedSource(adapters.values()))
    assert engine.pager.stats().num_free == 400
    got = run(engine, prompts, digests_for(adapters, names), max_tokens, [0, 0, 1, 2])
    assert got == expected
    drawn = []
    for rid in ("s0", "s1"):
        engine.add_request(rid, prompts[0], SamplingParams(max_tokens=4, temperature=0.8,
                                                           seed=7, ignore_eos=True),
                           adapter_digest=digests_for(adapters, names)[0])
        tokens = []
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None, out.error
                tokens.extend(out.new_token_ids)
        drawn.append(tokens)
    assert drawn[0] == drawn[1] and len(drawn[0]) == 4


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_cuda_serving_after_warmup_compiles_nothing(setup_small):
    # Natively: Triton's in-memory binary caches of every kernel hold the same entries before
    # and after a served mixed batch (warm-up in __init__ compiled all of them).
    from tests.kernels.compile_keys import all_kernels

    def num_binaries() -> int:
        return sum(len(cache[0]) for k in all_kernels() for cache in k.device_caches.values())

    model, adapters, names, prompts, max_tokens, expected = setup_small
    engine = Engine(EngineConfig(model=str(model), device="cuda", num_pages=400,
                                 kernels="triton",
                                 scheduler=SchedulerConfig(page_size=4,
                                                           max_num_batched_tokens=16)),
                    adapter_source=LoadedSource(adapters.values()))
    before = num_binaries()
    assert before > 0
    got = run(engine, prompts, digests_for(adapters, names), max_tokens, [0, 0, 1, 2])
    assert got == expected
    assert num_binaries() == before
