"""Float32 GEMMs on CPU: loraplex's native GEMM (``loraplex/kernels/cpu_gemm``: the AMX tile GEMM,
six bf16 products of the split operands, or the FMA GEMM on prepacked panels; ``--kind``, default
the one this machine's engine runs) against oneDNN's prepacked float32 GEMM (the engine's path
without it) and ``F.linear`` (MKL), at the engine's projection shapes, weights out of cache.
``--dtype bfloat16``: the bf16 GEMM on pair dot products (``csrc/gemm_bf16.c``, CPUs with
AVX512-BF16) against oneDNN's prepacked bf16 GEMM and ``F.linear`` in bf16.

Each shape gets ``--layers`` weights of its own (as the engine's layers: a weight is not in
cache when its turn comes); one timing is one pass over all of them; the three paths
alternate pass by pass and the medians of ``--repeats`` passes are quoted, in CPU time per
product. Each shape's native result is checked against oneDNN's on its first rows (``max rel``:
the largest difference over the largest magnitude). Prints a table and writes JSON (``--out``).

    OMP_NUM_THREADS=1 flock /work/wt/bench.lock .venv/bin/python benchmarks/cpu_gemm_bench.py \\
        --model smollm2 --rows 1 16 32 64 128 512 2048 --out bench-out/cpu-gemm.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import git_commit, machine_info

from loraplex.kernels import cpu_gemm
from loraplex.server.engine.models.llama import linear, onednn_linear_supported, pack_linear

# (name, d_in, d_out) of a layer's four fused projections and the lm_head
SHAPES = {
    "smollm2": [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072),
                ("down", 1536, 576), ("lm_head", 576, 49152)],
    "random": [("qkv", 1024, 3072), ("o", 1024, 1024), ("gate_up", 1024, 5632),
               ("down", 2816, 1024), ("lm_head", 1024, 32000)],
}


def _time(fn, weights, x) -> float:
    t0 = time.process_time()
    for w in weights:
        fn(x, w)
    return (time.process_time() - t0) / len(weights)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--shapes", nargs="+", default=None,
                        help="only these of the model's shapes (qkv, o, gate_up, down, lm_head)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 32, 64, 128, 512, 2048])
    parser.add_argument("--layers", type=int, default=30,
                        help="weights per shape (lm_head: 2), cycled so none stays in cache")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kind", choices=cpu_gemm.BACKENDS, default=None,
                        help="the native float32 GEMM to time (default: the one the engine "
                             "runs here)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16:
        kind = "bf16"
        if not cpu_gemm.bf16_available():
            raise SystemExit("the bf16 GEMM is not available on this machine (it needs "
                             "AVX512-BF16 and the native kernels)")
    else:
        chosen = args.kind or cpu_gemm.backend()
        if chosen is None or chosen not in cpu_gemm.backends():
            raise SystemExit(f"the {chosen or 'native'} float32 GEMM is not available on this "
                             "machine (LORAPLEX_FMA_GEMM=1 or --kind fma runs the FMA GEMM on any "
                             "CPU)")
        kind = chosen
    if not onednn_linear_supported(dtype, torch.device("cpu")):
        raise SystemExit(f"oneDNN's prepacked {args.dtype} GEMM is not available")
    shapes = [s for s in SHAPES[args.model] if args.shapes is None or s[0] in args.shapes]
    if not shapes:
        raise SystemExit(f"--shapes: none of {args.shapes} is a shape of {args.model} "
                         f"({', '.join(s[0] for s in SHAPES[args.model])})")
    threads = torch.get_num_threads()
    print(f"{args.model} shapes, {args.dtype}, threads {threads}; CPU ms per product (median "
          f"of {args.repeats} interleaved passes), GFLOP/s of the {kind} GEMM, ratios")
    print(f"{'shape':>8} {'rows':>5} {'F.linear':>9} {'oneDNN':>8} {kind.upper():>8} {'GF/s':>6} "
          f"{'vs oneDNN':>9} {'vs linear':>9} {'max rel':>8}")
    results = []
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, d_in, d_out in shapes:
            count = 2 if name == "lm_head" else args.layers
            dense = [(torch.randn(d_out, d_in, generator=gen) * 0.05).to(dtype)
                     for _ in range(count)]
            onednn = [pack_linear(w) for w in dense]
            tiles = [cpu_gemm.pack(w, kind) for w in dense]
            for rows in args.rows:
                x = torch.randn(rows, d_in, generator=gen).to(dtype)
                want = linear(x[:64], onednn[0]).float()
                got = cpu_gemm.linear(x[:64], tiles[0]).float()
                max_rel = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
                paths = {"linear": (F.linear, dense), "onednn": (linear, onednn),
                         "native": (cpu_gemm.linear, tiles)}
                times: dict[str, list[float]] = {p: [] for p in paths}
                for rep in range(args.repeats + 1):
                    order = list(paths) if rep % 2 else list(reversed(paths))
                    for p in order:
                        fn, ws = paths[p]
                        t = _time(fn, ws, x)
                        if rep:  # the first pass faults the buffers in
                            times[p].append(t)
                med = {p: statistics.median(v) for p, v in times.items()}
                gflops = 2 * rows * d_in * d_out / med["native"] / 1e9
                row = {"shape": name, "d_in": d_in, "d_out": d_out, "rows": rows,
                       "ms": {p: med[p] * 1e3 for p in med}, "native_gflops": gflops,
                       "native_vs_onednn": med["onednn"] / med["native"],
                       "native_vs_linear": med["linear"] / med["native"], "max_rel": max_rel}
                results.append(row)
                print(f"{name:>8} {rows:>5} {med['linear'] * 1e3:9.3f} {med['onednn'] * 1e3:8.3f} "
                      f"{med['native'] * 1e3:8.3f} {gflops:6.0f} {row['native_vs_onednn']:8.2f}x "
                      f"{row['native_vs_linear']:8.2f}x {max_rel:8.1e}", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine_info(threads), "model": args.model,
                                        "dtype": args.dtype, "kind": kind,
                                        "commit": git_commit(), "results": results},
                                       indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
