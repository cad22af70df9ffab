"""The GPU benchmark script: it refuses cleanly without CUDA, and its set-up, baselines and
report run end to end on tiny sizes on CPU (kernels under the interpreter, timing stubbed), so
the one H200 run is not spent on a shape bug."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_without_cuda(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--out", str(tmp_path / "out")]) == 2
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
    table = bench.markdown({"gpu": "test"}, rows, 1.0)
    assert "skipped: time budget" in table and "Engine end to end" in table
    assert "paged decode attention: worst 1.00x SDPA's time" in table  # timings stubbed at 1 us
    with pytest.raises(NotImplementedError):
        bench.bench_engine(None)
