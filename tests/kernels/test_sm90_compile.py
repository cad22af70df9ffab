"""The kernels build for sm_90 (H100/H200) at serving sizes, with the exact block sizes the
launchers pick there: no register spills, 16-byte loads where rows are aligned, shared memory
within a block's limit. Runs on CPU: Triton compiles for a target without a device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[2]
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SM90_SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may take on sm_90


def _compile(*flags: str) -> list[dict]:
    if not (NVIDIA_BIN / "ptxas").exists() or not (NVIDIA_BIN / "cuobjdump").exists():
        pytest.skip("this Triton has no bundled ptxas / cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile", *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    return _compile()


def test_every_kernel_builds_for_sm90(compiled: list[dict]) -> None:
    kernels = {r["kernel"] for r in compiled}
    assert kernels == {"_shrink_bgmv_kernel", "_shrink_sgmv_kernel", "_expand_bgmv_kernel",
                       "_expand_sgmv_kernel", "_decode_kernel", "_merge_splits_kernel",
                       "_prefill_kernel", "_write_kv_kernel"}
    for r in compiled:
        assert r["spill_bytes"] == 0, r
        assert r["shared_bytes"] <= SM90_SHARED_LIMIT, r


def test_gathers_are_vectorized(compiled: list[dict]) -> None:
    for r in compiled:
        if r["constexprs"].get("ROW_ALIGN", 16) >= 8 and r["kernel"] != "_merge_splits_kernel":
            assert r["vector_loads"] > 0, r  # weight rows / K and V rows in 16-byte loads
        if r["kernel"] in ("_decode_kernel", "_prefill_kernel", "_shrink_sgmv_kernel"):
            if r["constexprs"].get("ROW_ALIGN", 16) >= 8:
                assert r["scalar_16bit_loads"] == 0, r


@pytest.mark.timeout(900)
def test_every_warmed_up_variant_builds_for_sm90_without_spills() -> None:
    # every variant a 7B Llama worker (bf16, max_rank 64) compiles at start; the expand bgmv
    # 64 x 32 tile spilled with 2 warps before it got a warp per 16 ranks
    compiled = _compile("--variants")
    assert len(compiled) >= 60
    assert {r["kernel"] for r in compiled} == {
        "_shrink_bgmv_kernel", "_shrink_sgmv_kernel", "_expand_bgmv_kernel",
        "_expand_sgmv_kernel", "_decode_kernel", "_merge_splits_kernel", "_prefill_kernel"}
    for r in compiled:
        assert r["spill_bytes"] == 0, r
        assert r["shared_bytes"] <= SM90_SHARED_LIMIT, r
