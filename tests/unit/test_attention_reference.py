"""The paged attention reference against dense causal attention on contiguous K/V."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.kernels import reference
from loraplex.kernels.layout import kv_page_elems
from loraplex.kernels.metadata import AttentionMetadata


def dense_attention(q, k, v, n_ctx, scale):
    # q: [n, Hq, D] at positions n_ctx .. n_ctx + n - 1; k, v: [n_ctx + n, Hkv, D]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(n_ctx, n_ctx + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([1, 1, 1], [0, 5, 40]),          # pure decode
    ([7, 1, 13, 1], [0, 9, 20, 31]),  # mixed prefill chunks and decodes
    ([33], [0]),                      # one prompt spanning several pages
    ([1] * 19 + [5], [(5 * i) % 13 for i in range(19)] + [3]),  # decodes in two groups
])
# NaN: pages still hold what a failed request left (its pages are reused, and page 0 pads the
# page tables); slots past a sequence's end must never reach its output, even times 0.
@pytest.mark.parametrize("stale", [0.0, float("nan")])
def test_paged_attention_matches_dense(q_lens, ctx_lens, stale):
    torch.manual_seed(0)
    rng = random.Random(0)
    page_size, num_heads, num_kv_heads, head_dim = 4, 6, 2, 8
    num_pages = 64
    pool = torch.full((num_pages, kv_page_elems(page_size, num_kv_heads, head_dim)), stale)
    free = list(range(num_pages))
    rng.shuffle(free)  # pages of one sequence are deliberately not contiguous
    tables, seq_lens, ks, vs, qs = [], [], [], [], []
    for n, ctx in zip(q_lens, ctx_lens):
        total = n + ctx
        pages = [free.pop() for _ in range(-(-total // page_size))]
        tables.append(pages)
        seq_lens.append(total)
        ks.append(torch.randn(total, num_kv_heads, head_dim))
        vs.append(torch.randn(total, num_kv_heads, head_dim))
        qs.append(torch.randn(n, num_heads, head_dim))
    # write every token's K/V (context and new) through the same slot mapping the engine uses
    ctx_meta = AttentionMetadata.build(tables, seq_lens, seq_lens, page_size)
    reference.write_kv(pool, torch.cat(ks), torch.cat(vs), ctx_meta.slot_mapping, page_size)
    meta = AttentionMetadata.build(tables, q_lens, seq_lens, page_size)
    out = reference.paged_attention(torch.cat(qs), pool, meta, page_size, num_kv_heads,
                                    scale=head_dim ** -0.5)
    expected = torch.cat([dense_attention(q, k, v, ctx, head_dim ** -0.5)
                          for q, k, v, ctx in zip(qs, ks, vs, ctx_lens)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_metadata_refuses_too_few_pages():
    with pytest.raises(ValueError, match="do not fit"):
        AttentionMetadata.build([[0]], [5], [5], page_size=4)
