"""The native bf16 GEMM (``loraplex/kernels/csrc/gemm_bf16.c``, AVX512-BF16's pair dot
products, through ``loraplex/kernels/cpu_gemm``) against a float64 reference: within one bf16
rounding of the float32 sum on every row, panel and depth tail (odd depths, widths off the
16-column panels and 6-panel tiles, a last group of every panel count, row counts off its
4-row tiles and 64-row tasks, depths over its 512-pair chunks), bias, strided rows, one and two
threads; a NaN stays in its row, and an odd depth never reads the element past its row. And the
model: a bf16 model keeps oneDNN's weights for prefill chunks and a copy on this GEMM (the pair
GEMM, or AMX tiles) for decode-sized calls, each call of the rows its copy is for, the engine's
log-probabilities within bf16's rounding of oneDNN's alone; with ``LORAPLEX_BF16_DECODE_TILES=0``
one copy (every projection on the pair GEMM where there is no AMX, dense copies dropped),
``LORAPLEX_BF16_GEMM=0`` oneDNN's alone.

Runs where the kernel is built (a CPU with AVX512-BF16: Zen 4, Zen 5, Sapphire Rapids); elsewhere
the bf16 projections stay on oneDNN and these tests skip (the switch test still runs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_gemm
from loraplex.server.engine.models import llama

needs_kernel = pytest.mark.skipif(not cpu_gemm.bf16_available(),
                                  reason="no AVX512-BF16 (or native kernels off)")
needs_tiles = pytest.mark.skipif(not cpu_gemm.bf16_tiles_available(),
                                 reason="a CPU without AMX tiles (or native kernels off)")
# the pair dot products, and the same packed weights on AMX tiles where the CPU has them
KINDS = ["bf16", pytest.param("bf16_amx", marks=needs_tiles)]
# a bf16 model's decode copy: the pair GEMM (as on Zen 4 / Zen 5), AMX tiles where the CPU has them
DECODE_KINDS = [pytest.param("bf16", marks=needs_kernel),
                pytest.param("bf16_amx", marks=needs_tiles)]


def _as_on(monkeypatch, kind: str) -> None:
    """The CPU as a bf16 model sees it: without AMX for ``bf16`` (the pair GEMM's copy), as it is
    for ``bf16_amx``."""
    if kind == "bf16":
        monkeypatch.setattr(cpu_gemm, "_amx_usable", lambda: False)
        monkeypatch.setattr(cpu_gemm, "bf16_tiles_available", lambda: False)
    monkeypatch.delenv("LORAPLEX_BF16_GEMM", raising=False)
    monkeypatch.delenv("LORAPLEX_BF16_DECODE_TILES", raising=False)

# (d_out, d_in): one panel; an odd depth under a pair; panels off the 6-panel tile with an
# odd depth; widths off the 16-column panel; SmolLM2's qkv; a depth of two chunks (1100 pairs);
# a last group of 2, 4 and 5 panels (each panel count has its own unrolled loop; 1024 wide as
# a 1024-hidden model's o and down projections)
SHAPES = [(16, 32), (5, 1), (37, 133), (100, 64), (7, 576), (960, 576), (40, 2200),
          (32, 17), (1024, 64), (80, 40)]
ROWS = [1, 3, 4, 5, 32, 65, 130]  # off the 4-row tile, one 64-row task, three
# the tiles': under one 16-row tile, 16-row tiles (17 and under), a 32-row pair and one more,
# a last pair of 17-31 rows (one tile in place, one padded), two 256-row blocks
TILE_ROWS = [1, 15, 16, 17, 31, 32, 33, 48, 63, 64, 300]


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``x w^T + bias`` and the bound on one bf16 rounding of a float32 sum of it."""
    exact = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    if bias is not None:
        exact, mag = exact + bias.double(), mag + bias.double().abs()
    # the float32 sum's error (depth d_in + 1 terms), then half a bf16 ulp of the result
    acc = (x.shape[1] + 1) * 2.0 ** -24 * mag
    return exact, 2.0 ** -8 * (exact.abs() + acc) + acc


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_within_one_rounding_of_float64(shape: tuple[int, int], bias: bool, threads: int,
                                        kind: str) -> None:
    # on tiles: depths of 32 and 576 (and 64) run there, the others on pair dot products
    d_out, d_in = shape
    gen = torch.Generator().manual_seed(d_out * 7919 + d_in)
    w = torch.randn(d_out, d_in, generator=gen).mul(0.1).to(torch.bfloat16)
    b = torch.randn(d_out, generator=gen).to(torch.bfloat16) if bias else None
    packed = cpu_gemm.pack(w, kind)
    assert packed.kind == kind and packed.data.dtype == torch.bfloat16
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in ROWS if kind == "bf16" else TILE_ROWS:
            # rows of a wider tensor (a row stride over d_in), as the engine's views are
            wide = torch.randn(rows, d_in + 3, generator=gen).to(torch.bfloat16)
            x = wide[:, :d_in]
            y = cpu_gemm.linear(x, packed, b)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, d_out)
            exact, bound = _reference(x, w, b)
            err = (y.double() - exact).abs()
            assert (err <= bound).all(), f"{rows} rows: {(err - bound).max().item():.3g} over"
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_beside_onednn_and_a_nan_stays_in_its_row() -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(600, 133, generator=gen).mul(0.1).to(torch.bfloat16)
    x = torch.randn(9, 133, generator=gen).to(torch.bfloat16)
    packed = cpu_gemm.pack(w)
    ours, onednn = cpu_gemm.linear(x, packed), F.linear(x, w)
    # two summation orders, each rounded once: within one bf16 ulp (2**-7 relative)
    torch.testing.assert_close(ours.float(), onednn.float(), rtol=2.0 ** -7, atol=1e-3)
    x[4, 50] = float("nan")
    y = cpu_gemm.linear(x, packed)
    assert y[4].isnan().all() and y[torch.arange(9) != 4].isfinite().all()


