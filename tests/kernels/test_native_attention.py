"""The native decode attention (``loraplex/kernels/csrc/decode_attention.c`` through
``loraplex/kernels/cpu_native.py``) against the plain reference: random steps with mixed lengths,
GQA, head sizes on and off the fast paths, two page sizes, stale NaN in every slot no sequence owns,
prefill rows in the same step, one and two threads; and the torch path it falls back to."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from loraplex.kernels import cpu, cpu_native, native, reference
from loraplex.kernels.layout import kv_page_elems
from loraplex.kernels.metadata import AttentionMetadata
from tests.kernels.cross_build import cross_build
from tests.kernels.test_cpu import ATTENTION_TOLERANCE, paged_step

# Per dtype (rtol, atol, why), against the reference in float32 on the same stored values.
TOLERANCE = {
    # scores, softmax and sums in float32 in another order (and a polynomial exp within 2 ulp
    # of expf): a few ulp, on outputs of magnitude <= ~3
    torch.float32: (1e-5, 1e-6, "float32 in another summation order: ulps"),
    # everything in float32 on the bf16 values, rounded to bf16 once at the end: half a bf16
    # ulp (2**-9 relative) plus float32 ulps, so within one ulp (2**-8) of the float32 oracle
    torch.bfloat16: (2.0 ** -8, 1e-6, "one rounding of a float32 result to bf16"),
}


def _step(rng: random.Random, gen: torch.Generator, dtype: torch.dtype, *, group: int,
          head_dim: int, page_size: int, prefill: bool
          ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int]:
    num_kv_heads = rng.choice([1, 2, 3])
    # lengths 1 and 7 (one partial page), 133 (an odd page count at both page sizes), random
    lens = [1, 7, 133] + [rng.randint(1, 200) for _ in range(rng.randint(1, 12))]
    q_lens = [1] * len(lens)
    if prefill:  # prefill chunks (one a whole prompt, one on top of a cached context)
        q_lens += [rng.randint(2, 30), rng.randint(2, 30)]
        lens += [q_lens[-2], q_lens[-1] + rng.randint(1, 60)]
    order = list(range(len(lens)))
    rng.shuffle(order)
    q_lens, lens = [q_lens[i] for i in order], [lens[i] for i in order]
    q, pool, meta = paged_step(rng, gen, dtype, q_lens, lens, page_size, num_kv_heads, group,
                               head_dim, spare_pages=5)
    return q, pool, meta, num_kv_heads


def _native_or_skip(kernel: str = "decode_attention") -> None:
    if native.library(kernel) is None:
        pytest.skip("native kernels unavailable (no C compiler or LORAPLEX_NATIVE_KERNELS=0)")


@pytest.fixture()
def no_torch_decode(monkeypatch):
    """Fail if the torch decode path runs: these tests are about the native one."""
    def refuse(*args, **kwargs):
        raise AssertionError("the torch decode path ran")
    monkeypatch.setattr(cpu, "_decode", refuse)


CASES = [  # (group, head_dim, page_size); 80 and 96: multiples of 16 off the bf16 fast paths
    (1, 64, 16), (3, 64, 32), (4, 64, 16), (3, 40, 16), (4, 72, 32), (1, 128, 32), (3, 128, 16),
    (2, 80, 16), (1, 96, 32),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[f"g{g}-d{d}-p{p}" for g, d, p in CASES])
def test_matches_reference(case: tuple[int, int, int], dtype: torch.dtype, prefill: bool,
                           threads: int, no_torch_decode) -> None:
    _native_or_skip()
    group, head_dim, page_size = case
    seed = CASES.index(case) * 4 + 2 * (dtype == torch.bfloat16) + prefill
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    q, pool, meta, num_kv_heads = _step(rng, gen, dtype, group=group, head_dim=head_dim,
                                        page_size=page_size, prefill=prefill)
    scale = head_dim ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu.paged_attention(q, pool, meta, page_size, num_kv_heads, scale)
    finally:
        torch.set_num_threads(before)
    expected = reference.paged_attention(q.float(), pool.float(), meta, page_size,
                                         num_kv_heads, scale)
    assert out.dtype == dtype and out.isfinite().all()
    starts = meta.query_start.tolist()
    decode = [starts[s] for s, n in enumerate(meta.q_lens) if n == 1]
    prefill_rows = [t for s, n in enumerate(meta.q_lens) if n > 1
                    for t in range(starts[s], starts[s] + n)]
    rtol, atol, _ = TOLERANCE[dtype]
    torch.testing.assert_close(out[decode].float(), expected[decode], rtol=rtol, atol=atol)
    # prefill rows: the native prefill kernel or, for head sizes off its paths (40, 72), SDPA:
    # test_cpu's tolerance, the looser of the two (bf16 probabilities rounded in SDPA)
    rtol, atol, _ = ATTENTION_TOLERANCE[dtype]
    torch.testing.assert_close(out[prefill_rows].float(), expected[prefill_rows], rtol=rtol,
                               atol=atol)
    # the next layer of the step reuses the cached per-step arrays: the same result
    assert torch.equal(cpu.paged_attention(q, pool, meta, page_size, num_kv_heads, scale), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [16, 32])
def test_mha_rows_of_4_kib_or_more(kv_heads: int, dtype: torch.dtype, no_torch_decode) -> None:
    # An MHA model's rows (16 or 32 KV heads x 64: 4 or 8 KiB a token in float32): the prefetch
    # path chosen by the CPU (rows_into_l1: one line in four into L2, or every line into L1;
    # in bf16 on AVX512-BF16 attend_pairs, on Zen 5 its K-then-V sweeps, mha_block_pairs),
    # whole-token tasks (>= 4 sequences a thread), several pages each and a next task to
    # prefetch; the same bits at one and two threads
    _native_or_skip()
    rng, gen = random.Random(kv_heads), torch.Generator().manual_seed(kv_heads)
    lens = [1, 16, 17, 70] + [rng.randint(1, 90) for _ in range(6)]
    q, pool, meta = paged_step(rng, gen, dtype, [1] * len(lens), lens, 16, kv_heads, 1,
                               64, spare_pages=3)
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(cpu.paged_attention(q, pool, dataclasses.replace(meta, derived={}), 16,
                                            kv_heads, 0.125))
    finally:
        torch.set_num_threads(before)
    expected = reference.paged_attention(q.float(), pool.float(), meta, 16, kv_heads, 0.125)
    rtol, atol, _ = TOLERANCE[dtype]
    torch.testing.assert_close(outs[0].float(), expected, rtol=rtol, atol=atol)
    assert torch.equal(outs[0], outs[1])


def test_writes_only_decode_rows_and_reads_no_stale_slot(no_torch_decode) -> None:
    # A single 5-token sequence on a 16-slot page whose other 11 slots hold inf and NaN:
    # reading any of them would make the result non-finite.
    _native_or_skip()
    page_size, num_kv_heads, head_dim = 16, 2, 64
    pool = torch.full((3, kv_page_elems(page_size, num_kv_heads, head_dim)), float("inf"))
    pool[:, 1::2] = float("nan")
    k, v = torch.randn(5, num_kv_heads, head_dim), torch.randn(5, num_kv_heads, head_dim)
    written = AttentionMetadata.build([[2]], [5], [5], page_size)
    reference.write_kv(pool, k, v, written.slot_mapping, page_size)
    meta = AttentionMetadata.build([[2]], [1], [5], page_size)
    q = torch.randn(1, num_kv_heads * 3, head_dim)
    out = torch.full_like(q, 7.0)
    assert cpu_native.decode(q, pool, meta, [0], [0, 1], out, page_size, num_kv_heads, 0.125)
    expected = reference.paged_attention(q, pool, meta, page_size, num_kv_heads, 0.125)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_disabled_takes_the_torch_path_with_the_same_result(monkeypatch) -> None:
    _native_or_skip()
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    q, pool, meta, num_kv_heads = _step(rng, gen, torch.float32, group=3, head_dim=64,
                                        page_size=16, prefill=True)
    native_out = cpu.paged_attention(q, pool, meta, 16, num_kv_heads, 0.125)

    monkeypatch.setenv("LORAPLEX_NATIVE_KERNELS", "0")
    monkeypatch.setattr(native, "_loaded", {})  # a fresh process's loader
    ran = []
    torch_decode = cpu._decode
    monkeypatch.setattr(cpu, "_decode", lambda *a, **kw: ran.append(1) or torch_decode(*a, **kw))
    meta = dataclasses.replace(meta, derived={})  # a fresh step: nothing cached
    torch_out = cpu.paged_attention(q, pool, meta, 16, num_kv_heads, 0.125)
    # both attention kernels off (the step has decode and prefill rows): the torch paths
    assert ran and native.library("decode_attention") is None
    assert native.library("prefill_attention") is None
    assert not cpu_native.decode(q, pool, meta, [0], [0, 1], torch.empty_like(q), 16,
                                 num_kv_heads, 0.125)
    rtol, atol, _ = TOLERANCE[torch.float32]
    torch.testing.assert_close(torch_out, native_out, rtol=rtol, atol=atol)


def test_unsupported_inputs_fall_back(no_torch_decode) -> None:
    # float16 and strided queries are not the C kernel's: it declines and writes nothing.
    _native_or_skip()
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    q, pool, meta, num_kv_heads = _step(rng, gen, torch.float32, group=2, head_dim=40,
                                        page_size=16, prefill=False)
    rows = list(range(meta.num_seqs))
    starts = list(range(meta.num_seqs + 1))
    out = torch.zeros_like(q)
    assert not cpu_native.decode(q.half(), pool.half(), meta, rows, starts, out.half(), 16,
                                 num_kv_heads, 0.1)
    wide = torch.zeros(q.shape[0], q.shape[1], 2 * q.shape[2])
    strided = wide[..., ::2]  # every other element: not the layout the kernel reads
    assert not cpu_native.decode(strided, pool, meta, rows, starts, out, 16, num_kv_heads, 0.1)
    assert not cpu_native.decode(q, pool, meta, rows, starts, out, 32, num_kv_heads, 0.1)
    assert out.eq(0).all()


def test_page_outside_the_pool_is_left_to_the_torch_path() -> None:
    # C reads pages unchecked; a table naming a page the pool lacks must raise (the torch
    # path's IndexError), never read past the pool.
    _native_or_skip()
    pool = torch.zeros(2, kv_page_elems(16, 1, 64))
    meta = AttentionMetadata.build([[5]], [1], [3], 16)
    q = torch.randn(1, 2, 64)
    assert not cpu_native.decode(q, pool, meta, [0], [0, 1], torch.empty_like(q), 16, 1, 0.125)
    with pytest.raises(IndexError):
        cpu.paged_attention(q, pool, meta, 16, 1, 0.125)


@pytest.mark.parametrize("march", ["haswell", "znver3", "sapphirerapids"])
@pytest.mark.parametrize("kernel", ["decode_attention", "prefill_attention"])
def test_builds_in_the_machines_vector_width(tmp_path, kernel: str, march: str) -> None:
    """Each attention kernel builds without a warning for AVX2 and AVX-512 CPUs, and keeps its
    vectors out of general registers. The decode kernel once held its sums in 16-lane (64-byte)
    vectors: on AVX2 those are register pairs, GCC warned that they change the ABI (-Wpsabi),
    kept the V sums' array on the stack and moved it through general registers (205 vpinsrq in
    the Zen 3 build, 2-3.8x slower than with 8-lane vectors)."""
    import shutil
    import subprocess
    cc, objdump = native._compiler(), shutil.which("objdump")
    if cc is None or objdump is None:
        pytest.skip("needs a C compiler and objdump")
    so = tmp_path / f"{kernel}.so"
    cross_build(cc, kernel, march, so)
    code = subprocess.run([objdump, "-d", str(so)], capture_output=True, text=True,
                          check=True).stdout
    assert code.count("vpinsrq") < 20, f"vectors built in general registers ({march})"
