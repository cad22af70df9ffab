"""The fused C elementwise ops (loraplex/kernels/cpu_elementwise.py) against the torch code they
replace.

Tolerances: on an x86 CPU where torch dispatches to AVX2 or AVX512 kernels the ops reproduce
torch's roundings exactly (the RMSNorm sum of squares in torch's cascade order, Sleef's exp in
SiLU's vector body, libm's in its tail), so the tests ask for bit equality there, NaN for NaN.
Elsewhere torch's vector width (and so its sum order and loop tails) is not modelled: float32
may differ by a few ulp of the sum of squares, bf16 by one bf16 ulp where that flips a
rounding; the `_close` tolerances say so.

The torch references run on one thread: torch's own SiLU splits its vector body and scalar tail
where its thread chunks fall, so its bits depend on the thread count; the native ops' do not.
"""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_elementwise, native
from loraplex.server.engine.models import llama
from loraplex.server.engine.models.rope import RotaryEmbedding
from tests.kernels.cross_build import cross_build, source

pytestmark = pytest.mark.skipif(not cpu_elementwise.available(),
                                reason="no C compiler: the native kernels do not build")

EXACT = (platform.machine() in ("x86_64", "AMD64")
         and torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512")))
DTYPES = [torch.float32, torch.bfloat16]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if EXACT:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
    elif actual.dtype == torch.bfloat16:
        torch.testing.assert_close(actual, expected, rtol=2 ** -7, atol=1e-6, equal_nan=True)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-7, equal_nan=True)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    yield request.param
    torch.set_num_threads(before)


def _one_thread(fn, *args):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(before)


def _silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.clone().chunk(2, dim=-1)
    return F.silu(gate, inplace=True) * up


def _rope_torch(qkv, cos, sin, heads, kv_heads, dim):
    t = qkv.shape[0]
    q = qkv[:, :heads * dim].reshape(t, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].reshape(t, kv_heads, dim)
    return RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)


def _tables(positions: torch.Tensor, dim: int, dtype: torch.dtype):
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions.to(torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [7, 133, 576, 1000, 4096])
@pytest.mark.parametrize("rows", [1, 3, 257])
def test_rms_norm_and_add_rms_norm(dtype, n, rows, threads):
    g = torch.Generator().manual_seed(n * 1000 + rows)
    hidden = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, n, generator=g).to(dtype)
    weight = (1 + torch.randn(n, generator=g) / 4).to(dtype)
    expected = _one_thread(llama._rms_norm_torch, hidden, weight, 1e-5)
    expected_sum = hidden + delta
    expected_add = _one_thread(llama._rms_norm_torch, expected_sum, weight, 1e-5)
    torch.set_num_threads(threads)

    before = hidden.clone()
    _close(cpu_elementwise.rms_norm(hidden, weight, 1e-5), expected)
    assert torch.equal(hidden, before)  # rms_norm leaves its input alone
    out = cpu_elementwise.add_rms_norm(hidden, delta, weight, 1e-5)
    assert torch.equal(hidden, expected_sum)  # the residual add: one rounding, in place
    _close(out, expected_add)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [7, 48, 133, 576, 1000, 1536])
@pytest.mark.parametrize("rows", [1, 3, 257])
def test_silu_and_mul(dtype, inter, rows, threads):
    g = torch.Generator().manual_seed(inter * 1000 + rows)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    expected = _one_thread(_silu_mul_torch, gate_up)
    torch.set_num_threads(threads)
    before = gate_up.clone()
    _close(cpu_elementwise.silu_and_mul(gate_up), expected)
    assert torch.equal(gate_up, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,heads,kv_heads,dim", [
    (1, 9, 3, 64), (3, 4, 4, 10), (257, 9, 3, 64), (5, 2, 1, 128)])
