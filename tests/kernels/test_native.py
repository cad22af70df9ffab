"""The native CPU kernels' build and load path (loraplex/kernels/native.py): real compiler, real
files."""

from __future__ import annotations

import ctypes
import logging
import time

import pytest
import torch

from loraplex.kernels import native


@pytest.fixture()
def fresh(monkeypatch, tmp_path):
    """A process-fresh loader with its own build cache."""
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", {})
    return tmp_path


def test_builds_loads_and_runs(fresh):
    if native._compiler() is None:
        pytest.skip("no C compiler on this machine")
    lib = native.library("selftest")
    assert lib is not None  # a compiler that cannot build the simplest kernel is a failure
    assert lib.loraplex_native_abi() == 1
    a, b = torch.arange(7, dtype=torch.float32), torch.full((7,), 0.5)
    out = torch.empty(7)
    lib.loraplex_add_f32(ctypes.c_void_p(a.data_ptr()), ctypes.c_void_p(b.data_ptr()),
                         ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(7))
    assert torch.equal(out, a + b)
    built = list((fresh / "cache" / "native").glob("selftest-*.so"))
    assert len(built) == 1 and not list((fresh / "cache" / "native").glob("*.tmp"))
    assert native.library("selftest") is lib  # loaded once per process


def test_every_engine_kernel_builds_where_a_compiler_exists(fresh):
    # the engine's kernels fall back to torch silently when a build fails: CI must not
    if native._compiler() is None:
        pytest.skip("no C compiler on this machine")
    assert native.build_engine_kernels() == {name: True for name in native.ENGINE_KERNELS}
    assert {p.name.split("-")[0] for p in (fresh / "cache" / "native").glob("*.so")} == set(
        native.ENGINE_KERNELS)


def test_a_cpu_engine_builds_its_kernels_before_any_request(fresh, tmp_path):
    # the first request must not wait for the compiler: the model runner builds them at start
    if native._compiler() is None:
        pytest.skip("no C compiler on this machine")
    from loraplex.server.config import EngineConfig
    from loraplex.server.engine.engine import Engine
    from tests.helpers import make_model

    model = make_model(tmp_path / "m", "llama", seed=1)
    Engine(EngineConfig(model=str(model), num_pages=16))
    assert set(native._loaded) == set(native.ENGINE_KERNELS)
    assert all(native._loaded.values())


def test_disabled_by_environment(fresh, monkeypatch):
    monkeypatch.setenv("LORAPLEX_NATIVE_KERNELS", "0")
    assert native.library("selftest") is None
    assert not (fresh / "cache" / "native").exists()


def test_no_compiler_falls_back(fresh, monkeypatch, caplog):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(fresh))  # an empty directory: no cc, gcc or clang
    with caplog.at_level(logging.WARNING, logger="loraplex.kernels.native"):
        assert native.library("selftest") is None
    assert "no C compiler" in caplog.text


def test_build_failure_falls_back_and_names_it(fresh, monkeypatch, caplog):
    if native._compiler() is None:
        pytest.skip("no C compiler on this machine")
    src = fresh / "csrc"
    src.mkdir()
    (src / "broken.c").write_text("int f(void) { return undeclared_name; }\n")
    monkeypatch.setattr(native, "_SOURCES", src)
    with caplog.at_level(logging.WARNING, logger="loraplex.kernels.native"):
        assert native.library("broken") is None
    assert "broken" in caplog.text and "undeclared_name" in caplog.text
    assert not list((fresh / "cache" / "native").glob("*"))  # nothing half-written left


def test_a_stuck_compiler_is_killed_with_its_children(fresh, monkeypatch, caplog):
    # gcc's driver runs cc1 as a child: a timeout that kills only the driver leaves cc1 running
    child_pid = fresh / "child.pid"
    cc = fresh / "stuck-cc"
    cc.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {child_pid}\nwait\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(native, "BUILD_TIMEOUT_S", 1.0)
    with caplog.at_level(logging.WARNING, logger="loraplex.kernels.native"):
        assert native.library("selftest") is None
    assert "ran past 1 s" in caplog.text
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the compiler's child outlived the timeout"
    assert not list((fresh / "cache" / "native").glob("*"))


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie is dead, only not yet reaped by its (killed) parent