@needs_kernel
def test_an_odd_depth_never_reads_past_its_row() -> None:
    # rows of 5 in a buffer whose sixth column is inf: reading it (times the packed zero)
    # would make every output NaN
    w = torch.randn(20, 5).to(torch.bfloat16)
    wide = torch.randn(8, 6).to(torch.bfloat16)
    wide[:, 5] = float("inf")
    y = cpu_gemm.linear(wide[:, :5], cpu_gemm.pack(w))
    assert y.isfinite().all()
    exact, bound = _reference(wide[:, :5], w, None)
    assert ((y.double() - exact).abs() <= bound).all()


@needs_tiles
def test_tiles_a_nan_stays_in_its_row() -> None:
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(100, 96, generator=gen).mul(0.1).to(torch.bfloat16)
    x = torch.randn(40, 96, generator=gen).to(torch.bfloat16)
    x[20, 70] = float("nan")
    y = cpu_gemm.linear(x, cpu_gemm.pack(w, "bf16_amx"))
    assert y[20].isnan().all() and y[torch.arange(40) != 20].isfinite().all()


def test_tiles_refused_where_the_cpu_has_none() -> None:
    if cpu_gemm.bf16_tiles_available():
        pytest.skip("this CPU has AMX tiles")
    if not cpu_gemm.bf16_available():
        pytest.skip("no AVX512-BF16: pack refuses bf16 altogether")
    with pytest.raises(ValueError, match="AMX"):
        cpu_gemm.pack(torch.randn(16, 32).to(torch.bfloat16), "bf16_amx")


@needs_kernel
def test_bad_arguments_are_clear_errors() -> None:
    w = torch.randn(32, 64).to(torch.bfloat16)
    packed = cpu_gemm.pack(w)
    with pytest.raises(ValueError, match=r"bf16 \[T, 64\]"):
        cpu_gemm.linear(torch.randn(4, 63).to(torch.bfloat16), packed)
    with pytest.raises(ValueError, match=r"bf16 \[T, 64\]"):
        cpu_gemm.linear(torch.randn(4, 64), packed)  # float32 rows for a bf16 weight
    with pytest.raises(ValueError, match="bias"):
        cpu_gemm.linear(torch.randn(4, 64).to(torch.bfloat16), packed, torch.randn(32))
    with pytest.raises(ValueError, match="bf16"):
        cpu_gemm.pack(w.t(), "bf16")
    assert cpu_gemm.linear(torch.empty(0, 64, dtype=torch.bfloat16), packed).shape == (0, 32)