def test_rope_qk(dtype, rows, heads, kv_heads, dim, threads):
    g = torch.Generator().manual_seed(rows * dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    cos, sin = _tables(torch.randint(0, 5000, (rows,), generator=g), dim, dtype)
    expected_q, expected_k = _rope_torch(qkv, cos, sin, heads, kv_heads, dim)
    torch.set_num_threads(threads)
    q, k = cpu_elementwise.rope_qk(qkv, cos, sin, heads, kv_heads, dim)
    assert q.shape == (rows, heads, dim) and k.shape == (rows, kv_heads, dim)
    # The rotation is elementwise products and sums: bit-equal on every CPU.
    torch.testing.assert_close(q, expected_q, rtol=0, atol=0)
    torch.testing.assert_close(k, expected_k, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_propagate_as_torch(dtype):
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e30, -1e30])
    x = torch.randn(6, 40).to(dtype)
    x[0, 3], x[1, 0], x[2, 39], x[3, 5] = float("nan"), float("inf"), float("-inf"), 1e30
    weight = torch.ones(40, dtype=dtype)
    _close(cpu_elementwise.rms_norm(x, weight, 1e-6), llama._rms_norm_torch(x, weight, 1e-6))
    delta = torch.zeros_like(x)
    delta[4, 7], delta[5, 8] = float("inf"), float("-inf")
    expected = llama._rms_norm_torch(x + delta, weight, 1e-6)
    _close(cpu_elementwise.add_rms_norm(x, delta, weight, 1e-6), expected)

    gate_up = torch.randn(3, 2 * 70).to(dtype)
    gate_up[0, :7], gate_up[1, 70:77], gate_up[2, 64:71] = specials, specials, specials
    _close(cpu_elementwise.silu_and_mul(gate_up), _silu_mul_torch(gate_up))

    qkv = torch.randn(2, 4 * 8).to(dtype)
    qkv[0, :7], qkv[1, 9:16] = specials, specials
    cos, sin = _tables(torch.tensor([3, 7]), 8, dtype)
    for got, want in zip(cpu_elementwise.rope_qk(qkv, cos, sin, 1, 1, 8),
                         _rope_torch(qkv, cos, sin, 1, 1, 8), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_refuses_what_it_does_not_take():
    x = torch.randn(4, 16)
    assert not cpu_elementwise.usable(x.half(), torch.ones(16).half())
    assert not cpu_elementwise.usable(x[:, :8], torch.ones(8))  # rows with a stride
    assert not cpu_elementwise.usable(x, torch.ones(16, dtype=torch.bfloat16))  # mixed dtypes
    with pytest.raises(ValueError, match="contiguous"):
        cpu_elementwise.rms_norm(x.t(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="add_rms_norm"):
        cpu_elementwise.rms_norm(x, torch.ones(15), 1e-6)
    with pytest.raises(ValueError, match="odd"):
        cpu_elementwise.silu_and_mul(torch.randn(2, 7))


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_ops_take_the_native_path_and_the_switch_turns_it_off(dtype, monkeypatch):
    # llama.py and rope.py route through the native ops when they load, and
    # LORAPLEX_NATIVE_KERNELS=0 (a fresh load) puts them back on torch with the same values.
    calls: list[str] = []
    for name in ("add_rms_norm", "silu_and_mul", "rope_qk"):
        original = getattr(cpu_elementwise, name)
        monkeypatch.setattr(cpu_elementwise, name,
                            lambda *a, _o=original, _n=name: (calls.append(_n), _o(*a))[1])
    hidden = torch.randn(5, 133).to(dtype)
    delta, weight = torch.randn(5, 133).to(dtype), torch.randn(133).to(dtype)
    gate_up, qkv = torch.randn(5, 2 * 96).to(dtype), torch.randn(5, 5 * 16).to(dtype)
    cos, sin = _tables(torch.arange(5), 16, dtype)

    class _Act:
        act = staticmethod(F.silu)

    def run():
        h = hidden.clone()
        rope = RotaryEmbedding.__new__(RotaryEmbedding)
        return (llama.rms_norm(hidden, weight, 1e-5), llama.add_rms_norm(h, delta, weight, 1e-5),
                h, llama.LlamaModel._act_and_mul(_Act(), gate_up),
                *rope.apply_qk(qkv, cos, sin, 3, 1, 16))

    native_out = run()
    assert calls == ["add_rms_norm", "add_rms_norm", "silu_and_mul", "rope_qk"]
    monkeypatch.setenv("LORAPLEX_NATIVE_KERNELS", "0")
    monkeypatch.setattr(native, "_loaded", {})
    assert not cpu_elementwise.available()
    calls.clear()
    torch_out = run()
    assert calls == []
    for a, b in zip(native_out, torch_out, strict=True):
        _close(a, b)


@pytest.mark.skipif(not EXACT, reason="bit equality with torch holds on AVX2/AVX512 x86")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_output_is_bit_identical_with_native_kernels_off(tmp_path, dtype, monkeypatch):
    # The whole forward (prefill chunks and decodes of several requests, GQA, a residual
    # stream through every fused op) gives the same tokens and logprobs, to the bit, as the
    # torch ops: the fused ops change no rounding.
    from loraplex.server.config import EngineConfig, SchedulerConfig
    from loraplex.server.engine.engine import Engine
    from loraplex.server.engine.request import SamplingParams
    from tests.helpers import make_model, random_prompts

    model = make_model(tmp_path / "m", "llama", seed=5)
    prompts = random_prompts(4, seed=2, low=5, high=30)

    def generate():
        engine = Engine(EngineConfig(model=str(model), num_pages=64, dtype=dtype,
                                     scheduler=SchedulerConfig(page_size=4)))
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6, ignore_eos=True,
                                                          logprobs=2, prompt_logprobs=1))
        got: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += [out.new_token_ids, out.logprobs, out.prompt_logprobs]
        return got

    with_native = generate()
    # only the elementwise ops go back to torch: the other native kernels (decode attention,
    # LoRA) sum in another order than torch's and are tested against it with tolerances
    assert native._loaded.get("elementwise") is not None
    monkeypatch.setitem(native._loaded, "elementwise", None)
    assert generate() == with_native


