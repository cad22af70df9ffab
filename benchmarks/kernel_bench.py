"""Kernel benchmarks on one CUDA GPU (issue 4). Prints a markdown table, writes
``bench.json`` and ``bench.md`` into ``--out DIR``; stops starting new cases after
``BUDGET_S`` seconds, so the whole run stays under 5 minutes.

* SGMV shrink / expand, bf16, pages of 32768 elements (a KV page of 16 tokens x 8 heads x 128),
  shuffled: decode (T = 1..256) and prefill (T = 4096) for d = 4096 and 11008, ranks 8, 16,
  64 and a mix of the three, 1 / 16 / 256 distinct adapters. Each case reports the Triton
  kernel's time (CUDA graph replay: kernel time without Python launch overhead) and achieved
  GB/s of the bytes it must move (x or h, the distinct adapters' weights, the output), the
  same bytes moved by a device copy (``copy_frac``: copy time / kernel time), and speedups
  over the torch reference (eager: it syncs) and over gather + bmm with weights padded to the
  maximum rank. All are timed with a hot L2 (one working set, replayed).
* Paged decode attention against ``scaled_dot_product_attention`` on the same K/V gathered
  into contiguous tensors (GQA, the fastest SDPA backend that runs).
* The engine end to end (``kernel_bench_engine.py``, last, in the last ``ENGINE_RESERVE_S`` of the
  budget; ``--no-engine`` skips it): decode tokens/s of a ~1B random Llama with 64 requests,
  each on its own adapter, against the base model. The kernel results are written before it
  starts.

The report (tables, the issue's targets, the files) is ``kernel_bench_report.py``.

Usage: ``python benchmarks/kernel_bench.py --out DIR [--quick] [--no-engine]`` (in a checkout
that is not installed too: it maps ``loraplex`` onto the checkout). Refuses without CUDA.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from kernel_bench_report import Row, environment, write_results

log = logging.getLogger("loraplex.benchmarks.kernel_bench")

PAGE_ELEMS = 2 * 16 * 8 * 128
# a test points these at the CPU and fp16 (the interpreter's bf16 arithmetic is wrong) to
# check the plumbing
DEVICE = "cuda"
DTYPE = torch.bfloat16
BUDGET_S = 270.0  # stop starting new cases past this: the whole run stays under 5 minutes
# the engine benchmark's share of the budget. An estimate, not yet measured on an H200: writing
# the ~1B random model takes ~30 s on the dev CPUs, loading it and compiling the kernels (the
# engine's warm-up) tens of seconds, the timed rounds a few seconds each
ENGINE_RESERVE_S = 100.0


def _bench(fn: Callable[[], Any], graph: bool = True) -> float:
    """Microseconds per call: CUDA-graph replay when it captures, else eager with events."""
    import triton.testing

    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=20) * 1e3
        except Exception:  # e.g. a reference that syncs cannot be captured
            torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=20) * 1e3


def _copy_us(num_bytes: int) -> float:
    src = torch.empty(max(num_bytes // 2, 1), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return _bench(lambda: dst.copy_(src))  # reads and writes num_bytes in all


# --------------------------------------------------------------------------- SGMV


@dataclass
class LoraSetup:
    """Adapters of one configuration written into a shuffled page pool, plus the padded stacks
    the gather + bmm baseline reads."""

    pool: torch.Tensor
    pages: list[torch.Tensor]  # per adapter, int32
    ranks: list[int]
    a_offsets: list[int]
    b_offsets: list[int]
    a_stack: torch.Tensor   # [A, max_rank, d], zero padded
    bt_stack: torch.Tensor  # [A, max_rank, d]


def _lora_setup(d: int, ranks: list[int], gen: torch.Generator) -> LoraSetup:
    from loraplex.kernels.layout import adapter_layout

    layouts = [adapter_layout(r, ["m"], {"m": (d, d)}) for r in ranks]
    counts = [lay.num_pages(PAGE_ELEMS) for lay in layouts]
    regions = torch.zeros(sum(counts), PAGE_ELEMS, dtype=DTYPE, device=DEVICE)
    max_rank = max(ranks)
    a_stack = torch.zeros(len(ranks), max_rank, d, dtype=DTYPE, device=DEVICE)
    bt_stack = torch.zeros_like(a_stack)
    first = 0
    for i, (lay, r) in enumerate(zip(layouts, ranks)):
        flat = regions[first: first + counts[i]].view(-1)
        a = torch.randn(r, d, device=DEVICE, generator=gen) / d ** 0.5
        bt = torch.randn(r, d, device=DEVICE, generator=gen) / r ** 0.5
        flat[lay.a_offsets["m"]: lay.a_offsets["m"] + r * d] = a.flatten().to(DTYPE)
        flat[lay.b_offsets["m"]: lay.b_offsets["m"] + r * d] = bt.flatten().to(DTYPE)
        a_stack[i, :r], bt_stack[i, :r] = a.to(DTYPE), bt.to(DTYPE)
        first += counts[i]
    spare = 8
    order = torch.randperm(first + spare, device=DEVICE, generator=gen)  # pages out of order
    pool = torch.zeros(first + spare, PAGE_ELEMS, dtype=DTYPE, device=DEVICE)
    pool[order[:first]] = regions
    pages, first = [], 0
    for n in counts:
        pages.append(order[first: first + n].int())
        first += n
    return LoraSetup(pool, pages, ranks, [lay.a_offsets["m"] for lay in layouts],
                     [lay.b_offsets["m"] for lay in layouts], a_stack, bt_stack)


def _segments(setup: LoraSetup, num_tokens: int) -> dict[str, Any]:
    """Token t uses adapter t % A; tokens grouped by adapter into segments."""
    num_adapters = min(len(setup.ranks), num_tokens)
    adapter = torch.arange(num_tokens) % num_adapters
    counts = torch.bincount(adapter, minlength=num_adapters).tolist()
    max_pages = max(len(p) for p in setup.pages[:num_adapters])
    table = torch.zeros(num_adapters, max_pages, dtype=torch.int32, device=DEVICE)
    for s in range(num_adapters):
        table[s, : len(setup.pages[s])] = setup.pages[s]
    indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).int()

    def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    return dict(
        page_table=table, seg_indptr=indptr.to(DEVICE),
        ranks=dev(setup.ranks[:num_adapters], torch.int32),
        a_offsets=dev(setup.a_offsets[:num_adapters], torch.int64),
        b_offsets=dev(setup.b_offsets[:num_adapters], torch.int64),
        scales=torch.full((num_adapters,), 0.5, device=DEVICE),
        counts=counts, max_rank=max(setup.ranks[:num_adapters]),
        **{k: v.to(DEVICE) for k, v in _padded_layout(counts).items()})


def _padded_layout(counts: list[int]) -> dict[str, torch.Tensor]:
    """The padded baseline's batch: segments as rows of ``[S, L]``, L the longest segment.

    ``token_index[s, i]``: the token at slot ``i`` of segment ``s`` (0 in padding slots);
    ``slot_of_token[t]``: flat slot of token ``t``. Integer gathers only, so the baseline
    captures in a CUDA graph (boolean masks would sync).
    """
    longest = max(counts)
    token_index = torch.zeros(len(counts), longest, dtype=torch.long)
    slots = []
    start = 0
    for s, n in enumerate(counts):
        token_index[s, :n] = torch.arange(start, start + n)
        slots.append(torch.arange(s * longest, s * longest + n))
        start += n
    return dict(token_index=token_index, slot_of_token=torch.cat(slots))


def padded_shrink(x: torch.Tensor, a_stack: torch.Tensor, token_index: torch.Tensor,
                  slot_of_token: torch.Tensor) -> torch.Tensor:
    """Gather + bmm baseline: ``[S, L, d] @ [S, d, max_rank]`` over weights padded to the
    maximum rank; returns ``[T, max_rank]``."""
    h = torch.bmm(x[token_index], a_stack.transpose(1, 2))  # [S, L, max_rank]
    return h.view(-1, h.shape[-1])[slot_of_token]


def padded_expand(h: torch.Tensor, bt_stack: torch.Tensor, scales: torch.Tensor,
                  token_index: torch.Tensor, slot_of_token: torch.Tensor, y: torch.Tensor
                  ) -> None:
    """Gather + bmm baseline of expand: ``y += scale * h @ B^T`` with padded ``B^T``."""
    delta = torch.bmm(h.to(bt_stack.dtype)[token_index], bt_stack)  # [S, L, d]
    delta = delta * scales[:, None, None].to(delta.dtype)
    y.add_(delta.view(-1, delta.shape[-1])[slot_of_token])


def _bench_lora(setup: LoraSetup, d: int, num_tokens: int, case: dict[str, Any]
                ) -> list[Row]:
    from loraplex.kernels import reference, sgmv

    seg = _segments(setup, num_tokens)
    num_adapters, max_rank = len(seg["counts"]), seg["max_rank"]
    x = torch.randn(num_tokens, d, device=DEVICE).to(DTYPE)
    common = (setup.pool, seg["page_table"], seg["seg_indptr"], seg["ranks"])
    weight_bytes = sum(r * d * 2 for r in setup.ranks[:num_adapters])
    layout = (seg["token_index"], seg["slot_of_token"])
    a_pad = setup.a_stack[:num_adapters]
    bt_pad = setup.bt_stack[:num_adapters]
    rows = []

    def shrink() -> torch.Tensor:
        return sgmv.sgmv_shrink(x, *common, seg["a_offsets"], max_rank)

    def shrink_ref() -> torch.Tensor:
        return reference.lora_shrink(x, *common, seg["a_offsets"], max_rank)

    def shrink_padded() -> torch.Tensor:
        return padded_shrink(x, a_pad, *layout)

    h = shrink_ref()
    rows.append(_measure("shrink", case, shrink, shrink_ref, shrink_padded,
                         num_tokens * d * 2 + weight_bytes + num_tokens * max_rank * 4,
                         lambda: (shrink() - h).abs().max().item()))

    y = torch.randn(num_tokens, d, device=DEVICE).to(DTYPE)
    scales = seg["scales"]

    def expand() -> None:
        sgmv.sgmv_expand(h, *common, seg["b_offsets"], scales, y)

    def expand_ref() -> None:
        reference.lora_expand(h, *common, seg["b_offsets"], scales, y)

    def expand_padded() -> None:
        padded_expand(h, bt_pad, scales, *layout, y)

    def expand_err() -> float:
        y_ref, y_kernel = y.clone(), y.clone()
        reference.lora_expand(h, *common, seg["b_offsets"], scales, y_ref)
        sgmv.sgmv_expand(h, *common, seg["b_offsets"], scales, y_kernel)
        return (y_ref.float() - y_kernel.float()).abs().max().item()

    rows.append(_measure("expand", case, expand, expand_ref, expand_padded,
                         num_tokens * max_rank * 4 + weight_bytes + 2 * num_tokens * d * 2,
                         expand_err))
    return rows


def _measure(bench: str, case: dict[str, Any], kernel: Callable, ref: Callable,
             padded: Callable, num_bytes: int, err: Callable[[], float]) -> Row:
    row = Row(bench, dict(case), bytes=num_bytes)
    try:
        row.max_abs_err = err()
        row.us["triton"] = _bench(kernel)
        row.us["triton_eager"] = _bench(kernel, graph=False)
        row.us["copy"] = _copy_us(num_bytes)
        row.us["reference"] = _bench(ref, graph=False)
        row.us["padded_bmm"] = _bench(padded)
        row.gbps = num_bytes / row.us["triton"] / 1e3
        row.copy_frac = row.us["copy"] / row.us["triton"]
        row.speedup = {k: row.us[k] / row.us["triton"] for k in ("reference", "padded_bmm")}
    except Exception as exc:  # record and go on: one case must not end the run
        row.error = f"{type(exc).__name__}: {exc}"[:300]
    return row


def bench_sgmv(quick: bool, deadline: float) -> list[Row]:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rank_sets = {"8": [8], "16": [16], "64": [64], "mixed": [8, 16, 64]}
    decode = [(1, 1), (16, 1), (16, 16), (64, 1), (64, 16), (256, 1), (256, 16), (256, 256)]
    prefill = [(4096, 1), (4096, 16), (4096, 256)]
    if quick:
        rank_sets = {"16": [16], "mixed": [8, 16, 64]}
        decode, prefill = [(1, 1), (256, 256)], [(4096, 16)]
    rows: list[Row] = []
    for d in (4096, 11008):
        for rank_name, rank_cycle in rank_sets.items():
            ranks = [rank_cycle[i % len(rank_cycle)] for i in range(256)]
            setup = _lora_setup(d, ranks, gen)
            for phase, shapes in (("decode", decode), ("prefill", prefill)):
                for num_tokens, num_adapters in shapes:
                    case = dict(phase=phase, d=d, rank=rank_name, tokens=num_tokens,
                                adapters=num_adapters)
                    if time.monotonic() > deadline:
                        rows.append(Row("sgmv", case, error="skipped: time budget"))
                        continue
                    log.info("sgmv %s", case)
                    sub = LoraSetup(setup.pool, setup.pages[:num_adapters],
                                    setup.ranks[:num_adapters], setup.a_offsets[:num_adapters],
                                    setup.b_offsets[:num_adapters],
                                    setup.a_stack[:num_adapters], setup.bt_stack[:num_adapters])
                    rows.extend(_bench_lora(sub, d, num_tokens, case))
            del setup
            torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- attention


def _sdpa_best(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
               ) -> tuple[str, float, torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    best: tuple[str, float, torch.Tensor] | None = None
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        def run(backend: SDPBackend = backend) -> torch.Tensor:
            with sdpa_kernel([backend]):
                return sdpa(q, k, v, scale=scale, enable_gqa=True)
        try:
            out = run()
            us = _bench(run)
        except Exception:  # a backend that does not take these inputs
            continue
        if best is None or us < best[1]:
            best = (backend.name, us, out)
    if best is None:
        raise RuntimeError("no SDPA backend ran")
    return best


def bench_attention(quick: bool, deadline: float) -> list[Row]:
    shapes = [(1, 4096), (1, 16384), (16, 4096), (64, 1024), (64, 4096), (256, 1024),
              (256, 4096)]
    if quick:
        shapes = [(1, 16384), (64, 4096)]
    rows = []
    for batch, length in shapes:
        row = Row("decode_attention", dict(batch=batch, context=length, heads="32/8x128"))
        log.info("decode attention %s", row.case)
        if time.monotonic() > deadline:
            row.error = "skipped: time budget"
        else:
            try:
                _bench_decode_attention(row, batch, length)
            except Exception as exc:  # record and go on
                row.error = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def _bench_decode_attention(row: Row, batch: int, length: int) -> None:
    from loraplex.kernels import paged_attention as pa
    from loraplex.kernels.metadata import AttentionMetadata

    num_heads, num_kv_heads, head_dim, page_size = 32, 8, 128, 16
    pages_per_seq = -(-length // page_size)
    num_pages = batch * pages_per_seq
    order = torch.randperm(num_pages)  # every sequence's pages scattered over the pool
    pool = torch.randn(num_pages, 2 * page_size * num_kv_heads * head_dim,
                       device=DEVICE).to(DTYPE)
    meta = AttentionMetadata.build(order.view(batch, pages_per_seq).tolist(), [1] * batch,
                                   [length] * batch, page_size, device=DEVICE)
    q = torch.randn(batch, num_heads, head_dim, device=DEVICE).to(DTYPE)
    kv = pool.view(num_pages, 2, page_size, num_kv_heads, head_dim)[order.to(DEVICE)]
    kv = kv.view(batch, pages_per_seq, 2, page_size, num_kv_heads, head_dim)
    k = kv[:, :, 0].reshape(batch, -1, num_kv_heads, head_dim)[:, :length]
    v = kv[:, :, 1].reshape(batch, -1, num_kv_heads, head_dim)[:, :length]
    k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B, Hkv, L, D]
    del kv
    scale = head_dim ** -0.5
    backend, sdpa_us, expected = _sdpa_best(q[:, :, None], k, v, scale)

    def paged() -> torch.Tensor:
        return pa.paged_attention(q, pool, meta, page_size, num_kv_heads, scale)

    row.max_abs_err = (paged().float() - expected[:, :, 0].float()).abs().max().item()
    row.us["triton"] = _bench(paged)
    row.us["triton_eager"] = _bench(paged, graph=False)
    row.us["sdpa"] = sdpa_us
    row.case["sdpa_backend"] = backend
    row.bytes = 2 * batch * length * num_kv_heads * head_dim * 2  # K and V, bf16
    row.us["copy"] = _copy_us(row.bytes)
    row.gbps = row.bytes / row.us["triton"] / 1e3
    row.copy_frac = row.us["copy"] / row.us["triton"]
    row.speedup = {"sdpa": sdpa_us / row.us["triton"]}


def bench_engine(quick: bool, deadline: float) -> list[Row]:
    """Engine end to end on a ~1B random Llama: decode tokens/s with 64 distinct adapters
    against the base model (issue 4's last benchmark; ``kernel_bench_engine.py``)."""
    from kernel_bench_engine import EngineBenchConfig, run_engine_bench

    cfg = EngineBenchConfig(device=DEVICE)
    if quick:
        cfg = EngineBenchConfig(device=DEVICE, decode_steps=16, rounds=1)
    return [run_engine_bench(cfg, deadline)]


def import_from_checkout() -> None:
    """Map ``loraplex.kernels`` (and the other top-level folders) onto this checkout, as
    pyproject's package-dir table does, when loraplex is not installed: the GPU machines get a
    bare copy of the tree. Does nothing when ``loraplex.kernels`` already imports."""
    root = str(Path(__file__).resolve().parents[1])
    if importlib.util.find_spec("loraplex") is None:
        sys.path.insert(0, root)
    import loraplex

    if importlib.util.find_spec("loraplex.kernels") is None:
        loraplex.__path__.append(root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument("--quick", action="store_true", help="a few cases only (smoke run)")
    parser.add_argument("--no-engine", action="store_true",
                        help="skip the engine end-to-end benchmark")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU; none is visible, nothing was measured", file=sys.stderr)
        return 2
    import_from_checkout()

    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    deadline = start + BUDGET_S
    env = environment()
    big = 1 << 30
    peak_gbps = big / _copy_us(big) / 1e3
    # attention first: fewer cases, so the time budget never starves it; the engine last, so
    # that a device fault in it cannot spoil the kernel rows (written before it starts)
    kernel_deadline = deadline - (0 if args.no_engine else ENGINE_RESERVE_S)
    rows = bench_attention(args.quick, kernel_deadline) + bench_sgmv(args.quick,
                                                                     kernel_deadline)
    table = write_results(args.out, env, rows, peak_gbps, DTYPE, start)
    if not args.no_engine:
        torch.cuda.empty_cache()
        rows += bench_engine(args.quick, deadline)
        table = write_results(args.out, env, rows, peak_gbps, DTYPE, start)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
