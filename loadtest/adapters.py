"""Random LoRA adapters for load tests: written as PEFT directories, uploaded over gRPC.

A trace names adapters ``lt-0000``, ``lt-0001``, ... (``trace.adapter_name``); these helpers
make one small random adapter per name for the serving model, so that every system under test
(the gateway, the in-process engine, transformers + peft) loads the same weights. Writing the
safetensors directly is much faster than building a peft model per adapter, which matters at
2048 adapters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from loraplex.adapter_store.format import peft_key
from loraplex.server.client import AsyncClient, ServiceError
from loraplex.server.engine.models.config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_TARGETS = ("q_proj", "v_proj")


def write_random_adapter(path: str | os.PathLike[str], config: ModelConfig, *, rank: int = 8,
                         alpha: float = 16.0, targets: Iterable[str] = DEFAULT_TARGETS,
                         seed: int = 0, std: float = 0.02) -> Path:
    """Write a PEFT LoRA adapter directory (``adapter_config.json`` and
    ``adapter_model.safetensors``, float32) with random A and B for every layer and target."""
    path = Path(path)
    targets = list(targets)
    shapes = config.module_shapes()
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            d_in, d_out = shapes[module]
            tensors[peft_key(layer, module, "A")] = torch.randn(rank, d_in, generator=gen) * std
            tensors[peft_key(layer, module, "B")] = torch.randn(d_out, rank, generator=gen) * std
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets,
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
        "use_rslora": False}, indent=2))
    os.replace(tmp, path)
    return path


def ensure_adapter_dirs(root: str | os.PathLike[str], names: Iterable[str],
                        config: ModelConfig, *, rank: int = 8,
                        targets: Iterable[str] = DEFAULT_TARGETS, seed: int = 0,
                        progress: bool = False) -> dict[str, Path]:
    """``root/<name>`` for every name, writing the ones that do not exist yet. An adapter's
    weights depend only on its name and ``seed``, so every system sees the same ones."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    targets = tuple(targets)
    paths = {}
    for name in tqdm(sorted(set(names)), desc="adapters", unit="adapter", disable=not progress,
                     leave=False):
        path = root / name
        if not (path / "adapter_model.safetensors").exists():
            digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
            write_random_adapter(path, config, rank=rank, targets=targets,
                                 seed=int.from_bytes(digest[:8], "little") >> 1)
        paths[name] = path
    return paths


async def upload_missing(clients: Mapping[str, AsyncClient], default: AsyncClient,
                         needed: Mapping[str, Iterable[str]], adapter_dirs: Mapping[str, Path],
                         progress: bool = False) -> int:
    """Upload each tenant's adapters that its namespace lacks, through that tenant's client.

    Args:
        clients: tenant -> client with that tenant's key; other tenants use ``default``.
        needed: tenant -> adapter names its requests use (``Trace.adapters_by_tenant``).
        adapter_dirs: name -> PEFT directory to upload.

    Returns:
        how many adapters were uploaded.

    Raises:
        ServiceError: an upload or a listing was refused.
    """
    todo: list[tuple[AsyncClient, str]] = []
    for tenant, names in needed.items():
        client = clients.get(tenant, default)
        try:
            have = {v.name for v in await client.list_adapters()}
        except ServiceError:
            logger.error("could not list the adapters of tenant %s", tenant)
            raise
        todo.extend((client, n) for n in sorted(set(names)) if n not in have)
    for client, name in tqdm(todo, desc="upload", unit="adapter", disable=not progress,
                             leave=False):
        await client.upload_adapter(adapter_dirs[name], name)
    return len(todo)