def _gcc() -> str | None:
    import shutil
    import subprocess
    cc = native._compiler()
    if cc is None or shutil.which(cc) is None:
        return None
    out = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    return cc if "Free Software Foundation" in out and "clang" not in out else None


@pytest.mark.parametrize("march", ["haswell", "znver3", "sapphirerapids"])
def test_silu_and_mul_loops_vectorise_on_avx2_and_avx512(tmp_path, march):
    """Both SiLU loops (float32, bf16) are vectorised by GCC for an AVX2 CPU and an AVX-512
    one. They once were only with AVX-512: on AVX2 a forced 512-bit preferred width left no
    vector type, and FP compares that may trap kept Sleef's selects from being if-converted,
    so SiLU * up ran scalar (24 ms for 1536 x 1536 on Zen 3, 4.5 ms vectorised)."""
    cc = _gcc()
    if cc is None:
        pytest.skip("needs GCC (its -fopt-info report)")
    lines = source("elementwise").read_text().splitlines()
    loops = [i + 1 for i, line in enumerate(lines)
             if "for (int64_t j = done; j < vec_end; j++)" in line]
    assert len(loops) == 2, "the float32 and bf16 vector-body loops of SiLU"
    report = cross_build(cc, "elementwise", march, tmp_path / "e.so",
                         "-fopt-info-vec-optimized", no_warnings=False)
    vectorised = {int(m.split(":")[1]) for m in report.splitlines()
                  if "loop vectorized" in m and "elementwise.c:" in m}
    for line in loops:
        assert line in vectorised, f"SiLU loop at elementwise.c:{line} not vectorised ({march})"


def _torch_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.max(dim=-1)


