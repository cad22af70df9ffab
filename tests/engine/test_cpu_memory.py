"""What start-up does for a step's memory: glibc's mmap and trim thresholds fixed for a CPU engine
(``server/engine/cpu_memory.py``: a step's freed buffers are reused without faulting their pages
in again), and the objects alive once the engine is built frozen out of Python's collections."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from loraplex.server.config import EngineConfig
from loraplex.server.engine import cpu_memory
from loraplex.server.engine.engine import Engine

# A fresh process (a clean allocator): malloc, touch and free a 24 MB buffer four times; the
# minor page faults of each round.
_ROUNDS = """
import ctypes, json, resource
from loraplex.server.engine import cpu_memory
tuned = cpu_memory.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n, faults = 24 << 20, []
for _ in range(4):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"tuned": tuned, "faults": faults}))
"""


def _rounds(tune: str) -> dict:
    env = {**os.environ, "LORAPLEX_MALLOC_TUNE": tune}
    out = subprocess.run([sys.executable, "-c", _ROUNDS], env=env, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.confstr(
    "CS_GNU_LIBC_VERSION").startswith("glibc"), reason="glibc's allocator only")
def test_freed_buffers_come_back_without_faults() -> None:
    pages = (24 << 20) // 4096
    untuned = _rounds("0")
    # as glibc leaves it: the first free only raises the mmap threshold, so the second buffer
    # comes from fresh heap pages (this is what the engine's steps paid, buffer after buffer)
    assert untuned["tuned"] is False and untuned["faults"][1] > pages // 2
    tuned = _rounds("1")
    assert tuned["tuned"] is True
    assert max(tuned["faults"][1:]) < 100  # the same heap pages, already mapped


def test_a_cpu_engine_sets_it(tiny_llama, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(cpu_memory, "keep_freed_memory", lambda: calls.append(1) or True)
    engine = Engine(EngineConfig(model=str(tiny_llama), num_pages=16))
    try:
        assert calls
    finally:
        engine.close()


@pytest.mark.parametrize("freeze", ["1", "0"])
def test_the_engine_freezes_what_start_up_made_until_closed(tiny_llama, monkeypatch,
                                                            freeze: str) -> None:
    # Full collections skip the objects alive once the engine is built (the loader's, the
    # tokenizer's, torch's): the engine's steps never pay a walk over them.
    import gc

    monkeypatch.setenv("LORAPLEX_GC_FREEZE", freeze)
    gc.unfreeze()
    engine = Engine(EngineConfig(model=str(tiny_llama), num_pages=16))
    try:
        frozen = gc.get_freeze_count()
        if freeze == "1":
            assert frozen > 1000  # the process's objects, the engine's included
        else:
            assert frozen == 0
    finally:
        engine.close()
    assert gc.get_freeze_count() == 0


def test_an_engine_left_open_at_exit_leaks_nothing(tiny_llama) -> None:
    # The interpreter's last collection skips frozen objects; the engine unfreezes them at
    # exit, so extensions' leak checks (nanobind's, in Triton's bindings) stay quiet.
    code = ("import sys, triton\n"
            "from loraplex.server.config import EngineConfig\n"
            "from loraplex.server.engine.engine import Engine\n"
            "engine = Engine(EngineConfig(model=sys.argv[1], num_pages=16))\n"
            "import gc; assert gc.get_freeze_count() > 0\n")
    pytest.importorskip("triton")
    env = {**os.environ, "LORAPLEX_GC_FREEZE": "1"}
    run = subprocess.run([sys.executable, "-c", code, str(tiny_llama)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "leaked" not in run.stderr
