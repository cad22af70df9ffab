"""Every ``LORAPLEX_*`` environment variable, read in this one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``LORAPLEX_CACHE_DIR``: where the demo model and other built artefacts live."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "loraplex"
    return Path(os.environ.get("LORAPLEX_CACHE_DIR", default))


def data_dir() -> Path:
    """``LORAPLEX_DATA_DIR``: the default on-disk adapter store and server state."""
    return Path(os.environ.get("LORAPLEX_DATA_DIR", cache_dir() / "data"))


def native_kernels() -> bool:
    """``LORAPLEX_NATIVE_KERNELS``: ``0`` turns the compiled C CPU kernels off (torch ops only)."""
    return os.environ.get("LORAPLEX_NATIVE_KERNELS", "1").strip().lower() not in (
        "0", "false", "no", "off")


def amx_gemm() -> bool:
    """``LORAPLEX_AMX_GEMM``: ``0`` keeps float32 projections on oneDNN's GEMM instead of the
    AMX tile GEMM (``loraplex/kernels/cpu_gemm``)."""
    return os.environ.get("LORAPLEX_AMX_GEMM", "1").strip().lower() not in (
        "0", "false", "no", "off")


def fma_gemm() -> str:
    """``LORAPLEX_FMA_GEMM``: ``auto`` (the default) runs float32 projections on the FMA GEMM
    (``loraplex/kernels/cpu_gemm``) on CPUs without AMX where it was measured faster than oneDNN
    (x86 with AVX2 and FMA but not AVX-512); ``1`` on any CPU without AMX; ``0`` never."""
    value = os.environ.get("LORAPLEX_FMA_GEMM", "auto").strip().lower()
    if value in ("0", "false", "no", "off"):
        return "off"
    if value in ("1", "true", "yes", "on"):
        return "on"
    return "auto"


def bf16_gemm() -> bool:
    """``LORAPLEX_BF16_GEMM``: ``0`` keeps bf16 projections on oneDNN's GEMM instead of the pair
    dot product GEMM (``loraplex/kernels/cpu_gemm``; CPUs with AVX512-BF16 and no AMX)."""
    return os.environ.get("LORAPLEX_BF16_GEMM", "1").strip().lower() not in (
        "0", "false", "no", "off")


def get(name: str, default: str | None = None) -> str | None:
    """``LORAPLEX_<NAME>`` or ``default``: the environment half of a CLI flag."""
    return os.environ.get(f"LORAPLEX_{name.upper()}", default)
