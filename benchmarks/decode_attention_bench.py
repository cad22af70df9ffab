"""Decode attention on CPU: the native C kernel (``loraplex/kernels/cpu_native.decode``) against
the torch path (``loraplex/kernels/cpu._decode``) at SmolLM2's shapes, interleaved, in CPU time;
with ``--prefill``, prefill attention (``loraplex/kernels/cpu_native.prefill`` against SDPA per
sequence, ``loraplex/kernels/cpu._prefill_one``): every sequence a whole prompt of ``--context``
tokens, or, with ``--chunk N``, its last N tokens on top of the rest as a cached context.

One "step" is ``--layers`` layers, each with its own pool (so, as in the engine, a layer's K/V
are not left in cache by the previous one), every sequence decoding one token over a context
drawn from ``--context``. The two paths alternate step by step in one process, each with its
per-step plan already cached (as for the 29 layers after the first); the ratio of their CPU
times is the number to quote.

    OMP_NUM_THREADS=1 flock /work/wt/bench.lock .venv/bin/python \\
        benchmarks/decode_attention_bench.py --dtype float32 bfloat16 --page-size 16 32
    OMP_NUM_THREADS=1 flock /work/wt/bench.lock .venv/bin/python \
        benchmarks/decode_attention_bench.py --prefill --num-seqs 16 --context 64 128
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

import torch

from loraplex.kernels import cpu, cpu_native, native
from loraplex.kernels.layout import kv_page_elems
from loraplex.kernels.metadata import AttentionMetadata
from loraplex.kernels.reference import kv_view


def _setup(args: argparse.Namespace, dtype: torch.dtype, page_size: int):
    rng = random.Random(args.seed)
    lens = [rng.randint(*args.context) for _ in range(args.num_seqs)]
    counts = [-(-n // page_size) for n in lens]
    order = list(range(1, sum(counts) + 1))
    rng.shuffle(order)  # pages of a sequence scattered through the pool, as after churn
    tables, i = [], 0
    for c in counts:
        tables.append(order[i:i + c])
        i += c
    q_lens = [1] * len(lens)
    if args.prefill:
        q_lens = [min(n, args.chunk) if args.chunk else n for n in lens]
    meta = AttentionMetadata.build(tables, q_lens, lens, page_size)
    elems = kv_page_elems(page_size, args.kv_heads, args.head_dim)
    pools = [torch.randn(sum(counts) + 1, elems).to(dtype) for _ in range(args.layers)]
    q = torch.randn(sum(q_lens), args.heads, args.head_dim).to(dtype)
    return q, pools, meta


def _run(path: str, q, pools, meta, page_size: int, kv_heads: int, scale: float) -> float:
    rows = list(range(meta.num_seqs))
    starts = list(itertools.accumulate(meta.q_lens, initial=0))
    out = torch.empty_like(q)
    t0 = time.process_time()
    for pool in pools:
        if meta.max_query_len > 1 and path == "native":
            if not cpu_native.prefill(q, pool, meta, rows, starts, out, page_size, kv_heads,
                                      scale):
                raise RuntimeError("the native kernel declined")
        elif meta.max_query_len > 1:
            view = kv_view(pool, page_size, kv_heads)
            for s in rows:
                lo, hi = starts[s], starts[s + 1]
                out[lo:hi] = cpu._prefill_one(q[lo:hi], view, meta.page_table[s],
                                              meta.seq_lens_host[s], scale)
        elif path == "native":
            if not cpu_native.decode(q, pool, meta, rows, starts, out, page_size, kv_heads,
                                     scale):
                raise RuntimeError("the native kernel declined")
        else:
            cpu._decode(q, kv_view(pool, page_size, kv_heads), meta, rows, starts, out, scale)
    return (time.process_time() - t0) / len(pools)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--page-size", nargs="+", type=int, default=[16, 32])
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--context", nargs=2, type=int, default=[100, 250], metavar=("MIN", "MAX"))
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=20, help="interleaved steps per path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill", action="store_true", help="prefill attention instead")
    parser.add_argument("--chunk", type=int, default=0,
                        help="with --prefill: query rows per sequence (0: the whole prompt)")
    args = parser.parse_args()
    if native.library("prefill_attention" if args.prefill else "decode_attention") is None:
        raise SystemExit("native kernels unavailable")
    what = (f"prefill ({f'chunks of {args.chunk}' if args.chunk else 'whole prompts'})"
            if args.prefill else "decode")
    print(f"{what}, threads {torch.get_num_threads()}, {args.num_seqs} sequences, context "
          f"{args.context[0]}-{args.context[1]}, heads {args.heads}/{args.kv_heads}, "
          f"D {args.head_dim}, {args.layers} layers; CPU us per layer, median of "
          f"{args.steps} interleaved steps")
    print(f"{'dtype':>9} {'page':>4} {'torch':>8} {'native':>8} {'ratio':>6}")
    scale = args.head_dim ** -0.5
    for name, page_size in itertools.product(args.dtype, args.page_size):
        dtype = getattr(torch, name)
        q, pools, meta = _setup(args, dtype, page_size)
        times: dict[str, list[float]] = {"torch": [], "native": []}
        for step in range(args.steps + 1):
            for path in ("native", "torch") if step % 2 else ("torch", "native"):
                t = _run(path, q, pools, meta, page_size, args.kv_heads, scale)
                if step:  # the first step builds the plans and faults the buffers in
                    times[path].append(t)
        med = {p: statistics.median(v) * 1e6 for p, v in times.items()}
        print(f"{name:>9} {page_size:>4} {med['torch']:8.1f} {med['native']:8.1f} "
              f"{med['torch'] / med['native']:6.2f}x")


if __name__ == "__main__":
    main()
