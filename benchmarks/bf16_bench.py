"""loraplex in bfloat16 against its own float32, side by side: speed and greedy divergence.

Two engines (float32 and bfloat16) on the LoRA benchmark's model, trace and adapters
(``lora_bench.py``: ``--model random|smollm2``, N adapters drawn Zipf(1)), each run with the
trace's adapters and without, interleaved over ``--repeats``. Reported: end-to-end output
tokens/s per wall and per CPU second (medians), bf16 / fp32 and LoRA / base ratios (the issue's
targets: bf16 >= 1.6x fp32 at N = 64 on the prompt-heavy trace, LoRA / base >= 0.9x in bf16),
and the greedy divergence of bf16 from fp32: the share of requests whose tokens differ, and
where the first difference falls (random weights have near-ties, so the real model's figure is
the one that says how bf16 behaves).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/bf16_bench.py --n 64 --out bench-out/bf16``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import MODEL_CHOICES, bench_model, git_commit, machine_info, make_requests, median  # noqa: E402,E501
from lora_bench import (  # noqa: E402
    RANKS,
    SyntheticAdapters,
    adapter_indices,
    engine_sizes,
    prefetch,
    run_engine,
)

from loraplex.server import env  # noqa: E402,I001
from loraplex.server.config import EngineConfig, SchedulerConfig  # noqa: E402
from loraplex.server.engine.engine import Engine  # noqa: E402
from loraplex.server.engine.models.config import ModelConfig  # noqa: E402

DTYPES = ("float32", "bfloat16")


def divergence(ref: dict[str, list[int]], other: dict[str, list[int]]) -> dict[str, float]:
    """Share of requests whose greedy tokens differ, and the mean index of the first
    difference over those that do (tokens before it are identical)."""
    firsts = [next(i for i, (a, b) in enumerate(zip(ref[k], other[k])) if a != b)
              for k in ref if ref[k] != other[k]]
    return {"diverged": len(firsts) / len(ref),
            "mean_first_divergence": sum(firsts) / len(firsts) if firsts else float("nan")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=64, help="adapters")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 128))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="random", choices=MODEL_CHOICES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-dirty", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    commit = git_commit()
    if commit.endswith("-dirty") and not args.allow_dirty:
        raise SystemExit(f"commit {commit}: uncommitted changes (or pass --allow-dirty)")
    torch.set_num_threads(args.threads)
    model_path, hf_config = bench_model(args.model, env.cache_dir() / "bench")
    config = ModelConfig.from_pretrained(str(model_path))
    requests = make_requests(args.num_requests, tuple(args.prompt_len), args.max_tokens,
                             hf_config["vocab_size"], seed=args.seed)
    trace = adapter_indices(len(requests), args.n, args.seed)
    family = SyntheticAdapters(config, args.n, 2, args.seed)
    digests = [family.adapters[i].digest for i in trace]
    engines = {}
    for dtype in DTYPES:
        num_pages, host = engine_sizes(config, 16, requests, {args.n: trace}, 4)
        engines[dtype] = Engine(EngineConfig(
            model=str(model_path), dtype=dtype, enable_prefix_caching=False, num_pages=num_pages,
            host_cache_bytes=host, max_rank=max(RANKS), scheduler=SchedulerConfig()),
            adapter_source=family)
        prefetch(engines[dtype], set(digests))
        run_engine(engines[dtype], requests[:8], digests[:8])  # warm-up
    runs: dict[str, list[tuple[float, float]]] = {}
    tokens: dict[str, dict[str, list[int]]] = {}
    for rep in range(args.repeats):
        order = [(d, lora) for d in DTYPES for lora in (True, False)]
        for dtype, lora in (order if rep % 2 == 0 else list(reversed(order))):
            name = f"{dtype}{'' if lora else '-base'}"
            cpu0 = time.process_time()
            run, _, _ = run_engine(engines[dtype], requests,
                                   digests if lora else [None] * len(requests))
            cpu = time.process_time() - cpu0
            runs.setdefault(name, []).append((run.output_tokens_per_s,
                                              run.num_output_tokens / cpu))
            tokens.setdefault(name, run.token_ids)
            print(f"  [rep {rep}] {name:14} {run.output_tokens_per_s:7.1f} tok/s, "
                  f"{run.num_output_tokens / cpu:7.1f} per CPU s, load {os.getloadavg()[0]:.1f}",
                  file=sys.stderr)
    rows = {name: {"e2e_median": median([r[0] for r in rs]),
                   "e2e_cpu_median": median([r[1] for r in rs]), "runs": rs}
            for name, rs in runs.items()}

    def ratio(a: str, b: str, key: str) -> float:
        return rows[a][key] / rows[b][key]

    report = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine_info(args.threads), "load": os.getloadavg(), "rows": rows,
        "bf16_vs_fp32": {k: ratio("bfloat16", "float32", k) for k in ("e2e_median",
                                                                       "e2e_cpu_median")},
        "lora_vs_base_bf16": {k: ratio("bfloat16", "bfloat16-base", k)
                              for k in ("e2e_median", "e2e_cpu_median")},
        "divergence": {"lora": divergence(tokens["float32"], tokens["bfloat16"]),
                       "base": divergence(tokens["float32-base"], tokens["bfloat16-base"])},
    }
    print(f"\nbf16 against fp32: {args.model} model, N={args.n}, {args.num_requests} requests, "
          f"prompts {args.prompt_len[0]}-{args.prompt_len[1]}, {args.max_tokens} new tokens, "
          f"commit {report['machine']['commit']}, load {report['load'][0]:.1f}")
    for name, row in rows.items():
        print(f"  {name:14} {row['e2e_median']:7.1f} tok/s  {row['e2e_cpu_median']:7.1f} per CPU s")
    for key in ("bf16_vs_fp32", "lora_vs_base_bf16"):
        q = report[key]
        print(f"  {key}: {q['e2e_median']:.2f}x ({q['e2e_cpu_median']:.2f}x per CPU s)")
    for key, d in report["divergence"].items():
        print(f"  greedy divergence bf16 vs fp32 ({key}): {d['diverged']:.0%} of requests, "
              f"first differing token at {d['mean_first_divergence']:.1f} on average")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bf16_bench.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
