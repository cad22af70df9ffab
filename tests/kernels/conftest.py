"""Kernel tests run natively on a GPU and under the Triton interpreter on CPU.

The interpreter is chosen when Triton decorates a kernel, that is when a kernel module is
imported, so the variable is set here, before any test module imports one.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

KERNEL_MODULES = ("loraplex.kernels.sgmv", "loraplex.kernels.paged_attention")

if not torch.cuda.is_available():
    if os.environ.get("TRITON_INTERPRET") != "1" and any(m in sys.modules for m in KERNEL_MODULES):
        raise pytest.UsageError("a Triton kernel module was imported before TRITON_INTERPRET=1 "
                                "was set; set it in the environment or in tests/conftest.py")
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def cpu_amx(monkeypatch, request):
    """The CPU as having AMX tiles or not (``request.param``), for ``kernels.cpu``'s cached
    answer (the routing of bf16 prefill attention)."""
    from loraplex.kernels import cpu

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: request.param,
                        raising=False)
    cpu._amx.cache_clear()
    yield request.param
    cpu._amx.cache_clear()  # the real CPU's answer for later tests
