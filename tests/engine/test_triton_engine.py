"""The engine end to end with --kernels triton (the Triton interpreter on CPU): mixed
adapters and the base model in one batch, token-identical to peft."""

from __future__ import annotations

import pytest
import torch

from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from tests.engine.test_lora_parity import LoadedSource, digests_for, run


@pytest.mark.timeout(900)
def test_triton_kernels_match_peft(setup_small):
    model, adapters, names, prompts, max_tokens, expected = setup_small
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU
    engine = Engine(EngineConfig(model=str(model), num_pages=400, kernels="triton", device=device,
                                 scheduler=SchedulerConfig(page_size=4,
                                                           max_num_batched_tokens=64)),
                    adapter_source=LoadedSource(adapters.values()))
    assert engine.kernels == "triton"
    got = run(engine, prompts, digests_for(adapters, names), max_tokens, [0, 0, 1, 2])
    assert got == expected
