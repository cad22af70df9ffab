"""The Triton paged attention and KV write against the torch references (interpreter on CPU,
native on a GPU): decode with GQA and key splits, prefill tiles with the causal mask, mixed
steps, shuffled pages, head sizes that are not powers of two."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from loraplex.kernels import paged_attention as pa
from loraplex.kernels import reference
from loraplex.kernels.layout import kv_page_elems
from loraplex.kernels.metadata import AttentionMetadata
from loraplex.kernels.paged_attention import AttentionPlan, plan_attention
from tests.kernels.lora_batches import DEVICE

# Per dtype (rtol, atol, why). The oracle is the reference run in float32 on the same stored
# values; the kernel keeps scores, softmax sums and the output accumulator in float32.
TOLERANCE = {
    torch.float32: (1e-5, 1e-5, "exp2 with a folded log2(e) and online rescaling against one "
                                "softmax: a few ulp"),
    torch.float16: (4e-3, 4e-3, "probabilities rounded to fp16 for the PV dot and the output "
                                "to fp16: 2**-11 relative each, on outputs of magnitude <= 2"),
    torch.bfloat16: (3e-2, 3e-2, "GPU only: as fp16 with bf16's 2**-8 rounding"),
}


def make_step(q_lens: list[int], ctx_lens: list[int], page_size: int, num_heads: int,
              num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(q, pool with every token's K/V written, metadata) for one step."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_pages = sum(-(-(n + c) // page_size) for n, c in zip(q_lens, ctx_lens)) + 5
    elems = kv_page_elems(page_size, num_kv_heads, head_dim)
    pool = torch.randn(num_pages, elems, generator=gen).to(dtype)  # garbage in unused slots
    free = list(range(num_pages))
    rng.shuffle(free)  # a sequence's pages are neither contiguous nor in order
    tables = [[free.pop() for _ in range(-(-(n + c) // page_size))]
              for n, c in zip(q_lens, ctx_lens)]
    seq_lens = [n + c for n, c in zip(q_lens, ctx_lens)]
    k = torch.randn(sum(seq_lens), num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(sum(seq_lens), num_kv_heads, head_dim, generator=gen).to(dtype)
    all_tokens = AttentionMetadata.build(tables, seq_lens, seq_lens, page_size)
    reference.write_kv(pool, k, v, all_tokens.slot_mapping, page_size)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build(tables, q_lens, seq_lens, page_size, device=DEVICE)
    return q.to(DEVICE), pool.to(DEVICE), meta


STEPS = {
    # name: (q_lens, ctx_lens, page_size, num_heads, num_kv_heads, head_dim, plan)
    "decode_gqa3": ([1, 1, 1], [0, 5, 40], 4, 6, 2, 24, None),
    "decode_split": ([1, 1, 1], [0, 5, 140], 4, 6, 2, 24, AttentionPlan(16, 64, 4)),
    "decode_gqa8": ([1, 1], [3, 70], 16, 8, 1, 32, AttentionPlan(16, 64, 3)),
    "mixed": ([7, 1, 13, 1], [0, 9, 20, 31], 4, 6, 2, 24, None),
    "prefill_tiles": ([33, 20], [0, 17], 4, 4, 4, 16, AttentionPlan(16, 16, 1)),
    "prefill133": ([133], [0], 16, 4, 2, 16, None),
    "odd7": ([3, 1, 3], [2, 11, 0], 8, 2, 1, 40, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("step", list(STEPS))
def test_paged_attention_matches_reference(step: str, dtype: torch.dtype) -> None:
    q_lens, ctx_lens, page_size, num_heads, num_kv_heads, head_dim, plan = STEPS[step]
    q, pool, meta = make_step(q_lens, ctx_lens, page_size, num_heads, num_kv_heads, head_dim,
                              dtype)
    scale = head_dim ** -0.5
    out = pa.paged_attention(q, pool, meta, page_size, num_kv_heads, scale, plan=plan)
    expected = reference.paged_attention(q.float(), pool.float(), meta, page_size,
                                         num_kv_heads, scale)
    rtol, atol, _ = TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference(dtype: torch.dtype) -> None:
    page_size, num_kv_heads, head_dim = 4, 2, 24
    pool = torch.randn(9, kv_page_elems(page_size, num_kv_heads, head_dim), device=DEVICE)
    pool = pool.to(dtype)
    # k and v as views of a fused qkv projection: strided rows
    qkv = torch.randn(7, 3 * num_kv_heads, head_dim, device=DEVICE).to(dtype)
    k, v = qkv[:, num_kv_heads: 2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    slots = torch.tensor([33, 0, 5, 6, 7, 8, 21], dtype=torch.int64, device=DEVICE)
    expected = pool.clone()
    reference.write_kv(expected, k, v, slots, page_size)
    pa.write_kv(pool, k, v, slots, page_size)
    assert torch.equal(pool, expected)


def test_plans() -> None:
    # many sequences fill the device: no key split
    assert plan_attention(256, 8, 128, 4096, torch.bfloat16, 132).num_splits == 1
    # one long sequence: split its keys
    assert plan_attention(1, 8, 128, 32768, torch.bfloat16, 132).num_splits > 1
    # short sequences never split below 256 keys a split
    assert plan_attention(1, 8, 128, 300, torch.bfloat16, 132).num_splits == 1
    # heads of 256 and float32 take 32 x 32 tiles (no spills on sm_90: see sm90_compile.py)
    assert plan_attention(4, 8, 256, 4096, torch.bfloat16, 132).block_n == 32
    plan = plan_attention(64, 1, 64, 100, torch.float32, 4)
    assert (plan.block_n, plan.block_m, plan.num_warps) == (32, 32, 8)
    with pytest.raises(ValueError, match="block_n"):
        dataclasses.replace(AttentionPlan(), block_n=8)
    with pytest.raises(ValueError, match="num_splits"):
        dataclasses.replace(AttentionPlan(), num_splits=0)


def _attention_args() -> dict[str, object]:
    q, pool, meta = make_step([2, 1], [3, 4], 4, 4, 2, 16, torch.float32)
    return dict(q=q, kv_pool=pool, meta=meta, page_size=4, num_kv_heads=2, scale=0.25)


@pytest.mark.parametrize("name,bad,match", [
    ("q", lambda t: t.half(), "q: expected dtype"),
    ("q", lambda t: t[:, :, None], "q: expected"),
    ("q", lambda t: t[:-1], "query lengths sum"),
    ("kv_pool", lambda t: t[:, :-1], "kv_pool: expected"),
    ("kv_pool", lambda t: t.double(), "kv_pool: expected dtype"),
    ("num_kv_heads", lambda n: 3, "must divide"),
    ("meta", lambda m: dataclasses.replace(m, seq_lens=m.seq_lens.long()), "seq_lens"),
    ("meta", lambda m: dataclasses.replace(m, page_table=m.page_table[:1]), "page_table"),
    ("meta", lambda m: dataclasses.replace(m, query_start=m.query_start[:-1]), "query_start"),
])
def test_paged_attention_refuses_bad_arguments(name: str, bad, match: str) -> None:
    args = _attention_args()
    args[name] = bad(args[name])
    with pytest.raises(ValueError, match=match):
        pa.paged_attention(**args)


def test_write_kv_refuses_bad_arguments() -> None:
    pool = torch.zeros(4, kv_page_elems(4, 2, 16), device=DEVICE)
    k = torch.zeros(3, 2, 16, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping: expected dtype"):
        pa.write_kv(pool, k, k, slots.int(), 4)
    with pytest.raises(ValueError, match="v: expected"):
        pa.write_kv(pool, k, k[:2], slots, 4)
    with pytest.raises(ValueError, match="kv_pool: expected"):
        pa.write_kv(pool, k, k, slots, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([1] * 64, [random.Random(s).randrange(1, 3000) for s in range(64)]),  # decode
    ([1], [20000]),                                                        # split keys
    ([512, 1, 1, 300], [0, 1000, 17, 4000]),                               # mixed
])
def test_paged_attention_bf16_on_gpu(q_lens: list[int], ctx_lens: list[int]) -> None:
    q, pool, meta = make_step(q_lens, ctx_lens, 16, 32, 8, 128, torch.bfloat16)
    out = pa.paged_attention(q, pool, meta, 16, 8, 128 ** -0.5)
    expected = reference.paged_attention(q.float(), pool.float(), meta, 16, 8, 128 ** -0.5)
    rtol, atol, _ = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)
