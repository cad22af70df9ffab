"""Every ``LORAPLEX_*`` environment variable, read in this one place."""

from __future__ import annotations

import os
from pathlib import Path

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def _switch(name: str, default: str = "1") -> str:
    """``LORAPLEX_<name>``, stripped and lower-cased (``default`` where unset)."""
    return os.environ.get(f"LORAPLEX_{name}", default).strip().lower()


def _tri_state(name: str) -> str:
    """``LORAPLEX_<name>`` as ``off``, ``on`` or ``auto`` (unset or anything else)."""
    value = _switch(name, "auto")
    if value in _OFF:
        return "off"
    if value in _ON:
        return "on"
    return "auto"


def cache_dir() -> Path:
    """``LORAPLEX_CACHE_DIR``: where the demo model and other built artefacts live."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "loraplex"
    return Path(os.environ.get("LORAPLEX_CACHE_DIR", default))


def data_dir() -> Path:
    """``LORAPLEX_DATA_DIR``: the default on-disk adapter store and server state."""
    return Path(os.environ.get("LORAPLEX_DATA_DIR", cache_dir() / "data"))


def native_kernels() -> bool:
    """``LORAPLEX_NATIVE_KERNELS``: ``0`` turns the compiled C CPU kernels off (torch ops only)."""
    return _switch("NATIVE_KERNELS") not in _OFF


def amx_gemm() -> bool:
    """``LORAPLEX_AMX_GEMM``: ``0`` keeps float32 projections on oneDNN's GEMM instead of the
    AMX tile GEMM (``loraplex/kernels/cpu_gemm``)."""
    return _switch("AMX_GEMM") not in _OFF


def amx_lora() -> bool:
    """``LORAPLEX_AMX_LORA``: ``0`` keeps a bf16 prefill's LoRA on AVX512-BF16's pair dot
    products instead of AMX tiles (``loraplex/kernels/cpu_lora_native``)."""
    return _switch("AMX_LORA") not in _OFF


def fma_gemm() -> str:
    """``LORAPLEX_FMA_GEMM``: ``auto`` (the default) runs float32 projections on the FMA GEMM
    (``loraplex/kernels/cpu_gemm``) on CPUs without AMX where it was measured faster than oneDNN
    (x86 with AVX2 and FMA but not AVX-512); ``1`` on any CPU without AMX; ``0`` never."""
    return _tri_state("FMA_GEMM")


def lora_stream() -> str:
    """``LORAPLEX_LORA_STREAM``: ``auto`` (the default) runs a decode step's short LoRA
    segments (1-3 rows, float32 or bf16) in memory order behind one prefetch stream
    (``loraplex/kernels/csrc/lora.c``) on CPUs where that was measured faster (AMD's family
    0x1A, Zen 5); ``1`` on any CPU (bf16 where the build has AVX512-BF16); ``0`` never."""
    return _tri_state("LORA_STREAM")


def bf16_gemm() -> bool:
    """``LORAPLEX_BF16_GEMM``: ``0`` keeps bf16 projections on oneDNN's GEMM instead of the pair
    dot product GEMM (``loraplex/kernels/cpu_gemm``; CPUs with AVX512-BF16 and no AMX)."""
    return _switch("BF16_GEMM") not in _OFF


def bf16_decode_tiles() -> bool:
    """``LORAPLEX_BF16_DECODE_TILES``: ``0`` keeps one copy of a bf16 model's projections: on a
    CPU with AMX oneDNN's (decode steps too, instead of the tile GEMM), on one with AVX512-BF16
    and no AMX the pair GEMM's (prefill chunks too, instead of oneDNN's GEMM)
    (``loraplex/kernels/cpu_gemm``)."""
    return _switch("BF16_DECODE_TILES") not in _OFF


def huge_pages() -> bool:
    """``LORAPLEX_HUGE_PAGES``: ``0`` keeps the CPU engine's packed weights and page pools on
    ordinary pages (``loraplex/kernels/huge_pages``) instead of transparent huge pages."""
    return _switch("HUGE_PAGES") not in _OFF


def malloc_tune() -> bool:
    """``LORAPLEX_MALLOC_TUNE``: ``0`` leaves glibc's mmap and trim thresholds as they are in a
    CPU engine's process (``server/engine/cpu_memory``)."""
    return _switch("MALLOC_TUNE") not in _OFF


def gc_freeze() -> bool:
    """``LORAPLEX_GC_FREEZE``: ``0`` keeps the engine from freezing the objects alive at its start
    out of the garbage collector's passes (``server/engine/gc_freeze``)."""
    return _switch("GC_FREEZE") not in _OFF


def get(name: str, default: str | None = None) -> str | None:
    """``LORAPLEX_<NAME>`` or ``default``: the environment half of a CLI flag."""
    return os.environ.get(f"LORAPLEX_{name.upper()}", default)
