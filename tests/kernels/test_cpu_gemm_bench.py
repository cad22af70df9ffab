"""benchmarks/cpu_gemm_bench.py on one small shape: each dtype's table, JSON and agreement check
(the native GEMM against oneDNN's on the same weights), and its refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import cpu_gemm_bench as bench  # noqa: E402

from loraplex.kernels import cpu_gemm  # noqa: E402
from loraplex.server.engine.models.llama import onednn_linear_supported  # noqa: E402


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "gemm.json"
    bench.main(["--model", "smollm2", "--shapes", "o", "--rows", "1", "17", "--layers", "2",
                "--repeats", "1", "--out", str(out), *extra])
    return json.loads(out.read_text())


@pytest.mark.skipif(not onednn_linear_supported(torch.float32, torch.device("cpu")),
                    reason="needs oneDNN's prepacked float32 GEMM")
def test_float32_table_and_agreement(tmp_path: Path) -> None:
    report = _run(tmp_path, "--kind", "fma")
    assert report["dtype"] == "float32" and report["kind"] == "fma"
    assert [(r["shape"], r["rows"]) for r in report["results"]] == [("o", 1), ("o", 17)]
    for row in report["results"]:
        assert row["max_rel"] < 1e-5, row  # float32: summation order only
        assert row["native_gflops"] > 0 and row["ms"]["onednn"] > 0


@pytest.mark.skipif(not cpu_gemm.bf16_available()
                    or not onednn_linear_supported(torch.bfloat16, torch.device("cpu")),
                    reason="needs AVX512-BF16 and oneDNN's prepacked bf16 GEMM")
def test_bfloat16_table_and_agreement(tmp_path: Path) -> None:
    report = _run(tmp_path, "--dtype", "bfloat16")
    assert report["dtype"] == "bfloat16" and report["kind"] == "bf16"
    for row in report["results"]:
        assert row["max_rel"] < 2e-2, row  # within a bf16 rounding or two of oneDNN's


def test_unknown_shape_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="none of"):
        bench.main(["--shapes", "nope", "--kind", "fma", "--out", str(tmp_path / "x.json")])
