"""The native prefill attention (``loraplex/kernels/csrc/prefill_attention.c`` through
``loraplex/kernels/cpu_native.prefill``) against the plain reference: whole prompts and chunks on
top of a cached context, query counts across the kernel's query blocks (256, 128 or 64 queries:
the largest that leaves each thread four tasks) and its row tiles, GQA,
head sizes on the fast paths (64, 128) and the generic one (80, 16), two page sizes, stale NaN
and inf in every slot no sequence owns, decode rows in the same step, one and two threads; and
where it does not apply (the torch path runs, with the same values; with native kernels off:
test_native_attention.py)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from loraplex.kernels import cpu, cpu_native, reference
from loraplex.kernels.layout import kv_page_elems
from loraplex.kernels.metadata import AttentionMetadata
from tests.kernels.test_cpu import ATTENTION_TOLERANCE, paged_step
from tests.kernels.test_native_attention import TOLERANCE
from tests.kernels.test_native_attention import _native_or_skip as _skip_unless


def _native_or_skip() -> None:
    _skip_unless("prefill_attention")


@pytest.fixture()
def no_torch_prefill(monkeypatch):
    """Fail if the torch prefill path runs: these tests are about the native one."""
    def refuse(*args, **kwargs):
        raise AssertionError("the torch prefill path ran")
    monkeypatch.setattr(cpu, "_prefill_one", refuse)


def _step(rng: random.Random, gen: torch.Generator, dtype: torch.dtype, *, group: int,
          head_dim: int, page_size: int, decodes: bool
          ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int]:
    num_kv_heads = rng.choice([1, 2, 3])
    # whole prompts of 2, 3 (under one row tile), 64 and 65 (a 64-query block, and one more
    # row), 130 (three of them, or one of 256), 300 (two blocks of 256); chunks on top of a
    # cached context; random ones
    q_lens = [2, 3, 64, 65, 130, 300, 5, 70] + [
        rng.randint(2, 90) for _ in range(rng.randint(1, 4))]
    lens = [2, 3, 64, 65, 130, 300, 5 + 37, 70 + 100] + [
        n + rng.choice([0, rng.randint(1, 120)]) for n in q_lens[8:]]
    if decodes:
        q_lens += [1, 1]
        lens += [1, rng.randint(2, 150)]
    order = list(range(len(lens)))
    rng.shuffle(order)
    q_lens, lens = [q_lens[i] for i in order], [lens[i] for i in order]
    q, pool, meta = paged_step(rng, gen, dtype, q_lens, lens, page_size, num_kv_heads, group,
                               head_dim, spare_pages=5)
    return q, pool, meta, num_kv_heads


def _rounds_probs(dtype: torch.dtype, head_dim: int) -> bool:
    # bf16 at head sizes 64 and 128 on a CPU with AVX512-BF16: pair dot products, the
    # softmax's terms rounded to bf16 before P V (elsewhere float32 arithmetic throughout)
    return (dtype == torch.bfloat16 and head_dim in (64, 128)
            and cpu_native.prefill_rounds_bf16_probs())


def _assert_close_rounded_probs(out: torch.Tensor, expected: torch.Tensor, rtol: float,
                                atol: float) -> None:
    # Against the reference with the terms rounded the same way: a term on a bf16 rounding
    # boundary may round the other way (its score summed in another order), which moves a few
    # outputs in 10^4 past one rounding of the result (measured: at most 0.013%, by 0.002).
    # Against the float32 reference about 23% of the outputs are past it.
    err = (out - expected).abs()
    beyond = err > atol + rtol * expected.abs()
    assert beyond.float().mean().item() <= 1e-3, f"{beyond.float().mean().item():.4%} beyond"
    torch.testing.assert_close(out, expected, rtol=rtol, atol=2.0 ** -8)


CASES = [  # (group, head_dim, page_size)
    (1, 64, 16), (3, 64, 32), (4, 64, 16), (1, 128, 32), (3, 128, 16), (2, 80, 16), (3, 16, 32),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("decodes", [False, True], ids=["prefill", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[f"g{g}-d{d}-p{p}" for g, d, p in CASES])
def test_matches_reference(case: tuple[int, int, int], dtype: torch.dtype, decodes: bool,
                           threads: int) -> None:
    _native_or_skip()
    group, head_dim, page_size = case
    seed = 100 + CASES.index(case) * 4 + 2 * (dtype == torch.bfloat16) + decodes
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    q, pool, meta, num_kv_heads = _step(rng, gen, dtype, group=group, head_dim=head_dim,
                                        page_size=page_size, decodes=decodes)
    scale = head_dim ** -0.5
    rows = [s for s, n in enumerate(meta.q_lens) if n > 1]
    starts = meta.query_start.tolist()
    out = torch.full_like(q, 7.0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:  # the kernel itself, on every prefill sequence (the engine's routing: below)
        assert cpu_native.prefill(q, pool, meta, rows, starts, out, page_size, num_kv_heads,
                                  scale)
        again = torch.full_like(q, 7.0)  # the next layer reuses the cached per-step arrays
        assert cpu_native.prefill(q, pool, meta, rows, starts, again, page_size, num_kv_heads,
                                  scale)
    finally:
        torch.set_num_threads(before)
    pairs = _rounds_probs(dtype, head_dim)
    expected = reference.paged_attention(q.float(), pool.float(), meta, page_size,
                                         num_kv_heads, scale,
                                         round_probs=torch.bfloat16 if pairs else None)
    prefill = [t for s in rows for t in range(starts[s], starts[s + 1])]
    others = [t for t in range(q.shape[0]) if t not in set(prefill)]
    assert out.dtype == dtype and out[prefill].isfinite().all()
    rtol, atol, _ = TOLERANCE[dtype]
    if pairs:
        _assert_close_rounded_probs(out[prefill].float(), expected[prefill], rtol, atol)
    else:
        torch.testing.assert_close(out[prefill].float(), expected[prefill], rtol=rtol,
                                   atol=atol)
    assert torch.equal(again, out)
    assert (out[others] == 7.0).all()  # decode rows are not the kernel's to write


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_long_sequence_on_one_kv_head(dtype: torch.dtype, threads: int) -> None:
    # Too few tasks for two threads in blocks of 256 or 128: it splits into blocks of 64 (one
    # thread: one block of 256 and one of 44), each gathering the keys its last query sees.
    _native_or_skip()
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    q, pool, meta = paged_step(rng, gen, dtype, [300], [300 + 21], 16, 1, 3, 64,
                               spare_pages=2)
    out = torch.full_like(q, 7.0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert cpu_native.prefill(q, pool, meta, [0], meta.query_start.tolist(), out, 16, 1,
                                  0.125)
    finally:
        torch.set_num_threads(before)
    pairs = _rounds_probs(dtype, 64)
    expected = reference.paged_attention(q.float(), pool.float(), meta, 16, 1, 0.125,
                                         round_probs=torch.bfloat16 if pairs else None)
    rtol, atol, _ = TOLERANCE[dtype]
    if pairs:
        _assert_close_rounded_probs(out.float(), expected, rtol, atol)
    else:
        torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("cpu_amx", [True, False], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_routes_long_bf16_sequences_to_sdpa(dtype: torch.dtype, cpu_amx: bool,
                                                       monkeypatch) -> None:
    # float32: every prefill sequence native; bf16 on an AMX CPU: those of up to
    # _BF16_NATIVE_PREFILL_KEYS keys native, longer ones through SDPA (faster there on AMX
    # tiles); bf16 without AMX: every one native (faster at every length measured). The same
    # values either way.
    _native_or_skip()
    limit = cpu._BF16_NATIVE_PREFILL_KEYS
    rng, gen = random.Random(9), torch.Generator().manual_seed(9)
    q, pool, meta = paged_step(rng, gen, dtype, [20, 9, 40, 1], [20, limit, limit + 60, 30],
                               16, 2, 2, 64, 2)
    torch_rows: list[int] = []
    native_rows: list[int] = []
    torch_prefill, native_prefill = cpu._prefill_one, cpu_native.prefill
    monkeypatch.setattr(cpu, "_prefill_one", lambda q_, pool_, pages, seq_len, scale: (
        torch_rows.append(seq_len) or torch_prefill(q_, pool_, pages, seq_len, scale)))
    monkeypatch.setattr(cpu_native, "prefill", lambda *a: (
        native_rows.extend(a[3]) or native_prefill(*a)))
    out = cpu.paged_attention(q, pool, meta, 16, 2, 0.125)
    expected = reference.paged_attention(q.float(), pool.float(), meta, 16, 2, 0.125)
    if dtype == torch.float32 or not cpu_amx:
        assert native_rows == [0, 1, 2] and torch_rows == []
    else:
        assert native_rows == [0, 1] and torch_rows == [limit + 60]
    rtol, atol, _ = ATTENTION_TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_no_stale_slot_and_only_its_rows(dtype: torch.dtype, no_torch_prefill) -> None:
    # A 5-token prompt on a 16-slot page whose other 11 slots hold inf and NaN (reading any of
    # them would make the result non-finite), after a decode row the call must not touch.
    _native_or_skip()
    page_size, num_kv_heads, head_dim = 16, 2, 64
    pool = torch.full((3, kv_page_elems(page_size, num_kv_heads, head_dim)), float("inf"))
    pool[:, 1::2] = float("nan")
    k, v = torch.randn(5, num_kv_heads, head_dim), torch.randn(5, num_kv_heads, head_dim)
    written = AttentionMetadata.build([[2]], [5], [5], page_size)
    reference.write_kv(pool, k, v, written.slot_mapping, page_size)
    pool = pool.to(dtype)  # inf and NaN stay inf and NaN in bf16
    meta = AttentionMetadata.build([[1], [2]], [1, 5], [1, 5], page_size)
    q = torch.randn(6, num_kv_heads * 3, head_dim).to(dtype)
    out = torch.full_like(q, 7.0)
    assert cpu_native.prefill(q, pool, meta, [1], [0, 1, 6], out, page_size, num_kv_heads,
                              0.125)
    pairs = _rounds_probs(dtype, head_dim)
    expected = reference.paged_attention(q[1:].float(), pool.float(), AttentionMetadata.build(
        [[2]], [5], [5], page_size), page_size, num_kv_heads, 0.125,
        round_probs=torch.bfloat16 if pairs else None)
    assert out[1:].isfinite().all() and torch.equal(out[0], torch.full_like(out[0], 7.0))
    rtol, atol, _ = TOLERANCE[dtype]
    if pairs:
        _assert_close_rounded_probs(out[1:].float(), expected, rtol, atol)
    else:
        torch.testing.assert_close(out[1:].float(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_a_later_key_changes_nothing_before_it(dtype: torch.dtype,
                                                      no_torch_prefill) -> None:
    # Query a sees keys 0..a only: overwrite the last key and value with huge values and every
    # earlier query's output must stay bit for bit the same.
    _native_or_skip()
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    q, pool, meta = paged_step(rng, gen, dtype, [70], [70], 16, 2, 2, 64, 2)
    out = cpu.paged_attention(q, pool, meta, 16, 2, 0.125)
    last = meta.slot_mapping[-1].item()
    page, slot = divmod(last, 16)
    view = reference.kv_view(pool, 16, 2)
    view[page, :, slot] = 1e4
    changed = cpu.paged_attention(q, pool, dataclasses.replace(meta, derived={}), 16, 2, 0.125)
    assert torch.equal(changed[:69], out[:69]) and not torch.equal(changed[69], out[69])


@pytest.mark.parametrize("head_dim", [40, 72])
def test_other_head_sizes_take_the_torch_path(head_dim: int, monkeypatch) -> None:
    _native_or_skip()
    rng, gen = random.Random(head_dim), torch.Generator().manual_seed(head_dim)
    q, pool, meta = paged_step(rng, gen, torch.float32, [9, 1], [20, 5], 16, 2, 2, head_dim, 2)
    assert not cpu_native.prefill(q, pool, meta, [0], [0, 9, 10], torch.empty_like(q), 16, 2,
                                  head_dim ** -0.5)
    ran = []
    torch_prefill = cpu._prefill_one
    monkeypatch.setattr(cpu, "_prefill_one",
                        lambda *a, **kw: ran.append(1) or torch_prefill(*a, **kw))
    out = cpu.paged_attention(q, pool, meta, 16, 2, head_dim ** -0.5)
    expected = reference.paged_attention(q, pool, meta, 16, 2, head_dim ** -0.5)
    assert ran == [1]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_query_count_over_its_length_is_a_clear_error() -> None:
    # The engine never asks this; a caller that does gets an error naming the kernel, not a
    # read past the sequence's pages.
    _native_or_skip()
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    q, pool, meta = paged_step(rng, gen, torch.float32, [8], [8], 16, 1, 1, 64, 2)
    bad = dataclasses.replace(meta, seq_lens_host=(4,), derived={})
    with pytest.raises(RuntimeError, match="prefill_attention: bad arguments"):
        cpu_native.prefill(q, pool, bad, [0], [0, 8], torch.empty_like(q), 16, 1, 0.125)
