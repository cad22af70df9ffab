"""The GPU benchmark script (benchmarks/kernel_bench.py): it refuses cleanly without CUDA, and
its set-up, baselines, engine rounds and report run end to end on tiny sizes on CPU (kernels
under the interpreter, timing stubbed or meaningless), so the one H200 run is not spent on a
shape bug."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import kernel_bench as bench  # noqa: E402
import kernel_bench_engine as bench_engine  # noqa: E402
import kernel_bench_report as bench_report  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_without_cuda(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--out", str(tmp_path / "out")]) == 2
    assert bench.main(["--out", str(tmp_path / "out"), "--quick", "--no-engine"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("the GPU runs the real benchmark")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "DTYPE", torch.float16)
    monkeypatch.setattr(bench, "_bench", lambda fn, graph=True: (fn(), 1.0)[1])


@pytest.mark.usefixtures("on_cpu")
def test_sgmv_cases_run_and_check_themselves() -> None:
    gen = torch.Generator().manual_seed(0)
    setup = bench._lora_setup(48, [8, 16, 8], gen)
    rows = bench._bench_lora(setup, 48, 5, dict(phase="decode", d=48, rank="mixed", tokens=5,
                                                adapters=3))
    assert [r.bench for r in rows] == ["shrink", "expand"]
    for row in rows:
        assert row.error is None, row.error
        assert row.max_abs_err < 0.01  # fp16 here: one rounding of the output
        assert row.bytes > 0 and set(row.speedup) == {"reference", "padded_bmm"}


@pytest.mark.usefixtures("on_cpu")
def test_padded_baseline_matches_reference() -> None:
    from loraplex.kernels import reference

    gen = torch.Generator().manual_seed(1)
    setup = bench._lora_setup(32, [16, 8, 8], gen)
    seg = bench._segments(setup, 7)  # segments of 3, 2 and 2 tokens: padding slots
    layout = (seg["token_index"], seg["slot_of_token"])
    args = (setup.pool, seg["page_table"], seg["seg_indptr"], seg["ranks"])
    x = torch.randn(7, 32).half()
    h = reference.lora_shrink(x, *args, seg["a_offsets"], seg["max_rank"])
    h_padded = bench.padded_shrink(x.float(), setup.a_stack.float(), *layout)
    torch.testing.assert_close(h_padded, h, rtol=1e-3, atol=1e-3)
    y = torch.randn(7, 32).half()
    y_ref, y_padded = y.clone(), y.clone()
    reference.lora_expand(h, *args, seg["b_offsets"], seg["scales"], y_ref)
    bench.padded_expand(h, setup.bt_stack, seg["scales"], *layout, y_padded)
    torch.testing.assert_close(y_padded, y_ref, rtol=1e-2, atol=1e-2)


@pytest.mark.usefixtures("on_cpu")
def test_attention_case_and_report() -> None:
    row = bench.Row("decode_attention", dict(batch=2, context=20, heads="32/8x128"))
    bench._bench_decode_attention(row, 2, 20)
    assert row.max_abs_err < 0.05 and row.case["sdpa_backend"]
    rows = [row, bench.Row("shrink", dict(phase="decode", d=1, rank="8", tokens=1, adapters=1),
                           error="skipped: time budget")]
    table = bench_report.markdown({"gpu": "test"}, rows, 1.0, torch.float16)
    assert "skipped: time budget" in table and "Not run (`--no-engine`)" in table
    assert "paged decode attention: worst 1.00x SDPA's time" in table  # timings stubbed at 1 us


def _tiny_engine_bench(**overrides) -> bench_engine.EngineBenchConfig:
    from tests.helpers import tiny_hf_config

    values = dict(hf_config=tiny_hf_config(), dtype="float32", device="cpu", num_requests=3,
                  ranks=(2, 4), prompt_len=5, decode_steps=2, skip_steps=1, rounds=1,
                  page_size=4, num_pages=64)
    values.update(overrides)
    return bench_engine.EngineBenchConfig(**values)


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.timeout(300)
def test_engine_bench_runs_on_a_tiny_model() -> None:
    # the GPU run's code path: model and adapters built, Triton kernels (the interpreter here),
    # base and LoRA rounds, timed decode-only steps, the report
    row = bench_engine.run_engine_bench(_tiny_engine_bench(), time.monotonic() + 240)
    assert row.error is None, row.error
    assert row.case["timed_steps"] == {"base": 2, "lora": 2}
    assert set(row.us) == {"base", "lora"} and row.speedup["lora_vs_base"] > 0
    table = bench_report.markdown({"gpu": "test"}, [row], 1.0, torch.float16)
    assert "| 3 | 3 (2/4 on q,k,v,o) |" in table
    assert "- engine, 3 distinct adapters:" in table


@pytest.mark.usefixtures("on_cpu")
def test_engine_bench_is_bound_by_time() -> None:
    row = bench_engine.run_engine_bench(_tiny_engine_bench(), time.monotonic())
    assert row.error == "skipped: time budget"
    assert row.case["timed_steps"] == {"base": 0, "lora": 0}
    assert "skipped: time budget" in bench_report.markdown({"gpu": "t"}, [row], 1.0, torch.half)


def test_engine_bench_config_is_checked() -> None:
    with pytest.raises(ValueError, match="decode_steps"):
        bench_engine.EngineBenchConfig(decode_steps=0)
    with pytest.raises(ValueError, match="ranks"):
        bench_engine.EngineBenchConfig(ranks=())
    cfg = bench_engine.EngineBenchConfig()  # issue 4's case
    assert (cfg.num_requests, cfg.ranks, cfg.dtype) == (64, (8, 16), "bfloat16")
    hf = cfg.hf_config
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"],
            hf["num_key_value_heads"], hf["intermediate_size"], hf["vocab_size"]) == (
        2048, 16, 16, 8, 5632, 32000)
