"""Fixtures for the adapter store tests: a tiny base model, adapter factories, real Redis.

Redis tests start a real ``redis-server`` on a free port in a temporary directory and stop it
by pid. They are skipped (with the reason) only where the binary is missing; CI installs it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch

from loraplex.adapter_store.fs_store import FsAdapterStore
from loraplex.adapter_store.redis_store import RedisAdapterStore
from loraplex.adapter_store.store import AdapterStore
from loraplex.server.engine.models.config import LORA_MODULES, ModelConfig
from tests.redis_server import RedisServer

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
}
GROUPS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@pytest.fixture(scope="session")
def base_config() -> ModelConfig:
    return ModelConfig.from_hf_dict(TINY_LLAMA)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the tiny Llama's config.json (for ``--model PATH``)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


def lora_config(**overrides: object) -> dict[str, object]:
    """An adapter_config.json as PEFT 0.21 writes it."""
    cfg: dict[str, object] = {
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_rslora": False,
        "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM", "bias": "none",
        "lora_dropout": 0.0, "use_dora": False, "modules_to_save": None, "rank_pattern": {},
        "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None,
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
        "base_model_name_or_path": None, "revision": None, "peft_version": "0.21.2",
    }
    cfg.update(overrides)
    return cfg


def lora_tensors(base: ModelConfig, *, rank: int = 4, targets: Sequence[str] = ("q_proj",
                 "v_proj"), dtype: torch.dtype = torch.float32, seed: int = 0,
                 layers: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """PEFT-named random LoRA tensors for ``base``."""
    gen = torch.Generator().manual_seed(seed)
    shapes = base.module_shapes()
    out = {}
    for layer in (range(base.num_layers) if layers is None else layers):
        for module in targets:
            d_in, d_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{GROUPS[module]}.{module}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen).to(dtype)
            out[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen).to(dtype)
    return out


def write_adapter(path: Path, tensors: dict[str, torch.Tensor] | None,
                  config: dict[str, object] | None, *, readme: bool = True) -> Path:
    """Write an adapter directory by hand (``None`` leaves a file out)."""
    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / "adapter_config.json").write_text(json.dumps(config))
    if tensors is not None:
        safetensors.torch.save_file(tensors, str(path / "adapter_model.safetensors"),
                                    metadata={"format": "pt"})
    if readme:
        (path / "README.md").write_text("# a LoRA adapter\n")
    return path


@pytest.fixture
def make_adapter(tmp_path: Path, base_config: ModelConfig) -> Callable[..., Path]:
    """``make_adapter(name, rank=, targets=, dtype=, seed=, **config_overrides) -> dir``."""
    def make(name: str = "adapter", *, rank: int = 4,
             targets: Sequence[str] = ("q_proj", "v_proj"), dtype: torch.dtype = torch.float32,
             seed: int = 0, **config: object) -> Path:
        tensors = lora_tensors(base_config, rank=rank, targets=targets, dtype=dtype, seed=seed)
        cfg = lora_config(r=rank, target_modules=list(targets), **config)
        return write_adapter(tmp_path / name, tensors, cfg)
    return make


# ---------------------------------------------------------------------------- redis-server


@pytest.fixture
def redis_factory(redis_binary: str, tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start dedicated servers (``factory(*args, password=, tls=)``); all stopped after."""
    servers: list[RedisServer] = []

    def start(*args: str, password: str | None = None,
              tls: dict[str, str] | None = None) -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(servers)}", *args, password=password,
                             tls=tls)
        servers.append(server)
        return server.start()
    yield start
    for server in servers:
        server.stop()


@pytest.fixture(params=["fs", "redis"])
def store_factory(request: pytest.FixtureRequest, tmp_path: Path, base_config: ModelConfig
                  ) -> Iterator[Callable[..., AdapterStore]]:
    """``factory(base_config=...)`` opens the parametrised backend (fs dir or flushed redis)."""
    opened: list[AdapterStore] = []
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None

    def open_(base: ModelConfig | None = base_config, **kwargs: object) -> AdapterStore:
        store: AdapterStore
        if url is None:
            store = FsAdapterStore(tmp_path / "store", base)
        else:
            store = RedisAdapterStore.from_url(url, base, **kwargs)
        opened.append(store)
        return store
    yield open_
    for store in opened:
        store.close()


@pytest.fixture
def store(store_factory: Callable[..., AdapterStore]) -> AdapterStore:
    return store_factory()


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    """The plain helpers above, for tests to call (conftest modules are not imported)."""
    return SimpleNamespace(lora_config=lora_config, lora_tensors=lora_tensors,
                           write_adapter=write_adapter, groups=GROUPS, modules=LORA_MODULES,
                           tiny_llama=TINY_LLAMA)