def test_the_switches_turn_them_off(monkeypatch) -> None:
    monkeypatch.delenv("LORAPLEX_BF16_DECODE_TILES", raising=False)
    monkeypatch.delenv("LORAPLEX_BF16_GEMM", raising=False)
    expected = ("bf16_amx" if cpu_gemm.bf16_tiles_available()
                else "bf16" if cpu_gemm.bf16_enabled() else None)
    assert cpu_gemm.bf16_decode_kind() == expected
    monkeypatch.setenv("LORAPLEX_BF16_DECODE_TILES", "0")
    assert cpu_gemm.bf16_decode_kind() is None
    # on by default where it is built and the CPU has no AMX (oneDNN's bf16 runs on AMX tiles)
    assert cpu_gemm.bf16_enabled() == (cpu_gemm.bf16_available() and not cpu_gemm._amx_usable())
    monkeypatch.setenv("LORAPLEX_BF16_GEMM", "0")
    assert not cpu_gemm.bf16_enabled()
    if not cpu_gemm.bf16_available():
        with pytest.raises(ValueError, match="not available"):
            cpu_gemm.pack(torch.randn(4, 4).to(torch.bfloat16))


@needs_kernel
def test_one_copy_runs_every_projection_on_it_and_the_switch_turns_it_off(tmp_path, monkeypatch):
    # LORAPLEX_BF16_DECODE_TILES=0 on a CPU without AMX: one copy, the pair GEMM's
    from loraplex.server.engine.models.config import ModelConfig
    from loraplex.server.engine.models.loader import load_tensors, load_weights
    from tests.helpers import make_model

    _as_on(monkeypatch, "bf16")  # as on Zen 4 / Zen 5
    monkeypatch.setenv("LORAPLEX_BF16_DECODE_TILES", "0")
    path = make_model(tmp_path / "m", "qwen2", seed=3)  # qkv with a bias
    config = ModelConfig.from_pretrained(path)
    cpu = torch.device("cpu")
    model = load_weights(path, config, torch.bfloat16, cpu)
    assert model.tiles is not None and len(model.tiles) == len(model.layers)
    assert all(p.kind == "bf16" for t in model.tiles for p in t)
    assert model.lm_head_tiles is not None and model.lm_head_tiles.kind == "bf16"
    assert all(t.is_meta for w in model.layers for t in (w.qkv, w.o, w.gate_up, w.down))
    assert model.decode_tiles is None and model.lm_head_decode_tiles is None
    _, dense_layers, _, _ = load_tensors(path, config, torch.bfloat16, cpu)
    calls: list[int] = []
    original = cpu_gemm.linear
    monkeypatch.setattr(cpu_gemm, "linear",
                        lambda x, w, b=None: (calls.append(x.shape[0]), original(x, w, b))[1])
    w, dense = model.layers[0], dense_layers[0]
    assert w.qkv_bias is not None
    for rows in (1, 5, 40):
        x = torch.randn(rows, dense.qkv.shape[1]).to(torch.bfloat16)
        got = llama.linear(x, w.qkv, w.qkv_bias, model.tiles[0].qkv)
        exact, bound = _reference(x, dense.qkv, dense.qkv_bias)
        assert ((got.double() - exact).abs() <= bound).all()
    assert calls == [1, 5, 40]
    monkeypatch.setenv("LORAPLEX_BF16_GEMM", "0")
    off = load_weights(path, config, torch.bfloat16, cpu)
    assert off.tiles is None and off.lm_head_tiles is None


