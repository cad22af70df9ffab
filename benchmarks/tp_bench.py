"""Tensor parallelism side by side: the same requests at TP = 1 and TP = 2 (and any other
sizes asked for), one after the other in this process, on the engine benchmark's random Llama
(hidden 1024 x 8 layers, 16 heads, ``common.BENCH_HF_CONFIG``).

Reported per size: output tokens/s, TTFT and ITL (p50 / p90 / p99, from the step at which each
request's tokens came back), steps, and whether the greedy tokens equal TP = 1's.

On CPU the numbers only show TP's overhead: every rank is a process on the same few cores
(two ranks share two cores here, each with TP = 1's thread count), so what TP = 2 measures is
the cost of the step broadcast and the two all-reduces per layer over gloo, mixed with the
second core it keeps busy. On GPUs (``--device cuda``,
one GPU per rank, NCCL) it measures the speed-up. Quote GPU numbers only when measured.

Usage: ``python benchmarks/tp_bench.py --out bench-out`` (``--num-requests 8 --max-tokens 8``
for a quick run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from common import bench_model, git_commit, machine_info, make_requests  # noqa: E402

from loraplex.loadtest.baseline import BaselineRequest  # noqa: E402
from loraplex.server.config import EngineConfig, SchedulerConfig  # noqa: E402
from loraplex.server.engine.engine import Engine  # noqa: E402
from loraplex.server.engine.request import SamplingParams  # noqa: E402

CPU_NOTE = ("CPU: these numbers only show tensor parallelism's overhead (the step broadcast, "
            "two all-reduces per layer over gloo): the ranks are processes sharing this "
            "machine's cores (two ranks, two cores), each with as many threads as TP = 1's "
            "single process, so a ratio here mixes more busy cores with that overhead and "
            "says nothing of GPUs.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="directory for tp_bench.json")
    p.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, comma-separated")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 96))
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=None, help="default: the bench shape's 8")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--cache-dir", type=Path, default=Path(".bench-cache"))
    return p.parse_args(argv)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    t = torch.tensor(values, dtype=torch.float64)
    return {f"p{q}": float(torch.quantile(t, q / 100)) for q in (50, 90, 99)}


def run(engine: Engine, requests: list[BaselineRequest]) -> dict:
    """Every request at once; each token's arrival time is the end of the step that made it."""
    start = time.perf_counter()
    for r in requests:
        engine.add_request(r.request_id, r.prompt_token_ids,
                           SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    times: dict[str, list[float]] = {r.request_id: [] for r in requests}
    steps = 0
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter() - start
        steps += 1
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(out.error)
            tokens[out.request_id].extend(out.new_token_ids)
            times[out.request_id].extend([now] * len(out.new_token_ids))
    wall = time.perf_counter() - start
    ttft = [t[0] for t in times.values() if t]
    itl = [b - a for t in times.values() for a, b in zip(t, t[1:])]
    num_tokens = sum(len(t) for t in tokens.values())
    return {"wall_s": wall, "output_tokens": num_tokens, "tokens_per_s": num_tokens / wall,
            "steps": steps, "ttft_s": percentiles(ttft), "itl_s": percentiles(itl),
            "token_ids": tokens}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    model_path, hf_config = bench_model("random", args.cache_dir, args.num_layers)
    requests = make_requests(args.num_requests, tuple(args.prompt_len), args.max_tokens,
                             hf_config["vocab_size"])
    warm = [BaselineRequest(f"warm-{r.request_id}", r.prompt_token_ids, 2)
            for r in requests[:4]]
    results: dict[int, dict] = {}
    for size in sizes:
        engine = Engine(EngineConfig(
            model=str(model_path), dtype=args.dtype, device=args.device,
            tensor_parallel_size=size, enable_prefix_caching=False,
            scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens)))
        try:
            run(engine, warm)
            results[size] = run(engine, requests)
        finally:
            engine.close()
    base = results[sizes[0]]["token_ids"]
    print(f"TP side by side: hidden {hf_config['hidden_size']} x "
          f"{hf_config['num_hidden_layers']} layers, {args.dtype} on {args.device}, "
          f"{args.num_requests} requests x {args.max_tokens} tokens")
    print(f"{'TP':>3} {'tok/s':>8} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'ITL p50':>8} "
          f"{'p90':>7} {'p99':>7} {'steps':>6}  same tokens as TP={sizes[0]}")
    for size, r in results.items():
        ttft, itl = r["ttft_s"], r["itl_s"]
        same = sum(r["token_ids"][k] == base[k] for k in base)
        r["same_tokens_as_first"] = same
        print(f"{size:>3} {r['tokens_per_s']:>8.1f} {ttft['p50']:>9.3f} {ttft['p90']:>7.3f} "
              f"{ttft['p99']:>7.3f} {itl['p50']:>8.4f} {itl['p90']:>7.4f} {itl['p99']:>7.4f} "
              f"{r['steps']:>6}  {same}/{len(base)}")
    if args.device == "cpu":
        print(CPU_NOTE)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"commit": git_commit(), "machine": machine_info(torch.get_num_threads()),
                  "args": {k: str(v) for k, v in vars(args).items()},
                  "note": CPU_NOTE if args.device == "cpu" else "",
                  "results": {str(s): {k: v for k, v in r.items() if k != "token_ids"}
                              for s, r in results.items()}}
        (args.out / "tp_bench.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
