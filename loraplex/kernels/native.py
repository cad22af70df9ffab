"""Native CPU kernels: C sources in ``loraplex/kernels/csrc/``, compiled on first use with the
system's C compiler and loaded through ``ctypes``.

Why C and not torch ops: on a CPU the engine's non-GEMM work (decode attention over paged KV,
LoRA's many tiny products, the elementwise glue) is a sequence of small torch calls, each a
separate pass over memory with a fixed dispatch cost; one C loop reads each byte once. vLLM's
CPU build does the same with its ``_C`` extension.

Why ``ctypes`` and not a torch C++ extension: a plain C file with no torch headers compiles in
well under a second, needs no build step at install time, and has no ABI tie to the torch
version (``torch>=2.4``); tensors cross as ``data_ptr()`` and explicit sizes and strides.

The contract: ``library(name)`` returns the loaded library, or ``None`` when native kernels
are off (``LORAPLEX_NATIVE_KERNELS=0``), there is no compiler, or the build fails (logged once).
Every caller keeps its torch path for ``None``, so a machine without ``cc`` serves the same
tokens, only slower. Builds are cached under ``<cache dir>/native/`` keyed by the source, the
flags and the machine (``-march=native``), and renamed into place so concurrent processes
never load a half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

from loraplex.server import env

logger = logging.getLogger(__name__)

__all__ = ["ENGINE_KERNELS", "available", "build_engine_kernels", "library"]

_SOURCES = Path(__file__).with_name("csrc")
# the kernels the CPU engine calls: built when a CPU model runner starts, not on a request
ENGINE_KERNELS = ("decode_attention", "elementwise", "gemm_amx", "gemm_bf16", "gemm_fma", "lora",
                  "prefill_attention")
_FLAGS = ("-O3", "-march=native", "-std=c11", "-fPIC", "-shared", "-fopenmp",
          "-fno-math-errno", "-Wall")
# a compiler past this is stuck (every kernel builds in seconds): killed, with its children
BUILD_TIMEOUT_S = 120.0
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _machine_key() -> str:
    # -march=native ties a build to the CPU's features: key it by them (flags line of cpuinfo)
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def _build(name: str, compiler: str) -> Path:
    source = _SOURCES / f"{name}.c"
    # every header of csrc/ is part of the key: a source may include any of them
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(_SOURCES.glob("*.h")))
    key = hashlib.sha256(text + repr((compiler, _FLAGS, _machine_key())).encode()).hexdigest()
    out_dir = env.cache_dir() / "native"
    target = out_dir / f"{name}-{key[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        _compile([compiler, *_FLAGS, str(source), "-o", tmp, "-lm"])
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _compile(argv: list[str]) -> None:
    """Run the compiler in its own process group: at the timeout the whole group is killed
    (the driver's children too: killing only ``cc`` leaves ``cc1`` burning a core)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"the compiler ran past {BUILD_TIMEOUT_S:g} s (killed)") from None
    if proc.returncode != 0:
        raise RuntimeError(stderr.strip()[-2000:] or f"exit {proc.returncode}")


def library(name: str) -> ctypes.CDLL | None:
    """The compiled ``csrc/<name>.c``, or ``None`` when native kernels are unavailable.

    Args:
        name: a source file's stem under ``loraplex/kernels/csrc/``.

    Returns:
        The loaded library (built on the first call in any process on this machine), or
        ``None``: native kernels disabled, no C compiler, or the build failed (a warning
        names the reason, once per process).
    """
    try:  # the hot path (every kernel call): a dict read, no lock
        return _loaded[name]
    except KeyError:
        pass
    with _lock:
        if name in _loaded:
            return _loaded[name]
        lib: ctypes.CDLL | None = None
        if not env.native_kernels():
            logger.info("native CPU kernels off (LORAPLEX_NATIVE_KERNELS=0)")
        elif (compiler := _compiler()) is None:
            logger.warning("no C compiler (cc, gcc, clang or $CC): native CPU kernels off, "
                           "using the torch ops (same results, slower)")
        else:
            try:
                lib = ctypes.CDLL(str(_build(name, compiler)))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                logger.warning("building native CPU kernel %s failed, using the torch ops: %s",
                               name, exc)
        _loaded[name] = lib
        return lib


def probe_once(lib: ctypes.CDLL, fn_name: str, what: str) -> bool:
    """``lib.fn_name()`` (a C function of no arguments returning nonzero for yes) called once per
    loaded library and its answer kept on it: the kernels' CPU checks, which on AMX also ask the
    kernel for the tile data permission. The first answer is logged as ``what`` on or not."""
    cache = lib.__dict__.setdefault("_loraplex_probes", {})
    if fn_name not in cache:
        fn = getattr(lib, fn_name)
        fn.argtypes, fn.restype = [], ctypes.c_int  # 0 or 1 (int or int64_t in C)
        cache[fn_name] = bool(fn())
        logger.info("%s %s", what, "on" if cache[fn_name] else "unavailable on this CPU")
    return bool(cache[fn_name])


def available(name: str) -> bool:
    """Whether ``library(name)`` loads (building it if needed)."""
    return library(name) is not None


def build_engine_kernels() -> dict[str, bool]:
    """Build (or load from the cache) every kernel the CPU engine calls, so that the first
    request does not wait for a compiler: called when a CPU model runner starts.

    Returns:
        Each of ``ENGINE_KERNELS`` and whether it loaded (``False``: its torch path serves).
    """
    return {name: available(name) for name in ENGINE_KERNELS}