@needs_kernel
def test_engine_logprobs_stay_within_bf16_rounding_of_onednn(tmp_path, monkeypatch):
    # prefill and decode of six requests on a model whose widths are off the panels: every
    # request completes, the first token's log-probability (one forward over the prompt) is
    # within bf16's rounding of the oneDNN path's
    from loraplex.server.config import EngineConfig, SchedulerConfig
    from loraplex.server.engine.engine import Engine
    from loraplex.server.engine.request import SamplingParams
    from tests.helpers import make_model, random_prompts

    _as_on(monkeypatch, "bf16")
    monkeypatch.setenv("LORAPLEX_BF16_DECODE_TILES", "0")  # one copy: the pair GEMM's
    model = make_model(tmp_path / "m", "llama", seed=11)
    prompts = random_prompts(6, seed=4, low=20, high=60)

    def generate():
        engine = Engine(EngineConfig(model=str(model), dtype="bfloat16", num_pages=128,
                                     scheduler=SchedulerConfig(page_size=4)))
        first: dict[str, tuple[int, float]] = {}
        counts = {f"r{i}": 0 for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6, ignore_eos=True,
                                                          logprobs=1))
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id not in first:
                    first[out.request_id] = (out.new_token_ids[0], out.logprobs[0].logprob)
                counts[out.request_id] += len(out.new_token_ids)
        return engine, first, counts

    engine, on, on_counts = generate()
    assert engine.runner.model.tiles is not None
    assert engine.runner.model.tiles[0].qkv.kind == "bf16"
    monkeypatch.setenv("LORAPLEX_BF16_GEMM", "0")
    engine, off, off_counts = generate()
    assert engine.runner.model.tiles is None
    assert on_counts == off_counts == {r: 6 for r in on_counts}
    for r in on:
        if on[r][0] == off[r][0]:  # the same first token: its log-probability beside it
            assert abs(on[r][1] - off[r][1]) < 0.05, (r, on[r], off[r])
    assert sum(on[r][0] == off[r][0] for r in on) >= 4


@pytest.mark.parametrize("kind", DECODE_KINDS)
def test_model_runs_decode_sized_calls_on_its_copy_and_prefill_on_onednn(tmp_path, monkeypatch,
                                                                          kind):
    # a bf16 model keeps oneDNN's packed weights and a copy of the decode kind: calls of up to
    # DECODE_TILE_ROWS rows (LM_HEAD_TILE_ROWS[kind] for the lm_head) run on the copy
    from loraplex.server.engine.models.config import ModelConfig
    from loraplex.server.engine.models.loader import load_weights
    from tests.helpers import make_model

    _as_on(monkeypatch, kind)
    path = make_model(tmp_path / "m", "qwen2", seed=3)  # qkv with a bias
    config = ModelConfig.from_pretrained(path)
    cpu = torch.device("cpu")
    model = load_weights(path, config, torch.bfloat16, cpu)
    assert model.tiles is None and model.decode_tiles is not None
    assert all(p.kind == kind for t in model.decode_tiles for p in t)
    assert model.lm_head_decode_tiles is not None and model.lm_head_decode_tiles.kind == kind
    assert all(w.qkv.is_mkldnn for w in model.layers)  # oneDNN's copy for prefill chunks
    calls: list[tuple[int, str]] = []
    original = cpu_gemm.linear
    monkeypatch.setattr(cpu_gemm, "linear", lambda x, w, b=None: (
        calls.append((x.shape[0], w.kind)), original(x, w, b))[1])
    w = model.layers[0]
    for rows in (5, llama.DECODE_TILE_ROWS, llama.DECODE_TILE_ROWS + 1):
        x = torch.randn(rows, config.hidden_size).to(torch.bfloat16)
        tiles = model.decode_tiles[0].qkv if rows <= llama.DECODE_TILE_ROWS else None
        got = llama.linear(x, w.qkv, w.qkv_bias, tiles)
        ref = llama.linear(x, w.qkv, w.qkv_bias)  # oneDNN
        torch.testing.assert_close(got.float(), ref.float(), rtol=2.0 ** -7, atol=2e-2)
    calls.clear()
    limit = llama.LM_HEAD_TILE_ROWS[kind]
    for rows in (3, limit, limit + 1):
        model.compute_logits(torch.randn(rows, config.hidden_size).to(torch.bfloat16))
    assert calls == [(3, kind), (limit, kind)]
    monkeypatch.setenv("LORAPLEX_BF16_DECODE_TILES", "0")
    off = load_weights(path, config, torch.bfloat16, cpu)
    assert off.decode_tiles is None and off.lm_head_decode_tiles is None
    assert (off.tiles is not None) == (kind == "bf16")  # one copy: the pair GEMM's, or oneDNN's
    # a copy over a quarter of the memory available is not made: one copy, as with the switch
    monkeypatch.delenv("LORAPLEX_BF16_DECODE_TILES")
    monkeypatch.setattr(llama, "host_memory_available", lambda: 4 << 10)
    tight = load_weights(path, config, torch.bfloat16, cpu)
    assert tight.decode_tiles is None and tight.lm_head_decode_tiles is None
    assert (tight.tiles is not None) == (kind == "bf16")
    monkeypatch.setattr(llama, "host_memory_available", lambda: None)  # unknown: both copies
    assert load_weights(path, config, torch.bfloat16, cpu).decode_tiles is not None


