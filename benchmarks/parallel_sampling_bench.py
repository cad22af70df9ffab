"""Parallel-sampling benchmark: n sequences on shared pages against n separate requests.

One trace (prompts of ``--prompt-len`` tokens, prompt ``i`` for adapter ``i % --num-adapters``
of random rank-8 LoRA adapters on q, k, v and o, ``--max-tokens`` new tokens uniform in a
range, temperature 1 with a seed per prompt) runs, for every ``n`` of ``--n``, on fresh
engines: once as one request with ``n`` sequences (one prefill, the prompt's pages shared,
copy-on-write of the last one) and once as ``n`` separate requests seeded ``seed + i`` (the
same tokens, up to float reduction order); both with the prefix cache off, then once more
with it on. Every request is added at once. ``--repeats`` rounds run every cell in turn
(interleaved, shared and separate in alternating order), and medians are reported: output
tokens per wall second and per CPU second of the process (a loaded host's other jobs inflate
CPU time far less than wall time), the peak of KV pages held (``PagerStats.num_kv``; with the
cache on also KV + cached prefix pages, and KV + the cached pages some request pins, leaving
out those kept only for reuse), and the ratios shared / separate, against the
issue's targets (at n = 8: at least 1.5x the throughput and at most 0.4x the peak pages).
The report records the commit and refuses a tree with uncommitted changes unless
``--allow-dirty``.

Then the sampler's cost per decode step at batch 64 with every control on (penalties, logit
bias, min-p, min-tokens, top-k/top-p, seeded draws): the median time of ``sample`` (metadata
built from the running requests, logits of the model's vocabulary) against the median decode
step of the same 64 requests (target: at most 10%), in this thread's CPU time and in wall
time; ``--sampler-baseline REV`` times commit REV's sampler on the same rows, interleaved.
``--sampler-only`` measures only that (``--model smollm2 --sampler-only`` on the real
vocabulary and depth), ``--trace-only`` only the trace.

Usage: ``python benchmarks/parallel_sampling_bench.py --model PATH --out bench-out/parallel``
(defaults are the issue's trace; without ``--model`` a random Llama of the engine benchmark's
shape is built; ``--model smollm2`` is the real SmolLM2-135M-Instruct). A quick CPU run:
``--num-prompts 4 --prompt-len 64 96 --n 4 --max-tokens 8 16 --num-adapters 4 --num-layers 2
--sampler-batch 16``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from common import BENCH_HF_CONFIG, build_model, git_commit, machine_info  # noqa: E402
from sampler_bench import load_sampler  # noqa: E402

from loraplex.adapter_store.format import CanonicalAdapter, build_adapter  # noqa: E402
from loraplex.server import env  # noqa: E402
from loraplex.server.config import EngineConfig, SchedulerConfig  # noqa: E402
from loraplex.server.engine import engine as engine_module  # noqa: E402
from loraplex.server.engine.engine import Engine  # noqa: E402
from loraplex.server.engine.models.builtin import resolve_model_path  # noqa: E402
from loraplex.server.engine.models.config import ModelConfig  # noqa: E402
from loraplex.server.engine.pager import PageKind, Pager  # noqa: E402
from loraplex.server.engine.request import SamplingParams  # noqa: E402
from loraplex.server.engine.sampler import SamplingMetadata  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
RANK = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="an HF model directory, smollm2 or a .gguf file (default: random)")
    p.add_argument("--num-layers", type=int, default=BENCH_HF_CONFIG["num_hidden_layers"],
                   help="layers of the random model")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(256, 512), metavar=("MIN", "MAX"))
    p.add_argument("--n", type=int, nargs="+", default=[4, 8])
    p.add_argument("--max-tokens", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    p.add_argument("--num-adapters", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--num-pages", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--sampler-batch", type=int, default=64)
    p.add_argument("--sampler-only", action="store_true",
                   help="only the sampler's cost per decode step (no parallel-sampling trace)")
    p.add_argument("--trace-only", action="store_true",
                   help="only the parallel-sampling trace (no sampler cost)")
    p.add_argument("--prefix-cache", choices=("off", "on", "both"), default="both",
                   help="the prefix-cache variants to run")
    p.add_argument("--repeats", type=int, default=2,
                   help="interleaved rounds of every trace cell (medians reported)")
    p.add_argument("--allow-dirty", action="store_true",
                   help="report from a tree with uncommitted changes (the commit says -dirty)")
    p.add_argument("--sampler-baseline", default=None, metavar="REV",
                   help="a commit whose sampler is timed too, interleaved with this tree's")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="directory for the JSON")
    args = p.parse_args(argv)
    if args.sampler_only and args.trace_only:
        p.error("--sampler-only and --trace-only: pick one")
    if args.repeats < 1:
        p.error(f"--repeats: must be at least 1, got {args.repeats}")
    return args


class RandomAdapters:
    """``num`` rank-8 LoRA adapters on q, k, v and o, each with its own random weights (std
    0.02), served by digest from memory (an ``AdapterSource``)."""

    def __init__(self, config: ModelConfig, num: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        shapes = config.module_shapes()
        self.adapters: list[CanonicalAdapter] = []
        for _ in range(num):
            weights = {(layer, m): (torch.randn(RANK, shapes[m][0], generator=gen) * 0.02,
                                    torch.randn(shapes[m][1], RANK, generator=gen) * 0.02)
                       for layer in range(config.num_layers) for m in TARGETS}
            self.adapters.append(build_adapter(weights, rank=RANK, lora_alpha=2.0 * RANK,
                                               base_config=config))
        self._by_digest = {a.digest: a for a in self.adapters}

    def fetch(self, digest: str) -> CanonicalAdapter:
        return self._by_digest[digest]


def engine_for(args: argparse.Namespace, model: Path, source: RandomAdapters,
               prefix: bool) -> Engine:
    return Engine(EngineConfig(model=str(model), dtype=args.dtype, device=args.device,
                               num_pages=args.num_pages, enable_prefix_caching=prefix,
                               scheduler=SchedulerConfig(page_size=args.page_size)),
                  adapter_source=source)


def evictable_prefix_pages(pager: Pager) -> int:
    """Cached prefix pages no request pins (the pager counts evictable pages of every kind
    together, so the benchmark reads its LRU)."""
    return sum(len(pager._entries[key].pages) for key in pager._lru
               if pager._entries[key].kind is PageKind.PREFIX)


def run(engine: Engine, trace: list[dict], n: int, shared: bool) -> dict:
    """Add the trace at once (n sequences each, shared or as n requests); step to the end."""
    tokens: dict[tuple[str, int], list[int]] = {}
    start, cpu_start = time.perf_counter(), time.process_time()
    for t in trace:
        params = SamplingParams(max_tokens=t["max_tokens"], temperature=1.0, ignore_eos=True,
                                seed=t["seed"], n=n if shared else 1)
        if shared:
            engine.add_request(t["id"], t["prompt"], params, adapter_digest=t["adapter"])
            continue
        for i in range(n):
            single = SamplingParams(max_tokens=t["max_tokens"], temperature=1.0,
                                    ignore_eos=True, seed=t["seed"] + i)
            engine.add_request(f"{t['id']}.{i}", t["prompt"], single,
                               adapter_digest=t["adapter"])
    peak_kv = peak_held = peak_pinned = 0
    while engine.has_unfinished():
        for out in engine.step():
            rid, index = out.request_id, out.index
            if not shared:
                rid, index = rid.rsplit(".", 1)[0], int(rid.rsplit(".", 1)[1])
            tokens.setdefault((rid, index), []).extend(out.new_token_ids)
        s = engine.pager.stats()
        peak_kv = max(peak_kv, s.num_kv)
        peak_held = max(peak_held, s.num_kv + s.num_prefix)
        peak_pinned = max(peak_pinned,
                          s.num_kv + s.num_prefix - evictable_prefix_pages(engine.pager))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    num_tokens = sum(len(v) for v in tokens.values())
    return {"wall_s": wall, "cpu_s": cpu, "output_tokens": num_tokens,
            "tokens_per_s": num_tokens / wall, "tokens_per_cpu_s": num_tokens / cpu,
            "peak_kv_pages": peak_kv, "peak_kv_and_prefix_pages": peak_held,
            "peak_pinned_pages": peak_pinned,
            "preemptions": engine.stats().num_preemptions,
            "tokens": {f"{k[0]}/{k[1]}": v for k, v in tokens.items()}}


def sampler_cost(args: argparse.Namespace, model: Path) -> dict:
    """Median ``sample`` time (every control on) against the median decode step, batch B.

    Times are this thread's CPU time (the engine runs in it, on ``--threads`` torch threads:
    with one, a loaded host's other jobs do not count) and wall time. The engine's own call
    of the sampler is timed too, so the step without it (``rest``) is known and each
    sampler's share is ``sampler / (rest + sampler)``; ``--sampler-baseline REV`` times
    commit REV's sampler on the same rows at every step, interleaved with this tree's.
    """
    batch = args.sampler_batch
    engine = Engine(EngineConfig(model=str(model), dtype=args.dtype, device=args.device,
                                 num_pages=args.num_pages,
                                 scheduler=SchedulerConfig(page_size=args.page_size)))
    vocab = engine.model_config.vocab_size
    rng = random.Random(args.seed)
    for i in range(batch):
        params = SamplingParams(
            max_tokens=24, temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=i,
            presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
            min_tokens=24, logit_bias={rng.randrange(vocab): 5.0 for _ in range(16)},
            ignore_eos=True)
        engine.add_request(f"s{i}", [rng.randrange(vocab) for _ in range(64)], params)
    variants: dict[str, Any] = {"this tree": sys.modules[SamplingMetadata.__module__]}
    if args.sampler_baseline:
        variants = {f"baseline {args.sampler_baseline}": load_sampler(args.sampler_baseline),
                    **variants}
    inner: list[float] = []  # CPU time of the engine's own sampler calls in this step
    own = getattr(engine_module, "sample", None)

    def timed_sample(logits: torch.Tensor, metadata: Any) -> Any:
        start = time.thread_time()
        out = own(logits, metadata)
        inner.append(time.thread_time() - start)
        return out

    if own is not None:
        engine_module.sample = timed_sample
    engine.step()  # the prefills
    steps, steps_cpu, rests = [], [], []
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    logits = torch.randn(batch, vocab, device=engine.device)
    try:
        while engine.has_unfinished():
            running = list(engine.scheduler.running)
            decode = len(running) == batch
            inner.clear()
            t0, c0 = time.perf_counter(), time.thread_time()
            engine.step()
            if not decode:
                continue
            steps.append(time.perf_counter() - t0)
            steps_cpu.append(time.thread_time() - c0)
            rests.append(steps_cpu[-1] - sum(inner))
            order = list(variants.items())
            for name, module in (order if len(steps) % 2 else order[::-1]):
                t0, c0 = time.perf_counter(), time.thread_time()
                meta = module.SamplingMetadata.from_requests(running, vocab,
                                                             engine.eos_token_ids, engine.device)
                out = module.sample(logits, meta)
                if engine.device.type == "cuda":
                    torch.cuda.synchronize()
                cpu[name].append(time.thread_time() - c0)
                wall[name].append(time.perf_counter() - t0)
                del out
    finally:
        if own is not None:
            engine_module.sample = own
    step, step_cpu = statistics.median(steps), statistics.median(steps_cpu)
    rest = statistics.median(rests) if own is not None else None
    result: dict[str, Any] = {"batch": batch, "median_step_s": step,
                              "median_step_cpu_s": step_cpu, "median_rest_cpu_s": rest,
                              "target": 0.10, "samplers": {}}
    for name in variants:
        s_wall, s_cpu = statistics.median(wall[name]), statistics.median(cpu[name])
        base = rest if rest is not None else step_cpu - s_cpu
        result["samplers"][name] = {"median_sample_s": s_wall, "median_sample_cpu_s": s_cpu,
                                    "share_cpu": s_cpu / (base + s_cpu)}
    mine = result["samplers"]["this tree"]
    result["median_sample_s"] = mine["median_sample_s"]
    result["sampler_share_of_step"] = mine["median_sample_s"] / step  # wall, as before
    result["sampler_share_of_step_cpu"] = mine["share_cpu"]
    return result


SUMMED = ("tokens_per_s", "tokens_per_cpu_s", "wall_s", "cpu_s", "peak_kv_pages",
          "peak_kv_and_prefix_pages", "peak_pinned_pages", "preemptions")


def summarize(n: int, prefix: bool, rounds: list[dict[str, dict]]) -> dict:
    """One cell's report from its rounds (``{"shared": run, "separate": run}`` each, tokens
    already compared): the median of every figure per system, the ratios shared / separate of
    the medians, and each round's figures."""
    row: dict[str, Any] = {"n": n, "prefix_cache": prefix, "repeats": len(rounds)}
    for system in ("shared", "separate"):
        row[system] = {k: statistics.median(r[system][k] for r in rounds) for k in SUMMED}
        row[system]["output_tokens"] = rounds[0][system]["output_tokens"]
    a, b = row["shared"], row["separate"]
    row["throughput_ratio"] = a["tokens_per_s"] / b["tokens_per_s"]
    row["cpu_throughput_ratio"] = a["tokens_per_cpu_s"] / b["tokens_per_cpu_s"]
    row["peak_kv_ratio"] = a["peak_kv_pages"] / b["peak_kv_pages"]
    row["peak_pages_ratio"] = a["peak_kv_and_prefix_pages"] / b["peak_kv_and_prefix_pages"]
    row["peak_pinned_ratio"] = a["peak_pinned_pages"] / b["peak_pinned_pages"]
    row["same_tokens"] = [r["same_tokens"] for r in rounds]
    row["rounds"] = [{s: {k: r[s][k] for k in SUMMED} for s in ("shared", "separate")}
                     for r in rounds]
    return row


