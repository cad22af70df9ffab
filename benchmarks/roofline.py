"""The machine's ceilings for the benchmarks' rooflines: GEMM peak (fp32 and bf16, through
``F.linear`` and oneDNN on a prepacked weight, at a fused gate/up projection's shape and at a
decode step's 64 rows) and copy bandwidth (a 512 MiB tensor copy, read + write bytes).

``lora_bench.py`` measures the same (``common.copy_bandwidth``, ``common.gemm_throughput``) in
every report; this prints them alone, with the load beside them (a shared machine's ceilings
move with its load).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/roofline.py --threads 2``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from common import copy_bandwidth, gemm_throughput


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = {"threads": args.threads, "load_before": os.getloadavg()[0],
           "copy_bandwidth_gb_s": copy_bandwidth() / 1e9}
    for dtype in (torch.float32, torch.bfloat16):
        for m in (1024, 64):
            g = gemm_throughput(dtype, m=m)
            out[f"gemm_{str(dtype).removeprefix('torch.')}_m{m}_gflop_s"] = {
                k: v / 1e9 for k, v in g.items()}
    out["load_after"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
