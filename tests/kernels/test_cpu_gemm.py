"""The native float32 GEMMs (``loraplex/kernels/csrc/gemm_amx.c`` where the CPU has AMX,
``loraplex/kernels/csrc/gemm_fma.c`` everywhere, through ``loraplex/kernels/cpu_gemm``) against a
float64 reference: every row, column and depth tail of their tiles and panels, depths over their
chunks, row counts over their row blocks, the AMX kernel's few-row FMA path and its edge, bias,
strided rows, one and two threads, non-finite inputs; the error stays within float32's
forward-error bound and beside torch's own float32 GEMM. And the model: fp32 weights are
rearranged and their dense copies dropped, every projection runs on the kernel whatever the
rows, the switches (``LORAPLEX_AMX_GEMM``, ``LORAPLEX_FMA_GEMM``) choose it or turn it off, and
the engine's tokens are the same with it on and off."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_gemm, native
from loraplex.server.engine.models import llama
from tests.kernels.cross_build import cross_build

KINDS = cpu_gemm.backends()
pytestmark = pytest.mark.skipif(not KINDS, reason="needs the native library (a C compiler)")

U = 2.0 ** -24  # float32's unit roundoff


def _use(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``kind`` this process's backend."""
    if kind == "fma":
        monkeypatch.setenv("LORAPLEX_AMX_GEMM", "0")
        monkeypatch.setenv("LORAPLEX_FMA_GEMM", "1")
    else:
        monkeypatch.setenv("LORAPLEX_AMX_GEMM", "1")
    assert cpu_gemm.backend() == kind


def _check(kind: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           threads: int = 1) -> torch.Tensor:
    packed = cpu_gemm.pack(w, kind)
    assert packed.kind == kind
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = cpu_gemm.linear(x, packed, bias)
        mkl = F.linear(x, w, bias)
    finally:
        torch.set_num_threads(previous)
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64.t() + (bias.double() if bias is not None else 0)
    assert y.shape == ref.shape and y.dtype == torch.float32 and y.is_contiguous()
    # forward-error bound of a float32 dot product of depth k (AMX's split adds at most a few
    # u per product), element by element
    k = x.shape[1]
    bound = (k + 8) * U * (x64.abs() @ w64.abs().t() + (
        bias.double().abs() if bias is not None else 0)) + 1e-30
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    # and in practice as close as torch's own float32 GEMM (the FMA kernel's two-level sums:
    # closer; one running sum a column failed this at 4200 deep)
    scale = float(ref.abs().max()) or 1.0
    assert float(err.max()) <= 4 * float((mkl.double() - ref).abs().max()) + 4 * U * scale
    return y


SHAPES = [  # (rows, depth, columns): tails of every tile and panel dimension (AMX: 32 x 32
    # tiles, 2048-deep chunks; under 15 rows the FMA path, whole panels to 6 rows (1, 2, 6),
    # half panels from 7 (7, 11, 12, 13, 14). FMA: 6 x 16 tiles on AVX2, 12 x 32 with
    # AVX-512, depth chunks of up to 1024 split evenly (2049 deep: 3 of 683), row blocks of
    # up to 120 split evenly, x rearranged a block at a time: 121 is two blocks of 61)
    (1, 1, 1), (1, 64, 48), (2, 576, 960), (6, 100, 70), (7, 33, 130), (11, 300, 64),
    (12, 2049, 33), (13, 1536, 64), (14, 96, 3000), (15, 31, 17), (16, 32, 32), (17, 33, 33),
    (31, 16, 96),
    (32, 576, 960), (33, 100, 70), (64, 1, 130), (100, 576, 576), (257, 96, 64),
    (40, 1100, 50), (70, 2049, 33), (300, 1536, 96), (64, 4200, 40),
    (5, 1025, 15), (25, 513, 47), (241, 40, 20), (481, 24, 40), (3, 7, 49), (121, 1100, 40),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,depth,cols", SHAPES)
def test_matches_float64_within_float32_error(kind, rows, depth, cols):
    gen = torch.Generator().manual_seed(rows * 7 + depth * 3 + cols)
    x = torch.randn(rows, depth, generator=gen)
    w = torch.randn(cols, depth, generator=gen) * 0.05
    _check(kind, x, w)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_bias_strided_rows_and_threads(kind, threads):
    gen = torch.Generator().manual_seed(threads)
    wide = torch.randn(150, 700, generator=gen)
    x = wide[:, 3:603]  # row stride 700
    w_wide = torch.randn(200, 640, generator=gen)
    w = w_wide[:, :600]  # a strided weight packs too
    bias = torch.randn(200, generator=gen)
    y = _check(kind, x, w, bias, threads)
    # each output tile is one thread's whole sum, in the same order whatever the thread count
    assert torch.equal(y, _check(kind, x, w, bias, threads=1))
    # and a strided output row block: y's rows are written, not read before the first chunk
    # (30 rows: AMX runs fewer than 15 as FMAs, whose sums round differently from the tiles')
    assert torch.equal(cpu_gemm.linear(x[10:40], cpu_gemm.pack(w, kind), bias), y[10:40])


@pytest.mark.parametrize("kind", KINDS)
def test_values_far_from_one_keep_their_relative_accuracy(kind):
    gen = torch.Generator().manual_seed(3)
    for scale in (1e-20, 1e-3, 1e3, 1e15):
        x = torch.randn(40, 96, generator=gen) * scale
        w = torch.randn(64, 96, generator=gen)
        _check(kind, x, w)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [15, 40])  # AMX: a padded tile and full ones