def trace_runs(args: argparse.Namespace, model: Path) -> list[dict]:
    """Every (n, prefix cache) cell, shared and separate, ``--repeats`` interleaved rounds."""
    config = ModelConfig.from_pretrained(str(model))
    rng = random.Random(args.seed)
    source = RandomAdapters(config, args.num_adapters, args.seed)
    digests = [a.digest for a in source.adapters]
    trace = [{"id": f"p{i}", "adapter": digests[i % len(digests)], "seed": 1000 * i,
              "prompt": [rng.randrange(config.vocab_size)
                         for _ in range(rng.randint(*args.prompt_len))],
              "max_tokens": rng.randint(*args.max_tokens)}
             for i in range(args.num_prompts)]
    prefixes = {"off": (False,), "on": (True,), "both": (False, True)}[args.prefix_cache]
    cells = [(n, prefix) for n in args.n for prefix in prefixes]
    rounds: dict[tuple[int, bool], list[dict]] = {cell: [] for cell in cells}
    print(f"{'round':>5} {'n':>3} {'prefix':>6} {'system':>9} {'tok/s':>8} {'tok/CPU s':>9} "
          f"{'peak KV':>8} {'KV+pfx':>7} {'pinned':>7} {'preempt':>7}")
    for repeat in range(args.repeats):
        for j, (n, prefix) in enumerate(cells):
            # alternate which system goes first, so neither always runs on a warmer host
            order = (True, False) if (repeat + j) % 2 == 0 else (False, True)
            runs = {}
            for shared in order:
                engine = engine_for(args, model, source, prefix)
                r = run(engine, trace, n, shared)
                del engine
                gc.collect()
                name = "shared" if shared else "separate"
                runs[name] = r
                print(f"{repeat:>5} {n:>3} {str(prefix):>6} {name:>9} {r['tokens_per_s']:>8.1f} "
                      f"{r['tokens_per_cpu_s']:>9.1f} {r['peak_kv_pages']:>8} "
                      f"{r['peak_kv_and_prefix_pages']:>7} {r['peak_pinned_pages']:>7} "
                      f"{r['preemptions']:>7}", flush=True)
            a, b = runs["shared"]["tokens"], runs["separate"]["tokens"]
            runs["same_tokens"] = f"{sum(a[k] == b.get(k) for k in a)}/{len(a)}"
            for r in (runs["shared"], runs["separate"]):
                del r["tokens"]
            rounds[n, prefix].append(runs)
    results = [summarize(n, prefix, rounds[n, prefix]) for n, prefix in cells]
    print(f"medians of {args.repeats} rounds, shared / separate:")
    for row in results:
        a, b = row["shared"], row["separate"]
        print(f"  n={row['n']} prefix={str(row['prefix_cache']):<5} tok/s "
              f"{a['tokens_per_s']:.1f}/{b['tokens_per_s']:.1f} = {row['throughput_ratio']:.2f}x;"
              f" tok/CPU s {a['tokens_per_cpu_s']:.1f}/{b['tokens_per_cpu_s']:.1f} = "
              f"{row['cpu_throughput_ratio']:.2f}x; peak KV {a['peak_kv_pages']:.0f}/"
              f"{b['peak_kv_pages']:.0f} = {row['peak_kv_ratio']:.2f}x; KV+prefix "
              f"{row['peak_pages_ratio']:.2f}x; pinned {row['peak_pinned_ratio']:.2f}x; "
              f"same tokens {', '.join(row['same_tokens'])}")
    return results


