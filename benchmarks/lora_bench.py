"""LoRA benchmark: loraplex with N adapters against its own base model and transformers + peft.

The engine benchmark's model (random Llama: hidden 1024, 8 layers, 16 heads, intermediate 2816,
vocab 32000) and trace (``--num-requests`` token-id prompts of 64-128 tokens, 32 new tokens,
EOS ignored), plus N adapters on q, k, v and o (rank 8 for even indices, 16 for odd ones, so
that N = 1 is all rank 8; lora_B nonzero), one drawn per request from Zipf(a=1) over N. Four
systems run interleaved in this one process, on the same prompts and the same weights:

* ``loraplex``: every request at once, each with its adapter (continuous batching, chunked
  prefill, sorted adapter segments; adapters prefetched into the host cache before the timed
  run, copied into the pool's pages during it);
* ``loraplex-base``: the same engine and prompts without adapters;
* ``peft-mixed``: transformers + peft, static batches of ``--batch-size`` (64: every request
  at once, as the engines) in trace order, ``adapter_names``;
* ``peft-grouped``: the requests of one adapter together, up to a batch at a time (up to
  ``--grouped-max-n`` adapters: beyond that almost every batch holds one request);
* ``vllm`` / ``vllm-base``: vLLM's CPU build (``make bench-peers``) in its own venv and
  process (``vllm_peer.py``, ``vllm_driver.py``), on the same model folder and the same
  adapters as PEFT folders, one ``LLM.generate`` per run; with LoRA every request has an
  adapter (vLLM 0.32's CPU path gives a request without one the last slot's adapter), base
  requests go to a second engine started without LoRA. CPU time: the driver's process tree.

Every system runs ``--repeats`` times (peft too, unless ``--peft-repeats`` says fewer), in
``--dtype`` (float32 or bfloat16); the report carries the commit and refuses a tree with
uncommitted changes unless ``--allow-dirty``.

peft loads only the adapters the traces use, before timing. Reported per N, as medians over
the repeats, per wall second and per CPU second of the process (the machines are shared; CPU
time is far less inflated by other jobs): end-to-end output tokens/s, decode tokens/s
(loraplex: decode-only steps with every request running; peft mixed: full batches after their
first token; peft grouped: all decode tokens over all decode time, its batches being of every
size), the ratios against the issue's targets, and the pool's page split (KV and adapter
pages, sampled after every step: max, mean, and the adapter pages pinned by running requests).

The N adapters are cheap to make: a few random bases per rank, adapter ``i`` reusing one with
its own ``lora_alpha`` (a per-adapter scale), so every digest differs while the tensors are
shared. The engine's host cache holds every adapter the traces use, and its pool every
request's KV beside the largest trace's adapters: no request waits or is preempted for room,
while adapters cached by earlier runs are evicted (LRU) as a run needs their pages.

The defaults fit 30 minutes on a shared 2-core machine (about 15): loraplex runs every N
``--repeats`` times, peft (2-5 times slower a run) once at ``--peft-ns``, and no repeat starts
that would end after ``--budget-min``; the output says what was skipped and why.

``--model smollm2`` runs it on the real SmolLM2-135M-Instruct (30 layers x 576; the adapters
stay synthetic, fitted to its shapes). ``--profile`` adds two passes with
``step_profile.StepProfiler`` attached, at the largest N and without adapters, and prints where
a step's time goes (GEMMs, attention, LoRA, sampling, scheduling, ...); with ``vllm-base``
(``vllm``) among the systems, one more pass runs vLLM's base (LoRA, at the largest N) engine
under torch's profiler (``vllm_profile.py``) and prints its steps by the same categories.

Usage: ``OMP_NUM_THREADS=2 python benchmarks/lora_bench.py --out bench-out/lora``;
``--ns 1 64 --num-requests 16 --repeats 1 --num-layers 2`` for a quick run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import (  # noqa: E402
    BENCH_HF_CONFIG,
    MODEL_CHOICES,
    EngineRun,
    bench_model,
    copy_bandwidth,
    gemm_throughput,
    git_commit,
    make_requests,
    pad_token_id,
)
from common import run_engine as common_run_engine  # noqa: E402
from lora_report import (  # noqa: E402
    SYSTEMS,
    VLLM_SYSTEMS,
    Measure,
    PageSplit,
    TraceInfo,
    build_report,
    print_table,
)
from step_profile import (  # noqa: E402
    breakdowns_from_json,
    breakdowns_json,
    call_overhead_s,
    profile_engine,
    profile_table,
)
from vllm_peer import (  # noqa: E402
    PEER_VENV,
    VllmPeer,
    check_peer_venv,
    engine_kwargs,
    peer_info,
)

from loraplex.adapter_store.format import CanonicalAdapter, build_adapter  # noqa: E402,I001
from loraplex.kernels.layout import adapter_layout, kv_page_elems  # noqa: E402
from loraplex.loadtest.baseline import BaselineRequest  # noqa: E402
from loraplex.loadtest.baseline_peft import StaticPeftBaseline, save_peft_dir  # noqa: E402
from loraplex.loadtest.distributions import Popularity  # noqa: E402
from loraplex.server import env  # noqa: E402
from loraplex.server.config import EngineConfig, SchedulerConfig  # noqa: E402
from loraplex.server.engine.engine import Engine  # noqa: E402
from loraplex.server.engine.models.config import ModelConfig  # noqa: E402

RANKS = (8, 16)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ns", type=int, nargs="+", default=[1, 8, 64, 512, 2048],
                   help="adapter counts")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="runs per system and N")
    p.add_argument("--peft-repeats", type=int, default=None,
                   help="peft runs per system and N (the first repeats; default: --repeats, "
                        "the same for every system)")
    p.add_argument("--peft-ns", type=int, nargs="*", default=[1, 64, 2048],
                   help="the Ns peft runs at (those also in --ns), to fit the budget")
    p.add_argument("--grouped-max-n", type=int, default=64,
                   help="peft grouped runs only up to this N")
    p.add_argument("--budget-min", type=float, default=28.0,
                   help="start no repeat that would end after this many minutes")
    p.add_argument("--batch-size", type=int, default=64,
                   help="peft's static batch (64: every request at once, as the engines)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="loraplex's, peft's and vLLM's dtype")
    p.add_argument("--allow-dirty", action="store_true",
                   help="report from a tree with uncommitted changes (the commit says -dirty)")
    p.add_argument("--threads", type=int, default=2, help="torch threads, for every system")
    p.add_argument("--model", default="random", choices=MODEL_CHOICES,
                   help="random: hidden 1024 x 8 layers (random weights); smollm2: the real "
                        "SmolLM2-135M-Instruct, 576 x 30 layers")
    p.add_argument("--num-layers", type=int, default=BENCH_HF_CONFIG["num_hidden_layers"],
                   help="shrink the random model for quick runs")
    p.add_argument("--profile", action="store_true",
                   help="two more loraplex passes (largest N, no adapters) with the step "
                        "profiler: where a step's time goes")
    p.add_argument("--bases-per-rank", type=int, default=2,
                   help="random weight sets each rank's adapters are derived from")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=SchedulerConfig().max_num_batched_tokens)
    p.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS,
                   help="default: all, vLLM's where the peer venv exists (make bench-peers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--popularity", default="zipf:1",
                   help="how requests draw their adapter (zipf:1; uniform, as vllm bench serve)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="model and peft adapter directories (default: LORAPLEX_CACHE_DIR/bench)")
    p.add_argument("--out", type=Path, default=None, help="directory for lora_bench.json")
    args = p.parse_args(argv)
    if args.systems is None:
        has_peer = (PEER_VENV / ".installed").exists()
        args.systems = [s for s in SYSTEMS if has_peer or s not in VLLM_SYSTEMS]
    check_peer_venv(p, args.systems)
    if args.peft_repeats is None:
        args.peft_repeats = args.repeats
    return args


# -- adapters ----------------------------------------------------------------------------------
class SyntheticAdapters:
    """``num`` adapters by index, served by digest (an ``AdapterSource``).

    Adapter ``i`` has rank ``RANKS[i % 2]``, the weights of base ``(i // 2) % bases_per_rank``
    of that rank (random A and B, std 0.02), and ``lora_alpha = 2 r (1 + i / 8192)``: a scale of
    its own, so its digest differs from every other's while the tensors are shared.
    """

    def __init__(self, config: ModelConfig, num: int, bases_per_rank: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        shapes = config.module_shapes()
        bases = {}
        for rank in RANKS:
            for b in range(bases_per_rank):
                bases[rank, b] = {
                    (layer, m): (torch.randn(rank, shapes[m][0], generator=gen) * 0.02,
                                 torch.randn(shapes[m][1], rank, generator=gen) * 0.02)
                    for layer in range(config.num_layers) for m in TARGETS}
        self.adapters: list[CanonicalAdapter] = []
        for i in range(num):
            rank = RANKS[i % 2]
            self.adapters.append(build_adapter(
                bases[rank, (i // 2) % bases_per_rank], rank=rank,
                lora_alpha=2.0 * rank * (1.0 + i / 8192), base_config=config))
        self._by_digest = {a.digest: a for a in self.adapters}

    def fetch(self, digest: str) -> CanonicalAdapter:
        return self._by_digest[digest]


def adapter_indices(num_requests: int, num_adapters: int, seed: int,
                    popularity: str = "zipf:1") -> list[int]:
    """Each request's adapter: Zipf(a=1) over ``num_adapters`` (or another ``popularity``,
    ``loadtest/distributions.Popularity``: ``uniform`` as vLLM's benchmark client draws), one
    draw per request (the same uniform numbers for every N, so the traces differ only by N)."""
    rng = np.random.default_rng(seed)
    return Popularity.parse(popularity).sample(rng, num_requests, num_adapters).tolist()


def adapter_name(index: int) -> str:
    return f"a{index:04d}"


# -- loraplex, driven step by step -------------------------------------------------------------
def run_engine(engine: Engine, requests: Sequence[BaselineRequest],
               digests: Sequence[str | None], on_step: Callable[[bool], None] | None = None
               ) -> tuple[EngineRun, PageSplit, dict[str, int]]:
    """``common.run_engine`` with an adapter per request, sampling ``engine.stats().pages``
    after every step (outside the step's timing); ``on_step(decode_only)`` after each step."""
    before = engine.stats()
    samples = []

    def after_step(decode_only: bool) -> None:
        if on_step is not None:
            on_step(decode_only)
        samples.append(engine.stats().pages)

    run = common_run_engine(engine, requests, after_step, digests=digests)
    after = engine.stats()
    kv = [p.num_kv for p in samples]
    ad = [p.num_adapter for p in samples]
    # prefix caching is off, so every evictable page is a cached adapter's
    pinned = [p.num_adapter - p.num_evictable for p in samples]
    split = PageSplit(after.pages.num_pages, max(kv), sum(kv) / len(kv), max(ad),
                      sum(ad) / len(ad), max(pinned), max(p.num_prefix for p in samples))
    counters = {k: getattr(after, k) - getattr(before, k)
                for k in ("adapter_loads", "device_misses", "adapter_evictions",
                          "num_preemptions")}
    return run, split, counters


def prefetch(engine: Engine, digests: set[str], timeout_s: float = 120.0) -> None:
    """Bring every adapter into the host cache (untimed), as a server's prefetch would have."""
    assert engine.adapters is not None
    for d in digests:
        engine.adapters.prefetch(d)
    deadline = time.monotonic() + timeout_s
    while not digests <= set(engine.adapters.host_digests()) | set(
            engine.adapters.resident_digests()):
        if time.monotonic() > deadline:
            raise RuntimeError("adapters did not reach the host cache in time")
        time.sleep(0.01)


def engine_sizes(config: ModelConfig, page_size: int, requests: Sequence[BaselineRequest],
                 traces: dict[int, list[int]], dtype_bytes: int) -> tuple[int, int]:
    """(pool pages, host cache bytes): every request's KV beside the largest trace's adapters;
    every adapter of every trace in the host cache."""
    page_elems = kv_page_elems(page_size, config.num_kv_heads, config.head_dim)
    shapes = config.module_shapes()
    layouts = {r: adapter_layout(r, TARGETS, shapes) for r in RANKS}
    kv = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // page_size) for r in requests)
    adapter = max(sum(layouts[RANKS[i % 2]].num_pages(page_elems) for i in set(t))
                  for t in traces.values())
    used = set().union(*traces.values())
    host = sum(layouts[RANKS[i % 2]].num_elems for i in used) * config.num_layers * dtype_bytes
    return kv + adapter + 8, int(host * 1.25) + (64 << 20)


# -- the benchmark -----------------------------------------------------------------------------
def peft_plan(args: argparse.Namespace, ns: list[int]) -> tuple[list[int], list[int],
                                                                   list[str]]:
    """The Ns peft mixed and peft grouped run at, and what is skipped (and why)."""
    peft_ns = sorted(set(args.peft_ns) & set(ns))
    # with one adapter every batch holds only it, so peft mixed already runs it active
    grouped_ns = [n for n in peft_ns if 1 < n <= args.grouped_max_n]
    skipped = []
    if "peft-mixed" in args.systems and set(ns) - set(peft_ns):
        skipped.append(f"peft-mixed at N={sorted(set(ns) - set(peft_ns))} (--peft-ns "
                       f"{' '.join(map(str, peft_ns))}): the 30-minute budget")
    if "peft-grouped" in args.systems and set(ns) - set(grouped_ns):
        skipped.append(f"peft-grouped at N={sorted(set(ns) - set(grouped_ns))}: at N=1 it is "
                       "peft-mixed (every batch holds one adapter, run active); otherwise only "
                       f"up to --grouped-max-n {args.grouped_max_n} (beyond 64 nearly every "
                       "batch holds one request) and where peft-mixed runs")
    if args.peft_repeats < args.repeats:
        skipped.append(f"peft runs {args.peft_repeats} of {args.repeats} repeats (the first): "
                       "one peft run costs 2-5 loraplex runs")
    return peft_ns, grouped_ns, skipped


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    commit = git_commit()
    if commit.endswith("-dirty") and not args.allow_dirty:
        raise SystemExit(f"commit {commit}: uncommitted changes; commit them (numbers are "
                         "quoted from a committed tree) or pass --allow-dirty")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    t_start = time.perf_counter()
    ns = sorted(set(args.ns))
    peft_ns, grouped_ns, skipped = peft_plan(args, ns)
    cache_dir = args.cache_dir or env.cache_dir() / "bench"
    model_path, hf_config = bench_model(args.model, cache_dir, args.num_layers)
    config = ModelConfig.from_pretrained(str(model_path))
    requests = make_requests(args.num_requests, tuple(args.prompt_len), args.max_tokens,
                             hf_config["vocab_size"], seed=args.seed)
    traces = {n: adapter_indices(len(requests), n, args.seed, args.popularity) for n in ns}

    t0 = time.perf_counter()
    family = SyntheticAdapters(config, max(ns), args.bases_per_rank, args.seed)
    build_s = time.perf_counter() - t0
    print(f"built {max(ns)} adapters in {build_s:.1f} s", file=sys.stderr)

    engine = peft = None
    if {"loraplex", "loraplex-base"} & set(args.systems):
        num_pages, host_bytes = engine_sizes(config, 16, requests, traces,
                                             dtype.itemsize)
        engine = Engine(EngineConfig(
            model=str(model_path), dtype=args.dtype, enable_prefix_caching=False,
            num_pages=num_pages, host_cache_bytes=host_bytes, max_rank=max(RANKS),
            scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens)),
            adapter_source=family)
    peft_used = sorted(set().union(*(traces[n] for n in peft_ns))) if peft_ns else []
    peft_load_s = 0.0
    # PEFT folders (fp32 safetensors, the same tensors loraplex serves) for peft and vLLM
    root = cache_dir / "lora-bench-adapters"
    vllm_used = sorted(set().union(*traces.values())) if "vllm" in args.systems else []
    dirs = {adapter_name(i): save_peft_dir(family.adapters[i],
                                           root / family.adapters[i].digest[:24])
            for i in sorted(set(peft_used) | set(vllm_used))}
    if {"peft-mixed", "peft-grouped"} & set(args.systems) and peft_used:
        t0 = time.perf_counter()
        peft = StaticPeftBaseline(model_path, {adapter_name(i): dirs[adapter_name(i)]
                                               for i in peft_used}, dtype=dtype,
                                  batch_size=args.batch_size,
                                  pad_token_id=pad_token_id(hf_config))
        peft_load_s = time.perf_counter() - t0

    peers = start_peers(args, model_path, requests, traces)

    def peft_requests(n: int) -> list[BaselineRequest]:
        return [replace(r, adapter=adapter_name(i)) for r, i in zip(requests, traces[n])]

    def measure(system: str, n: int) -> Measure:
        digests = [family.adapters[i].digest for i in traces[n]]
        if system == "loraplex":
            assert engine is not None
            prefetch(engine, set(digests))
            cpu0 = time.process_time()
            run, pages, counters = run_engine(engine, requests, digests)
            return Measure(run, time.process_time() - cpu0, os.getloadavg()[0], pages,
                           counters)
        if system in peers:
            paths = [dirs[adapter_name(i)] for i in traces[n]] if system == "vllm" else None
            run, cpu_s = peers[system].run(requests, paths)
            return Measure(run, cpu_s, os.getloadavg()[0])
        cpu0 = time.process_time()
        if system == "loraplex-base":
            assert engine is not None
            run, pages, counters = run_engine(engine, requests, [None] * len(requests))
            return Measure(run, time.process_time() - cpu0, os.getloadavg()[0], pages,
                           counters)
        assert peft is not None
        peft_run = peft.run(peft_requests(n), system.removeprefix("peft-"))
        return Measure(peft_run, time.process_time() - cpu0, os.getloadavg()[0])

    warm_up(engine, peft, family, requests, traces, args.batch_size)
    for name, peer in peers.items():  # two tokens through each vLLM engine too
        peer.warm_up(requests, [dirs[adapter_name(i)] for i in traces[max(ns)]]
                     if name == "vllm" else None)
    records: dict[int, dict[str, list[Measure]]] = {n: {s: [] for s in SYSTEMS} for n in ns}
    rep_s: list[float] = []  # loraplex seconds per repeat: what a later repeat costs
    for rep in range(args.repeats):
        elapsed = time.perf_counter() - t_start
        if rep_s and elapsed + max(rep_s) > 60 * args.budget_min:
            skipped.append(f"repeats {rep}-{args.repeats - 1}: another would end after "
                           f"--budget-min {args.budget_min:g} ({elapsed / 60:.1f} min so far, "
                           f"{max(rep_s) / 60:.1f} min a repeat)")
            break
        rep_s.append(0.0)
        for k, n in enumerate(ns if rep % 2 == 0 else list(reversed(ns))):
            systems = [s for s in args.systems if s in peers or s.startswith("loraplex") or (
                rep < args.peft_repeats and peft is not None
                and n in (peft_ns if s == "peft-mixed" else grouped_ns))]
            for system in (systems if (rep + k) % 2 == 0 else list(reversed(systems))):
                m = measure(system, n)
                records[n][system].append(m)
                if system.startswith("loraplex"):
                    rep_s[-1] += m.run.wall_s
                print(f"  [rep {rep} N={n}] {system:14} {m.run.output_tokens_per_s:7.1f} "
                      f"tok/s, {m.cpu_s:.1f} CPU s, load {m.load:.1f}, "
                      f"{time.perf_counter() - t_start:.0f} s so far", file=sys.stderr)

    infos = {n: TraceInfo(len(set(t)), {r: sum(RANKS[i % 2] == r for i in t) for r in RANKS},
                          sum(family.adapters[i].nbytes for i in set(t)))
             for n, t in traces.items()}
    mean_context = (sum(len(r.prompt_token_ids) for r in requests) / len(requests)
                    + args.max_tokens / 2)
    for peer in peers.values():
        peer.close()
    report = build_report(args, hf_config, config, mean_context, infos, records,
                          copy_bandwidth(), gemm_throughput(dtype))
    if peers:
        report["vllm"] = {**peer_info(args.threads),
                          "max_loras": next(iter(peers.values())).max_loras}
    report.update(skipped=skipped, adapter_build_s=build_s, peft_load_s=peft_load_s,
                  peft_adapters_loaded=len(peft_used), total_s=time.perf_counter() - t_start)
    if engine is not None:
        report["engine"] = {"num_pages": engine.pager.num_pages,
                            "host_cache_bytes": engine.config.host_cache_bytes}
    profiles = profile_passes(engine, family, requests, traces) if args.profile else {}
    if profiles:
        report["profile"] = {name: breakdowns_json(b) for name, b in profiles.items()}
    # vLLM's engines profiled where they ran: base, and LoRA at the largest N
    peer_profiles = {}
    for system in ("vllm-base", "vllm"):
        if args.profile and system in args.systems:
            paths = ([dirs[adapter_name(i)] for i in traces[max(ns)]] if system == "vllm"
                     else None)
            peer_profiles[system] = vllm_profile_pass(args, model_path, requests, system, paths)
    for system, peer_profile in peer_profiles.items():
        report.setdefault("profile", {})[system] = peer_profile
    print_table(args, report)
    overhead = call_overhead_s()
    for name, breakdowns in profiles.items():
        print(f"\nloraplex step profile, {name} (a separate pass, {len(requests)} requests):")
        print("\n".join(profile_table(breakdowns, overhead)))
    for system, peer_profile in peer_profiles.items():
        what = "base" if system == "vllm-base" else f"LoRA, N={max(ns)}"
        print(f"\nvLLM {what} step profile (a separate pass, {len(requests)} requests, torch's "
              f"profiler: {peer_profile['profiled_wall_s']:.2f} s against "
              f"{peer_profile['wall_s']:.2f} s unprofiled):")
        print("\n".join(profile_table(breakdowns_from_json(peer_profile["profile"]),
                                       peer_profile["event_cost_s"], "profiled events")))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "lora_bench.json"
        path.write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")


def start_peers(args: argparse.Namespace, model_path: Path, requests: Sequence[BaselineRequest],
                traces: dict[int, list[int]]) -> dict[str, VllmPeer]:
    """vLLM's LoRA and base engines, each in its own driver process, where asked for. Its LoRA
    slots hold every distinct adapter of the largest trace (no swapping during a run)."""
    kwargs = engine_kwargs(len(requests), args.prompt_len[1] + args.max_tokens,
                           args.max_num_batched_tokens, args.threads)
    peers = {}
    if "vllm" in args.systems:
        distinct = max(len(set(t)) for t in traces.values())
        peers["vllm"] = VllmPeer(model_path, args.dtype, max_lora_rank=max(RANKS),
                                 max_loras=distinct, **kwargs)
    if "vllm-base" in args.systems:
        peers["vllm-base"] = VllmPeer(model_path, args.dtype, **kwargs)
    return {name: peer.wait_ready() for name, peer in peers.items()}


def vllm_profile_pass(args: argparse.Namespace, model_path: Path,
                      requests: Sequence[BaselineRequest], system: str,
                      adapters: Sequence[Path] | None) -> dict:
    """vLLM's base engine (``vllm-base``) or its LoRA engine (``vllm``, each request on
    ``adapters[i]``) on the same requests, in a driver of its own whose engine core runs in its
    process, under torch's profiler (``vllm_profile``): where its steps' time goes, by
    loraplex's categories. Started after the timed runs, as loraplex's profile passes."""
    kwargs = engine_kwargs(len(requests), args.prompt_len[1] + args.max_tokens,
                           args.max_num_batched_tokens, args.threads)
    if system == "vllm":
        kwargs.update(max_lora_rank=max(RANKS), max_loras=len(set(adapters or ())))
    peer = VllmPeer(model_path, args.dtype, profile=True, **kwargs)
    try:
        peer.warm_up(requests, adapters)
        out = peer.run_profile(requests, adapters)
    finally:
        peer.close()
    return out


def profile_passes(engine: Engine | None, family: SyntheticAdapters,
                   requests: Sequence[BaselineRequest], traces: dict[int, list[int]]) -> dict:
    """Step profiles at the largest N (adapters prefetched, as in the timed runs) and
    without adapters."""
    if engine is None:
        return {}
    n = max(traces)
    digests = [family.adapters[i].digest for i in traces[n]]
    prefetch(engine, set(digests))
    return {
        f"N={n}": profile_engine(engine, lambda on_step: run_engine(engine, requests, digests,
                                                                    on_step)),
        "no adapters": profile_engine(engine, lambda on_step: run_engine(
            engine, requests, [None] * len(requests), on_step)),
    }


def warm_up(engine: Engine | None, peft: StaticPeftBaseline | None, family: SyntheticAdapters,
            requests: Sequence[BaselineRequest], traces: dict[int, list[int]],
            batch_size: int) -> None:
    """Two tokens through every path (engine with and without adapters, peft mixed and
    grouped) on the first requests of the largest trace peft serves."""
    n = max(traces)
    if peft is not None:
        n = max(t for t in traces if all(adapter_name(i) in peft.adapter_dirs
                                         for i in traces[t][:batch_size]))
    warm = [replace(r, request_id=f"warm-{r.request_id}", max_tokens=2,
                    adapter=adapter_name(i))
            for r, i in zip(requests[:batch_size], traces[n])]
    if engine is not None:
        digests = [family.adapters[i].digest for i in traces[n][:len(warm)]]
        prefetch(engine, set(digests))
        run_engine(engine, warm, digests)
        run_engine(engine, warm, [None] * len(warm))
    if peft is not None:
        peft.run(warm, "mixed")
        peft.run(warm[:2], "grouped")


if __name__ == "__main__":
    main()