def test_non_finite_inputs_stay_in_their_rows(kind, rows):
    # a NaN or inf input row gives non-finite outputs in that row only (on the tile path inf
    # comes out as NaN: the split's remainder inf - inf), other rows exact as ever
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(rows, 64, generator=gen)
    w = torch.randn(48, 64, generator=gen)
    x[3, 5] = float("nan")
    x[7, 0] = float("inf")
    y = cpu_gemm.linear(x, cpu_gemm.pack(w, kind))
    bad = {3, 7}
    for r in range(rows):
        finite = bool(torch.isfinite(y[r]).all())
        assert finite == (r not in bad), r
    good = [r for r in range(rows) if r not in bad]
    torch.testing.assert_close(y[good], F.linear(x[good], w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [5, 9, 40])  # AMX's whole panels, half panels; FMA's tiles
def test_non_finite_inputs_on_the_fma_paths(kind, rows):
    # plain FMAs (all of the FMA kernel, AMX's under 15 rows): NaN and inf propagate as a
    # float32 GEMM's do, in their rows only
    if kind == "amx" and rows >= 15:
        pytest.skip("the tile path turns inf into NaN (above)")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 64, generator=gen)
    w = torch.rand(48, 64, generator=gen) + 0.1  # positive: inf x w stays +inf
    x[1, 5] = float("nan")
    x[3, 0] = float("inf")
    y = cpu_gemm.linear(x, cpu_gemm.pack(w, kind))
    assert bool(torch.isnan(y[1]).all()) and bool(torch.isposinf(y[3]).all())
    good = [r for r in range(rows) if r not in (1, 3)]
    torch.testing.assert_close(y[good], F.linear(x[good], w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_zero_rows_and_refusals(kind):
    w = torch.randn(32, 64)
    packed = cpu_gemm.pack(w, kind)
    assert cpu_gemm.linear(torch.empty(0, 64), packed).shape == (0, 32)
    assert packed.nbytes == 32 * 64 * 4  # float32, rearranged
    with pytest.raises(ValueError, match="float32"):
        cpu_gemm.pack(w.bfloat16(), kind)
    with pytest.raises(ValueError, match="float32"):
        cpu_gemm.pack(torch.randn(64), kind)
    with pytest.raises(ValueError, match="unit column"):
        cpu_gemm.pack(w.t(), kind)
    with pytest.raises(ValueError, match=r"\[T, 64\]"):
        cpu_gemm.linear(torch.randn(4, 63), packed)
    with pytest.raises(ValueError, match=r"\[T, 64\]"):
        cpu_gemm.linear(torch.randn(4, 64).double(), packed)
    with pytest.raises(ValueError, match="bias"):
        cpu_gemm.linear(torch.randn(4, 64), packed, torch.randn(31))
    with pytest.raises(ValueError, match="not available"):
        cpu_gemm.pack(w, "cublas")


def test_the_switches_choose_the_backend(monkeypatch):
    monkeypatch.delenv("LORAPLEX_AMX_GEMM", raising=False)
    monkeypatch.delenv("LORAPLEX_FMA_GEMM", raising=False)
    tuned = bool(cpu_gemm._fma_library().loraplex_fma_tuned())
    # the default: AMX where the CPU has it, else FMA where it was measured faster
    assert cpu_gemm.backend() == ("amx" if "amx" in KINDS else "fma" if tuned else None)
    monkeypatch.setenv("LORAPLEX_AMX_GEMM", "0")
    assert cpu_gemm.backend() == ("fma" if tuned else None)
    monkeypatch.setenv("LORAPLEX_FMA_GEMM", "1")
    assert cpu_gemm.backend() == "fma" and cpu_gemm.enabled()
    monkeypatch.setenv("LORAPLEX_FMA_GEMM", "off")
    assert cpu_gemm.backend() is None and not cpu_gemm.enabled()
    with pytest.raises(ValueError, match="not available"):
        cpu_gemm.pack(torch.randn(4, 4))
    if "amx" not in KINDS:
        with pytest.raises(ValueError, match="amx float32 GEMM is not available"):
            cpu_gemm.pack(torch.randn(4, 4), "amx")


def test_fma_auto_is_on_where_it_was_measured_faster():
    # LORAPLEX_FMA_GEMM=auto: x86 with AVX2 and FMA but no AVX-512 (Zen 3), and AVX-512 on
    # AMD's family 0x1A and later (Zen 5); oneDNN on every other CPU (Zen 4, Intel without AMX)
    import platform
    if platform.machine() not in ("x86_64", "AMD64") or not os.path.exists("/proc/cpuinfo"):
        pytest.skip("the rule is about x86 CPUs (read from Linux's /proc/cpuinfo)")
    with open("/proc/cpuinfo") as f:
        info = f.read()
    flags = set(re.search(r"^flags\s*:(.*)$", info, re.M).group(1).split())
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", info, re.M).group(1)
    family = int(re.search(r"^cpu family\s*:\s*(\d+)", info, re.M).group(1))
    if "avx512f" in flags:
        expected = vendor == "AuthenticAMD" and family >= 0x1A
    else:
        expected = "avx2" in flags and "fma" in flags
    assert bool(cpu_gemm._fma_library().loraplex_fma_tuned()) == expected


@pytest.mark.parametrize("kind", KINDS)
def test_model_runs_every_projection_on_it_and_the_switch_turns_it_off(kind, tmp_path,
                                                                        monkeypatch):
    from loraplex.server.engine.models.config import ModelConfig
    from loraplex.server.engine.models.loader import load_tensors, load_weights
    from tests.helpers import make_model

    _use(kind, monkeypatch)
    path = make_model(tmp_path / "m", "llama", seed=3)
    config = ModelConfig.from_pretrained(path)
    cpu = torch.device("cpu")
    model = load_weights(path, config, torch.float32, cpu)
    assert model.tiles is not None and len(model.tiles) == len(model.layers)
    assert all(p.kind == kind for t in model.tiles for p in t)
    assert model.lm_head_tiles is not None and model.lm_head_tiles.kind == kind
    # the dense copies are dropped: only their shapes are left
    assert all(t.is_meta for w in model.layers for t in (w.qkv, w.o, w.gate_up, w.down))
    _, dense_layers, _, _ = load_tensors(path, config, torch.float32, cpu)
    calls: list[int] = []
    original = cpu_gemm.linear
    monkeypatch.setattr(cpu_gemm, "linear",
                        lambda x, w, b=None: (calls.append(x.shape[0]), original(x, w, b))[1])
    w, dense = model.layers[0], dense_layers[0]
    row_counts = (1, 5, 6, 7, 14, 15, 16, 40)  # AMX: the few-row FMA path (< 15), the tiles
    for rows in row_counts:
        x = torch.randn(rows, dense.qkv.shape[1])
        got = llama.linear(x, w.qkv, w.qkv_bias, model.tiles[0].qkv)
        torch.testing.assert_close(got, F.linear(x, dense.qkv, dense.qkv_bias), rtol=1e-5,
                                   atol=1e-5)
        x = torch.randn(rows, dense.down.shape[1])
        got = llama.linear(x, w.down, w.down_bias, model.tiles[0].down)
        torch.testing.assert_close(got, F.linear(x, dense.down), rtol=1e-5, atol=1e-5)
    assert calls == [r for r in row_counts for _ in range(2)]
    bf16 = load_weights(path, config, torch.bfloat16, cpu)
    # bf16's own kernels (test_cpu_gemm_bf16.py), not this one: oneDNN's weights, and a decode
    # copy on the pair GEMM or AMX tiles where there is one
    assert bf16.tiles is None and bf16.lm_head_tiles is None
    kind = cpu_gemm.bf16_decode_kind()
    assert (bf16.decode_tiles is not None) == (kind is not None)
    if kind is not None:
        assert all(p.kind == kind for t in bf16.decode_tiles for p in t)
    monkeypatch.setenv("LORAPLEX_AMX_GEMM", "0")
    monkeypatch.setenv("LORAPLEX_FMA_GEMM", "0")
    assert not cpu_gemm.enabled()
    off = load_weights(path, config, torch.float32, cpu)
    assert off.tiles is None and off.lm_head_tiles is None


def test_native_kernels_off_turns_it_off(monkeypatch):
    monkeypatch.setenv("LORAPLEX_NATIVE_KERNELS", "0")
    monkeypatch.setenv("LORAPLEX_FMA_GEMM", "1")
    monkeypatch.setattr(native, "_loaded", {})
    assert not cpu_gemm.enabled() and cpu_gemm.backends() == []


@pytest.mark.parametrize("kind", KINDS)
def test_engine_tokens_equal_with_the_native_gemm_on_and_off(kind, tmp_path, monkeypatch):
    # prefill chunks (AMX's tile path) and decodes of six requests (its FMA path), on a model
    # whose widths are not multiples of the tiles' or panels': same greedy tokens, logprobs
    # within float32 noise
    from loraplex.server.config import EngineConfig, SchedulerConfig
    from loraplex.server.engine.engine import Engine
    from loraplex.server.engine.request import SamplingParams
    from tests.helpers import make_model, random_prompts

    _use(kind, monkeypatch)
    model = make_model(tmp_path / "m", "llama", seed=11)
    prompts = random_prompts(6, seed=4, low=20, high=60)

    def generate():
        engine = Engine(EngineConfig(model=str(model), num_pages=128,
                                     scheduler=SchedulerConfig(page_size=4)))
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=8, ignore_eos=True,
                                                          logprobs=1))
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        logprobs: dict[str, list[float]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                logprobs[out.request_id] += [lp.logprob for lp in out.logprobs]
        return engine, tokens, logprobs

    engine, on_tokens, on_lp = generate()
    assert engine.runner.model.tiles is not None
    assert engine.runner.model.tiles[0].qkv.kind == kind
    monkeypatch.setenv("LORAPLEX_AMX_GEMM", "0")
    monkeypatch.setenv("LORAPLEX_FMA_GEMM", "0")
    engine, off_tokens, off_lp = generate()
    assert engine.runner.model.tiles is None
    assert on_tokens == off_tokens
    assert all(len(v) == 8 for v in on_tokens.values())
    for r in on_lp:
        assert len(on_lp[r]) == 8
        torch.testing.assert_close(torch.tensor(on_lp[r]), torch.tensor(off_lp[r]),
                                   rtol=0, atol=1e-4)


@pytest.mark.parametrize("march,fmas", [("haswell", 12), ("znver3", 12), ("sapphirerapids", 24)])
def test_fma_kernel_builds_with_its_tile_in_registers(tmp_path, march: str, fmas: int) -> None:
    """gemm_fma.c builds without a warning for AVX2 and AVX-512 CPUs, and its micro-kernel is
    one loop of 2 MR FMAs (6 x 2 vectors on AVX2, 12 x 2 with AVX-512) whose back edge runs at
    most fmas / 12 register moves (GCC writes a depth's last FMA into a dying weight or
    broadcast register and moves it back: one move, free on cores that rename moves). Once GCC
    kept the two-level sums' totals in registers across that loop: too few were left for the
    accumulators, three moved every depth, 0.8x on a Zen 3 core."""
    cc = native._compiler()
    if cc is None:
        pytest.skip("needs a C compiler")
    asm = tmp_path / "gemm_fma.s"
    cross_build(cc, "gemm_fma", march, asm, assembly=True)
    parts = re.split(r"^(\.L\d+):\n", asm.read_text(), flags=re.M)
    bodies = dict(zip(parts[1::2], parts[2::2]))
    order = parts[1::2]
    reg = "zmm" if fmas == 24 else "ymm"
    move = re.compile(rf"^\s+vmovaps\s+%{reg}\d+, %{reg}\d+\s*$", re.M)
    found = []
    for i, label in enumerate(order):
        body = bodies[label]
        if body.count("vfmadd") != fmas or f"%{reg}" not in body:
            continue
        jump = re.search(r"^\s+j\w+\s+(\.L\d+)\s*$", body, re.M)
        if jump is None:
            continue
        target = jump.group(1)
        if target == label:
            found.append(0)
        elif i > 0 and target == order[i - 1]:  # a block of moves falling into the loop
            pre = bodies[target]
            lines = [ln for ln in pre.splitlines() if ln.strip() and not ln.strip().startswith(".")]
            if all(move.match(ln) for ln in lines):
                found.append(len(lines))
    assert found, f"no loop of {fmas} FMAs ({march})"
    assert min(found) <= fmas // 12, f"{min(found)} register moves a depth ({march})"


def test_avx2_build_matches_float64(tmp_path) -> None:
    """The AVX2 build (6 x 16 tiles, x rearranged as [depth][6] by plain copies, no register
    transpose) computes what the float64 reference does, on any host that can run AVX2: a
    host with AVX-512 otherwise runs only the 12 x 32 build, and `auto` turns the AVX2 one on
    for every AVX2 CPU without AVX-512 (Zen 3)."""
    import ctypes
    import platform
    if platform.machine() not in ("x86_64", "AMD64") or not os.path.exists("/proc/cpuinfo"):
        pytest.skip("needs an x86 Linux host")
    with open("/proc/cpuinfo") as f:
        flags = set(re.search(r"^flags\s*:(.*)$", f.read(), re.M).group(1).split())
    if not {"avx2", "fma"} <= flags:
        pytest.skip("the host cannot run AVX2 code")
    cc = native._compiler()
    if cc is None:
        pytest.skip("needs a C compiler")
    so = tmp_path / "gemm_fma_avx2.so"
    cross_build(cc, "gemm_fma", "haswell", so)
    lib = ctypes.CDLL(str(so))
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.loraplex_fma_tuned.restype = ctypes.c_int
    lib.loraplex_fma_packed_elems.argtypes = [i64, i64]
    lib.loraplex_fma_packed_elems.restype = i64
    lib.loraplex_fma_pack.argtypes = [p, i64, i64, i64, p, ctypes.c_int]
    lib.loraplex_fma_scratch_elems.argtypes = [i64, i64, ctypes.c_int]
    lib.loraplex_fma_scratch_elems.restype = i64
    lib.loraplex_fma_linear.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, p, ctypes.c_int]
    assert lib.loraplex_fma_tuned() == 1  # AVX2 and FMA, no AVX-512
    gen = torch.Generator().manual_seed(11)
    # one row group (1, 5), several (13, 32), several blocks of 120 (121, 250), depth chunks
    # (1100: two of 550), column tails (17, 40)
    for rows, depth, cols, threads in [(1, 64, 17, 1), (5, 1100, 40, 1), (13, 33, 50, 2),
                                       (32, 576, 96, 1), (121, 100, 33, 2), (250, 1100, 40, 2)]:
        x = torch.randn(rows, depth, generator=gen)
        w = torch.randn(cols, depth, generator=gen) * 0.05
        bias = torch.randn(cols, generator=gen)
        packed = torch.empty(lib.loraplex_fma_packed_elems(cols, depth), dtype=torch.float32)
        lib.loraplex_fma_pack(w.data_ptr(), depth, cols, depth, packed.data_ptr(), 1)
        scratch = torch.empty(max(lib.loraplex_fma_scratch_elems(rows, depth, threads), 1),
                              dtype=torch.float32)
        y = torch.full((rows, cols), float("nan"))
        lib.loraplex_fma_linear(x.data_ptr(), depth, packed.data_ptr(), bias.data_ptr(),
                                y.data_ptr(), cols, rows, cols, depth, scratch.data_ptr(),
                                threads)
        ref = x.double() @ w.double().t() + bias.double()
        bound = (depth + 8) * U * (x.double().abs() @ w.double().abs().t() + bias.double().abs())
        assert bool(((y.double() - ref).abs() <= bound + 1e-30).all()), (rows, depth, cols)