def sampler_report(args: argparse.Namespace, model: Path) -> dict:
    """``sampler_cost``, printed."""
    cost = sampler_cost(args, model)
    rest = cost["median_rest_cpu_s"]
    print(f"decode step at batch {cost['batch']}: {cost['median_step_s'] * 1e3:.1f} ms wall, "
          f"{cost['median_step_cpu_s'] * 1e3:.1f} ms CPU"
          + ("" if rest is None else f" ({rest * 1e3:.1f} ms CPU without its sampler call)"))
    for name, s in cost["samplers"].items():
        print(f"{name}: sampler at batch {cost['batch']}, every control on: "
              f"{s['median_sample_s'] * 1e3:.2f} ms wall, {s['median_sample_cpu_s'] * 1e3:.2f} ms "
              f"CPU: {s['share_cpu']:.1%} of the step's CPU time (target <= 10%)")
    return cost


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    commit = git_commit()
    if commit.endswith("-dirty") and not args.allow_dirty:
        raise SystemExit(f"commit {commit}: uncommitted changes; commit them (numbers are "
                         "quoted from a committed tree) or pass --allow-dirty")
    torch.set_num_threads(args.threads)
    cache = env.cache_dir() / "bench"
    if args.model:
        model = Path(resolve_model_path(args.model))
    else:
        model = build_model(cache, {**BENCH_HF_CONFIG, "num_hidden_layers": args.num_layers})
    print(f"commit {commit}, model {model}")
    results = [] if args.sampler_only else trace_runs(args, model)
    report: dict[str, Any] = {"machine": machine_info(args.threads), "commit": commit,
                              "args": {k: (str(v) if isinstance(v, Path) else v)
                                       for k, v in vars(args).items()},
                              "runs": results}
    if not args.trace_only:
        report["sampler"] = sampler_report(args, model)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "parallel_sampling_bench.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