@pytest.mark.parametrize("n", [1, 7, 64, 133, 1000, 32000])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_row_argmax_is_torch_max(n, rows, threads):
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(n * 1000 + rows)
    x = torch.randn(rows, n, generator=gen)
    # ties: the maximum again later in the row (and, in some rows, earlier too): first index
    for r in range(rows):
        if n > 2 and r % 2 == 0:
            top = int(x[r].argmax())
            x[r, torch.randint(0, n, (3,), generator=gen)] = float(x[r, top])
    if rows > 2 and n > 3:
        x[1] = float("-inf")  # every token masked: -inf at index 0
        x[2, n // 2] = float("inf")
        x[2, n - 1] = float("inf")
    maxes, index = cpu_elementwise.row_argmax(x)
    expected_max, expected_index = _torch_max(x)
    torch.testing.assert_close(maxes, expected_max, rtol=0, atol=0)
    assert torch.equal(index, expected_index)


def test_row_argmax_nan_rows_strided_rows_and_refusals():
    x = torch.randn(6, 200)
    x[0, 150] = float("nan")  # past the vector body's first block
    x[1, 3] = float("nan")
    x[1, 190] = float("nan")  # in the tail
    x[2, 199] = float("nan")
    x[3, 100] = float("inf")
    x[3, 101] = float("nan")
    maxes, index = cpu_elementwise.row_argmax(x)
    assert maxes[:4].isnan().all() and index[:4].tolist() == [150, 3, 199, 101]
    expected_max, expected_index = x.max(dim=-1)
    assert expected_max[:4].isnan().all()
    torch.testing.assert_close(maxes[4:], expected_max[4:], rtol=0, atol=0)
    assert torch.equal(index[4:], expected_index[4:])
    # rows `stride` apart (a column slice), the last columns never read
    wide = torch.randn(4, 150)
    wide[:, 130:] = 1e9
    view = wide[:, :130]
    maxes, index = cpu_elementwise.row_argmax(view)
    expected_max, expected_index = view.max(dim=-1)
    assert torch.equal(maxes, expected_max) and torch.equal(index, expected_index)
    # what it does not take: the caller runs torch.max
    assert cpu_elementwise.row_argmax(torch.randn(4, 8).bfloat16()) is None
    assert cpu_elementwise.row_argmax(torch.randn(4, 8).t()) is None
    assert cpu_elementwise.row_argmax(torch.randn(8)) is None
    assert cpu_elementwise.row_argmax(torch.randn(3, 0)) is None


def test_greedy_sampling_takes_the_native_argmax(monkeypatch):
    """The sampler's greedy tokens come from row_argmax on the CPU (ties: the first index),
    and are the same when the native kernels are off (torch.max)."""
    from loraplex.server.engine import sampler as sampler_module
    from loraplex.server.engine.request import Request, SamplingParams

    calls = []
    real = sampler_module.row_argmax
    monkeypatch.setattr(sampler_module, "row_argmax", lambda x: calls.append(x) or real(x))
    logits = torch.randn(3, 500)
    logits[0, 7] = logits[0, 300] = 50.0  # a tie: token 7
    logits[2] = float("nan")  # a row that cannot be sampled
    reqs = [Request(request_id=f"r{i}", prompt_token_ids=[1, 2],
                    params=SamplingParams(max_tokens=4)) for i in range(3)]
    meta = sampler_module.SamplingMetadata.from_requests(reqs, 500)
    out = sampler_module.sample(logits, meta)
    assert len(calls) == 1
    assert out.token_ids[:2] == [7, int(logits[1].argmax())] and out.failed_rows == (2,)
    monkeypatch.setattr(sampler_module, "row_argmax", lambda x: None)
    off = sampler_module.sample(logits, meta)
    assert off.token_ids[:2] == out.token_ids[:2] and off.failed_rows == out.failed_rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_over_every_bf16_gate_and_a_dense_float32_sweep(dtype):
    """Every bf16 gate value (NaN, inf and subnormals among them), and float32 gates every
    ~3e-5 across [-110, 110] (both ends of exp's fast range, -g in [-104, 100], inside): random
    gates alone miss a single FMA computed as a product and a sum (a change in one element of a
    few thousand)."""
    if dtype == torch.bfloat16:
        gate = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16)
        gate = gate.view(torch.bfloat16).reshape(64, 1024)
    else:
        gate = torch.linspace(-110, 110, 4096 * 2048).reshape(4096, 2048)
    up = torch.randn(gate.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    gate_up = torch.cat([gate, up], dim=1)
    got = cpu_elementwise.silu_and_mul(gate_up)
    want = _one_thread(_silu_mul_torch, gate_up)
    _close(got, want)
