"""End-to-end fixtures: a tiny random Llama with a long context (so streams can be made to
last) and adapters for it, built once per session; no downloads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.server.commands import write_demo_adapter
from tests.helpers import make_model


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setenv("LORAPLEX_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    mp.setenv("LORAPLEX_DATA_DIR", str(tmp_path_factory.mktemp("data")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "llama", "llama", seed=3,
                      max_position_embeddings=2048)


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict[str, Path]:
    """Three PEFT adapters for the tiny model (rank 4, 8 and 16; different targets)."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {"alpha": (4, ("q_proj", "v_proj")), "beta": (8, ("q_proj", "k_proj", "o_proj")),
             "gamma": (16, ("gate_proj", "up_proj", "down_proj"))}
    return {name: write_demo_adapter(root / name, str(model_dir), rank, targets, seed=i,
                                     std=0.2)
            for i, (name, (rank, targets)) in enumerate(specs.items())}
