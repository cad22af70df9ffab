"""One fused projection's LoRA on the CPU: the native short-segment kernel (``csrc/lora.c``)
against the torch path of ``cpu.lora_segments``, at SmolLM2-135M's shapes (hidden 576, q 576,
k/v 192, intermediate 1536), a decode batch of 32 rows in 17 segments (Zipf-like sizes),
ranks 8 and 16 alternating, blocks read from a paged pool like the engine's.

Every measurement runs the projection over ``--layers`` layers' blocks (30: SmolLM2's depth,
so the weights come from cache levels beyond L2 as in a step) and reports CPU microseconds
per call (``time.thread_time``), medians of ``--repeats`` rounds in which the two paths
alternate. ``python`` is the native path's Python side alone (the argument arrays, with the
foreign call replaced by a no-op).

With ``--prefill``: a prefill chunk instead (1536 rows in 17 segments of 31-200 rows), where in
float32 the native kernel also takes the long segments (``cpu._NATIVE_F32_SEGMENT``) and in
bf16 they run on oneDNN's bf16 GEMMs either way (only the short ones differ).

Usage: ``OMP_NUM_THREADS=1 flock /work/wt/bench.lock python benchmarks/cpu_lora_bench.py``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from loraplex.kernels import cpu, native, reference
from loraplex.kernels.layout import adapter_layout, write_region

GROUPS = {  # fused projection -> (d_in, module widths)
    "qkv": (576, (576, 192, 192)),
    "o": (576, (576,)),
    "gate_up": (576, (1536, 1536)),
    "down": (1536, (576,)),
}
SEGMENT_ROWS = (9, 4, 3, 2, 2) + (1,) * 12  # 32 rows, 17 segments
# --prefill: a prefill step's chunk of 1536 rows in 17 segments (whole prompts of 31-200 tokens)
PREFILL_ROWS = (200, 160, 130, 110, 100, 95, 90, 85, 80, 75, 70, 65, 60, 55, 50, 45, 31)
RANKS = (8, 16)
PAGE_ELEMS = 2 * 16 * 3 * 64  # a KV page of SmolLM2: 16 tokens x 3 KV heads x 64


def build(group: str, layers: int, dtype: torch.dtype, seed: int = 0,
          segment_rows: tuple[int, ...] = SEGMENT_ROWS
          ) -> tuple[torch.Tensor, torch.Tensor, list[list[cpu.SegmentBlocks]]]:
    gen = torch.Generator().manual_seed(seed)
    d_in, widths = GROUPS[group]
    names = [f"m{i}" for i in range(len(widths))]
    shapes = {n: (d_in, w) for n, w in zip(names, widths)}
    starts = [sum(widths[:i]) for i in range(len(widths))]
    layouts = [adapter_layout(RANKS[a % 2], names, shapes) for a in range(len(segment_rows))]
    num_pages = sum(lay.num_pages(PAGE_ELEMS) for lay in layouts)
    pool = torch.randn(layers, num_pages, PAGE_ELEMS, generator=gen).mul_(0.02).to(dtype)
    bounds = [0]
    for n in segment_rows:
        bounds.append(bounds[-1] + n)
    per_layer, first = [], 0
    page_of = []
    for lay in layouts:
        page_of.append(list(range(first, first + lay.num_pages(PAGE_ELEMS))))
        first += lay.num_pages(PAGE_ELEMS)
    for layer in range(layers):
        segments = []
        for s, lay in enumerate(layouts):
            pages = torch.tensor(page_of[s])
            blocks = []
            for n, start, w in zip(names, starts, widths):
                write_region(pool[layer], page_of[s], lay.a_offsets[n],
                             torch.randn(lay.rank, d_in, generator=gen) / d_in ** 0.5)
                a = reference.region_rows(pool[layer], pages, lay.a_offsets[n], lay.rank, d_in)
                bt = reference.region_rows(pool[layer], pages, lay.b_offsets[n], lay.rank, w)
                blocks.append(cpu.ModuleBlocks(start, start + w, a.t(), bt))
            segments.append(cpu.SegmentBlocks(bounds[s], bounds[s + 1], 2.0,
                                              cpu.GroupBlocks(blocks)))
        per_layer.append(segments)
    x = torch.randn(bounds[-1], d_in, generator=gen).to(dtype)
    y = torch.zeros(bounds[-1], sum(widths), dtype=dtype)
    return x, y, per_layer


class _NoCall:
    restype: object = None
    argtypes: object = ()

    def __call__(self, *args: object) -> int:
        return 0


class _Stub:
    loraplex_lora_short = _NoCall()


def timed(fn: Callable[[], None], iters: int) -> float:
    start = time.thread_time()
    for _ in range(iters):
        fn()
    return time.thread_time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--iters", type=int, default=20, help="passes over the layers per round")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prefill", action="store_true",
                   help=f"a prefill chunk's segments ({sum(PREFILL_ROWS)} rows) instead of decode "
                        "rows (float32: the native kernel takes them too; bf16: oneDNN's GEMMs)")
    args = p.parse_args()
    rows = PREFILL_ROWS if args.prefill else SEGMENT_ROWS
    lib = native.library("lora")
    if lib is None:
        raise SystemExit("the native LoRA kernel does not load (LORAPLEX_NATIVE_KERNELS=0 or "
                         "no C compiler)")
    print(f"threads {torch.get_num_threads()}, {len(rows)} segments, "
          f"{sum(rows)} rows, ranks {RANKS}, {args.layers} layers; us CPU per call")
    print("| group | dtype | torch | native | python | torch / native |")
    print("|---|---|---:|---:|---:|---:|")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for group in args.groups:
            x, y, per_layer = build(group, args.layers, dtype, segment_rows=rows)

            def run_all(x: torch.Tensor = x, y: torch.Tensor = y,
                        per_layer: list[list[cpu.SegmentBlocks]] = per_layer) -> None:
                for segments in per_layer:
                    cpu.lora_segments(x, y, segments)

            calls = args.layers * args.iters
            results: dict[str, list[float]] = {"torch": [], "native": [], "python": []}
            for mode in ("torch", "native", "python"):  # warm: tables and torch's copies
                native._loaded["lora"] = {"torch": None, "native": lib, "python": _Stub()}[mode]
                run_all()
            for _ in range(args.repeats):
                for mode in ("torch", "native", "python"):
                    native._loaded["lora"] = {"torch": None, "native": lib,
                                              "python": _Stub()}[mode]
                    results[mode].append(timed(run_all, args.iters) / calls * 1e6)
            native._loaded["lora"] = lib
            med = {k: statistics.median(v) for k, v in results.items()}
            print(f"| {group} | {dtype_name} | {med['torch']:.1f} | {med['native']:.1f} | "
                  f"{med['python']:.1f} | {med['torch'] / med['native']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