@pytest.mark.parametrize("kind", DECODE_KINDS)
def test_engine_decode_on_its_copy_stays_within_bf16_rounding(tmp_path, monkeypatch, kind):
    # six requests: their prefill (over 64 rows) on oneDNN, their decode steps on the copy;
    # every request completes, and the second token's log-probability (a decode step's) is
    # within bf16's rounding of the all-oneDNN engine's where both chose the same tokens
    from loraplex.server.config import EngineConfig, SchedulerConfig
    from loraplex.server.engine.engine import Engine
    from loraplex.server.engine.request import SamplingParams
    from tests.helpers import make_model, random_prompts

    _as_on(monkeypatch, kind)
    model = make_model(tmp_path / "m", "llama", seed=11)
    prompts = random_prompts(6, seed=4, low=20, high=60)
    kinds: list[str] = []
    rows: list[int] = []
    original = cpu_gemm.linear
    monkeypatch.setattr(cpu_gemm, "linear", lambda x, w, b=None: (
        kinds.append(w.kind), rows.append(x.shape[0]), original(x, w, b))[2])

    def generate():
        engine = Engine(EngineConfig(model=str(model), dtype="bfloat16", num_pages=128,
                                     scheduler=SchedulerConfig(page_size=4)))
        tokens: dict[str, list[tuple[int, float]]] = {f"r{i}": [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6, ignore_eos=True,
                                                          logprobs=1))
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += [(t, lp.logprob) for t, lp in
                                           zip(out.new_token_ids, out.logprobs)]
        return engine, tokens

    engine, on = generate()
    assert engine.runner.model.decode_tiles is not None
    assert set(kinds) == {kind}  # and only decode-sized calls: the prefill on oneDNN
    assert 0 < max(rows) <= llama.DECODE_TILE_ROWS
    assert sum(len(p) for p in prompts) > llama.DECODE_TILE_ROWS
    # oneDNN alone: without AMX that is LORAPLEX_BF16_GEMM=0 (LORAPLEX_BF16_DECODE_TILES=0
    # keeps the pair GEMM's one copy there)
    monkeypatch.setenv("LORAPLEX_BF16_GEMM" if kind == "bf16" else "LORAPLEX_BF16_DECODE_TILES",
                       "0")
    kinds.clear()
    engine, off = generate()
    assert engine.runner.model.decode_tiles is None and kinds == []
    assert all(len(on[r]) == len(off[r]) == 6 for r in on)
    compared = 0
    for r in on:
        if [t for t, _ in on[r][:2]] == [t for t, _ in off[r][:2]]:
            assert abs(on[r][1][1] - off[r][1][1]) < 0.05, (r, on[r], off[r])
            compared += 1
    assert compared >= 3
