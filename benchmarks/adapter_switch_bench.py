"""What switching adapter sets costs a run: lora_bench.py's trace, alternating between its
adapter sets (``--ns``) on one engine, each set run twice in a row.

The first run on a set after another set (``switch``) copies the set's adapters that the
other one evicted from the host cache into the pool's pages; the second (``steady``) finds
them resident. Each run reports tokens/s by the wall clock, the copies its steps made and the
seconds they took (``EngineStats.adapter_copies_in`` / ``adapter_copy_in_seconds``, the
worker's ``loraplex_worker_adapter_copies_in_total`` / ``_copy_in_seconds_total``), and the
process's minor page faults during the run: a run slowed by its copies shows it in the
switch / steady ratio, and one slowed after them (first touches of pages) in its faults.
The pool holds the largest set's adapters beside every request's KV (lora_bench.py's
sizing), so the sets evict one another. Prints a table and writes JSON (``--out``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/adapter_switch_bench.py --model smollm2 \\
        --ns 64 512 --rounds 3 --out bench-out/adapter-switch
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch
from common import bench_model, machine_info, make_requests
from lora_bench import (
    RANKS,
    SyntheticAdapters,
    adapter_indices,
    engine_sizes,
    prefetch,
    run_engine,
    warm_up,
)

from loraplex.server import env
from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.models.config import ModelConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("random", "smollm2"), default="smollm2")
    p.add_argument("--num-layers", type=int, default=None,
                   help="shrink the random model for quick runs")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--ns", type=int, nargs="+", default=[64, 512],
                   help="the adapter sets (Zipf over N adapters, as lora_bench.py), alternated")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="passes over the sets")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write adapter_switch.json here")
    args = p.parse_args(argv)
    if len(set(args.ns)) < 2:
        p.error("--ns: name at least two different adapter sets to switch between")
    if args.rounds < 1 or args.num_requests < 1:
        p.error("--rounds and --num-requests must be at least 1")
    return args


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_path, hf_config = bench_model(args.model, env.cache_dir() / "bench", args.num_layers)
    config = ModelConfig.from_pretrained(str(model_path))
    requests = make_requests(args.num_requests, tuple(args.prompt_len), args.max_tokens,
                             hf_config["vocab_size"], seed=args.seed)
    traces = {n: adapter_indices(len(requests), n, args.seed) for n in args.ns}
    family = SyntheticAdapters(config, max(args.ns), 1, args.seed)
    num_pages, host_bytes = engine_sizes(config, 16, requests, traces,
                                         getattr(torch, args.dtype).itemsize)
    engine = Engine(EngineConfig(
        model=str(model_path), dtype=args.dtype, enable_prefix_caching=False,
        num_pages=num_pages, host_cache_bytes=host_bytes, max_rank=max(RANKS),
        scheduler=SchedulerConfig()), adapter_source=family)
    warm_up(engine, None, family, requests, traces, len(requests))
    runs = []
    print(f"{'round':>5} {'N':>5} {'run':>6} {'tok/s':>7} {'wall s':>7} {'copies':>6} "
          f"{'copy ms':>8} {'faults':>7}")
    for rnd in range(args.rounds):
        for n in args.ns:
            digests = [family.adapters[i].digest for i in traces[n]]
            prefetch(engine, set(digests))
            for kind in ("switch", "steady"):
                before, faults0 = engine.stats(), minor_faults()
                run = run_engine(engine, requests, digests)[0]
                after, faults = engine.stats(), minor_faults() - faults0
                copies = after.adapter_copies_in - before.adapter_copies_in
                copy_s = after.adapter_copy_in_seconds - before.adapter_copy_in_seconds
                row = dict(round=rnd, n=n, run=kind, tok_s=run.output_tokens_per_s,
                           wall_s=run.wall_s, copies_in=copies, copy_in_s=copy_s,
                           minor_faults=faults)
                runs.append(row)
                print(f"{rnd:5} {n:5} {kind:>6} {row['tok_s']:7.1f} {run.wall_s:7.2f} "
                      f"{copies:6} {copy_s * 1e3:8.1f} {faults:7}", flush=True)
    engine.close()
    # a switch run follows a run on another set (the very first one, the warm-up's: the
    # largest set); only those that copied adapters in count toward the copy figures
    median = {k: statistics.median(r["tok_s"] for r in runs if r["run"] == k)
              for k in ("switch", "steady")}
    switched = [r for r in runs if r["run"] == "switch" and r["copies_in"] > 0]
    summary = dict(
        switch_tok_s=median["switch"], steady_tok_s=median["steady"],
        switch_over_steady=median["switch"] / median["steady"],
        copies_per_switch=statistics.median(r["copies_in"] for r in switched) if switched else 0,
        copy_ms_per_switch=(statistics.median(r["copy_in_s"] for r in switched) * 1e3
                            if switched else 0.0),
        copy_share_of_switch_run=(statistics.median(r["copy_in_s"] / r["wall_s"]
                                                    for r in switched) if switched else 0.0))
    print(f"median tok/s: switch {median['switch']:.1f}, steady {median['steady']:.1f} "
          f"({summary['switch_over_steady']:.3f}x); a switch copies "
          f"{summary['copies_per_switch']:g} adapters in {summary['copy_ms_per_switch']:.1f} ms "
          f"({100 * summary['copy_share_of_switch_run']:.2f}% of its run)")
    report = dict(args={k: (str(v) if isinstance(v, Path) else v)
                        for k, v in vars(args).items()},
                  machine=machine_info(args.threads), num_pages=num_pages, runs=runs,
                  summary=summary, created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "adapter_switch.json"
        path.write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
