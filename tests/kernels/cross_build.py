"""A native kernel compiled for another CPU (``-march=<name>`` in place of ``native``), for the
tests that read what the compiler made of a kernel on machines they do not run on (AVX2 and
AVX-512 code from any x86 host)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from loraplex.kernels import native


def source(name: str) -> Path:
    """``csrc/<name>.c``, where ``native`` builds it from."""
    return native._SOURCES / f"{name}.c"


def cross_build(cc: str, name: str, march: str, out: Path, *extra: str,
                assembly: bool = False, no_warnings: bool = True) -> str:
    """Builds ``csrc/<name>.c`` into ``out`` with the engine's flags for ``-march=march``: a
    shared library, or with ``assembly`` the ``-S`` output. Skips the test when the compiler
    does not know ``march``; fails on any other error, and on a warning unless
    ``no_warnings`` is off. Returns the compiler's messages."""
    flags = [f"-march={march}" if f == "-march=native" else f for f in native._FLAGS
             if not (assembly and f == "-shared")]
    tail = ["-S"] if assembly else ["-lm"]
    proc = subprocess.run([cc, *flags, *extra, str(source(name)), "-o", str(out), *tail],
                          capture_output=True, text=True)
    if proc.returncode != 0 and "march" in proc.stderr:
        pytest.skip(f"{cc} does not know -march={march}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    if no_warnings:
        assert "warning" not in proc.stderr, proc.stderr[-2000:]
    return proc.stderr
