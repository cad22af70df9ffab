from __future__ import annotations

import pytest

from loraplex.adapter_store.format import load_adapter
from loraplex.server.engine.models.config import ModelConfig
from tests.helpers import (
    ADAPTER_SPECS,
    make_model,
    make_peft_adapters,
    peft_greedy,
    random_prompts,
)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=11)


@pytest.fixture(scope="session")
def setup_small(tmp_path_factory):
    """Three adapters (ranks 1, 4, 16; different targets) and a base request, few tokens."""
    root = tmp_path_factory.mktemp("lora-small")
    model = make_model(root / "model", "llama", seed=21)
    specs = [ADAPTER_SPECS[0], ADAPTER_SPECS[1], ADAPTER_SPECS[6]]
    paths = make_peft_adapters(model, root / "adapters", specs=specs)
    config = ModelConfig.from_pretrained(model)
    adapters = {name: load_adapter(p, config) for name, p in paths.items()}
    names = list(paths) + [None]
    prompts = random_prompts(len(names), seed=32, low=5, high=9)
    max_tokens = [3, 4, 3, 4]
    expected = peft_greedy(model, paths, prompts, names, max_tokens)
    return model, adapters, names, prompts, max_tokens, expected
