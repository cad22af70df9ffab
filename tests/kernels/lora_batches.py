"""Mixed-adapter LoRA batches for the kernel tests: adapters of mixed rank written into a
shuffled page pool, requests assigned to adapters by a popularity pattern, and the dense
oracle built from the plain ``A`` / ``B`` tensors."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from loraplex.kernels.layout import adapter_layout, write_region

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PATTERNS = ("distinct", "uniform", "zipf", "identical", "skewed")
# 1 and 64 are the extremes the issue asks for; the rest are odd or unaligned on purpose
RANKS = (64, 1, 16, 7, 33, 2, 48, 8, 3, 24)
MODULE = "proj"


@dataclass
class LoraBatch:
    x: torch.Tensor           # [T, d_in]
    pool: torch.Tensor        # [num_pages, page_elems]
    page_table: torch.Tensor  # [S, max_pages] int32
    seg_indptr: torch.Tensor  # [S+1] int32
    ranks: torch.Tensor       # [S] int32
    a_offsets: torch.Tensor   # [S] int64
    b_offsets: torch.Tensor   # [S] int64
    scales: torch.Tensor      # [S] float32
    max_rank: int
    d_out: int
    a: list[torch.Tensor | None]  # per segment [r, d_in] (None: base model)
    b: list[torch.Tensor | None]  # per segment [d_out, r]

    @property
    def num_segments(self) -> int:
        return len(self.a)

    def dense_shrink(self) -> torch.Tensor:
        """``h`` from the plain tensors: ``x @ A.T`` per segment, float32."""
        h = torch.zeros(self.x.shape[0], self.max_rank, dtype=torch.float32, device=DEVICE)
        bounds = self.seg_indptr.tolist()
        for s, a in enumerate(self.a):
            if a is not None:
                rows = slice(bounds[s], bounds[s + 1])
                h[rows, : a.shape[0]] = self.x[rows].double() @ a.double().T
        return h

    def dense_expand(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y + scale * h @ B.T`` per segment, ``h`` rounded to the weights' dtype first."""
        out = y.double()
        bounds = self.seg_indptr.tolist()
        for s, b in enumerate(self.b):
            if b is not None:
                rows = slice(bounds[s], bounds[s + 1])
                hs = h[rows, : b.shape[1]].to(self.pool.dtype).double()
                out[rows] += self.scales[s].item() * hs @ b.double().T
        return out.to(y.dtype)


def assign_adapters(pattern: str, num_requests: int, rng: random.Random) -> list[int]:
    """Adapter index of each request under a popularity pattern (Punica's five)."""
    if pattern == "distinct":
        return list(range(num_requests))
    if pattern == "identical":
        return [0] * num_requests
    if pattern == "uniform":
        return [rng.randrange(max(2, num_requests // 2)) for _ in range(num_requests)]
    if pattern == "zipf":
        weights = [1 / (i + 1) ** 1.5 for i in range(num_requests)]
        return rng.choices(range(num_requests), weights, k=num_requests)
    if pattern == "skewed":  # one hot adapter, a tail of adapters with one request each
        hot = num_requests - max(1, num_requests // 4)
        return [0] * hot + list(range(1, num_requests - hot + 1))
    raise ValueError(pattern)


def make_batch(pattern: str, tokens: list[int], d_in: int, d_out: int, page_elems: int,
               dtype: torch.dtype = torch.float32, base_every: int = 5,
               merge: bool = True, seed: int = 0) -> LoraBatch:
    """Requests with ``tokens[i]`` tokens each; every ``base_every``-th uses the base model.

    With ``merge``, requests of one adapter form one segment; without, every request is its
    own segment (segments then share page-table rows).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    adapter_of = assign_adapters(pattern, len(tokens), rng)
    adapter_of = [-1 if base_every and i % base_every == base_every - 1 else a
                  for i, a in enumerate(adapter_of)]
    order = sorted(range(len(tokens)), key=lambda i: adapter_of[i])
    used = sorted({a for a in adapter_of if a >= 0})
    shapes = {MODULE: (d_in, d_out)}
    layouts = {a: adapter_layout(RANKS[a % len(RANKS)], [MODULE], shapes) for a in used}
    num_pages = sum(lay.num_pages(page_elems) for lay in layouts.values()) + 3
    free = list(range(num_pages))
    rng.shuffle(free)  # an adapter's pages are neither contiguous nor in order
    pool = torch.randn(num_pages, page_elems, generator=gen).to(dtype)  # garbage between blocks
    pages: dict[int, list[int]] = {}
    weights: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for a in used:
        lay = layouts[a]
        pages[a] = [free.pop() for _ in range(lay.num_pages(page_elems))]
        a_w = (torch.randn(lay.rank, d_in, generator=gen) / d_in ** 0.5).to(dtype)
        b_w = torch.randn(d_out, lay.rank, generator=gen).to(dtype)
        scale = 0.5 + torch.rand(1, generator=gen).item()
        write_region(pool, pages[a], lay.a_offsets[MODULE], a_w)
        write_region(pool, pages[a], lay.b_offsets[MODULE], b_w.T.contiguous())
        weights[a] = (a_w, b_w, scale)
    segments: list[tuple[int, int]] = []  # (adapter, tokens)
    for i in order:
        if merge and segments and segments[-1][0] == adapter_of[i]:
            segments[-1] = (adapter_of[i], segments[-1][1] + tokens[i])
        else:
            segments.append((adapter_of[i], tokens[i]))
    max_pages = max([len(p) for p in pages.values()] + [1])
    table = torch.zeros(len(segments), max_pages, dtype=torch.int32)
    indptr, ranks, a_off, b_off, scales, a_list, b_list = [0], [], [], [], [], [], []
    for s, (a, n) in enumerate(segments):
        indptr.append(indptr[-1] + n)
        if a < 0:
            ranks.append(0)
            a_off.append(0)
            b_off.append(0)
            scales.append(0.0)
            a_list.append(None)
            b_list.append(None)
            continue
        table[s, : len(pages[a])] = torch.tensor(pages[a], dtype=torch.int32)
        ranks.append(layouts[a].rank)
        a_off.append(layouts[a].a_offsets[MODULE])
        b_off.append(layouts[a].b_offsets[MODULE])
        scales.append(weights[a][2])
        a_list.append(weights[a][0].to(DEVICE))
        b_list.append(weights[a][1].to(DEVICE))
    x = torch.randn(indptr[-1], d_in, generator=gen).to(dtype)
    return LoraBatch(
        x=x.to(DEVICE), pool=pool.to(DEVICE), page_table=table.to(DEVICE),
        seg_indptr=torch.tensor(indptr, dtype=torch.int32, device=DEVICE),
        ranks=torch.tensor(ranks, dtype=torch.int32, device=DEVICE),
        a_offsets=torch.tensor(a_off, dtype=torch.int64, device=DEVICE),
        b_offsets=torch.tensor(b_off, dtype=torch.int64, device=DEVICE),
        scales=torch.tensor(scales, dtype=torch.float32, device=DEVICE),
        max_rank=max(ranks + [1]), d_out=d_out, a=a_list, b=b_list)
