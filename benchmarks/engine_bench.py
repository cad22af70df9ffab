"""Engine-core benchmark: loraplex against transformers ``generate`` and vLLM on the same requests.

loraplex and transformers run in this one process, interleaved over repeats, on a random
Llama (hidden 1024, 8 layers, 16 heads, intermediate 2816, vocab 32000) with token-id prompts:
loraplex admits every request at once (continuous batching, chunked prefill), transformers
runs static batches of 16 (``loadtest/baseline.py``). ``--systems ... vllm-base`` adds vLLM's
CPU build (``make bench-peers``; ``vllm_peer.py``): one base engine per dtype in its own venv
and process, on the same model folder (the random weights' safetensors, or SmolLM2's converted
folder), the same token-id prompts, greedy, EOS ignored, the same ``max_tokens``, every request
in one ``LLM.generate``, its runs interleaved with the others'; its CPU time is that of its
whole process tree (engine core and worker). Reported per dtype:

* end-to-end output tokens/s, best and median over the repeats, and loraplex / transformers;
* decode tokens/s: loraplex's median decode-only step with every request running, and
  transformers' batch decode (time after each batch's first token, timed by a streamer);
* the roofline: measured copy bandwidth and GEMM throughput, and the decode bounds they give
  for each system's batch size;
* how many requests got the same greedy tokens from both (random models have near-ties, and
  batching changes the reduction order, so this is reported, not asserted);
* with ``vllm-base``: loraplex / vLLM per wall second and per CPU second, and how many requests
  got vLLM's greedy tokens from loraplex (in float32 the two should agree).

``--model smollm2`` runs the same on the real SmolLM2-135M-Instruct (30 layers x hidden 576, 9
heads / 3 KV heads, vocab 49152: deep and narrow, so per-layer overhead shows). ``--profile``
adds a pass with ``step_profile.StepProfiler`` attached and prints where a step's time goes
(GEMMs, attention, LoRA, sampling, scheduling, ...), for decode-only and mixed steps.

Usage: ``python benchmarks/engine_bench.py --out bench-out`` (``--num-requests 16
--num-layers 2 --repeats 1 --dtype float32`` for a quick run). ``--threads`` sets torch's
threads for both systems; on a machine shared with other jobs, 1 thread each gives steadier
numbers than 2 (OpenMP threads stall on each other when a core is taken away; vLLM's OpenMP
threads are bound to cores 0 to ``--threads`` - 1). The report carries the commit, and the
benchmark refuses a tree with uncommitted changes unless ``--allow-dirty``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from common import (  # noqa: E402
    BENCH_HF_CONFIG,
    MODEL_CHOICES,
    EngineRun,
    bench_model,
    copy_bandwidth,
    decode_roofline,
    gemm_throughput,
    git_commit,
    machine_info,
    make_requests,
    median,
    pad_token_id,
    run_engine,
)
from step_profile import breakdowns_json, call_overhead_s, profile_engine, profile_table  # noqa: E402,E501
from vllm_peer import VllmPeer, check_peer_venv, engine_kwargs, peer_info  # noqa: E402

from loraplex.loadtest.baseline import (  # noqa: E402
    BaselineRequest,
    BaselineRun,
    TransformersBaseline,
)
from loraplex.server import env  # noqa: E402
from loraplex.server.config import EngineConfig, SchedulerConfig  # noqa: E402
from loraplex.server.engine.engine import Engine  # noqa: E402
from loraplex.server.engine.models.config import ModelConfig, parse_dtype  # noqa: E402

SYSTEMS = ("loraplex", "transformers", "vllm-base")
DEFAULT_SYSTEMS = ("loraplex", "transformers")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16", "float16"])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="transformers' static batch")
    p.add_argument("--threads", type=int, default=2, help="torch threads, for both systems")
    p.add_argument("--model", default="random", choices=MODEL_CHOICES,
                   help="random: hidden 1024 x 8 layers (random weights); smollm2: the real "
                        "SmolLM2-135M-Instruct, 576 x 30 layers")
    p.add_argument("--num-layers", type=int, default=BENCH_HF_CONFIG["num_hidden_layers"],
                   help="shrink the random model for quick runs")
    p.add_argument("--profile", action="store_true",
                   help="one more loraplex pass with the step profiler: where a step's time "
                        "goes")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=SchedulerConfig().max_num_batched_tokens)
    p.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=SYSTEMS,
                   help="vllm-base: vLLM's CPU build from the peer venv (make bench-peers)")
    p.add_argument("--allow-dirty", action="store_true",
                   help="report from a tree with uncommitted changes (the commit says -dirty)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where the model is built (default: LORAPLEX_CACHE_DIR/bench)")
    p.add_argument("--out", type=Path, default=None, help="directory for engine_bench.json")
    args = p.parse_args(argv)
    check_peer_venv(p, args.systems)
    return args


def agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, float]:
    """Fraction of requests with identical tokens, and mean fraction of tokens before the
    first difference."""
    ids = sorted(a)
    same = sum(a[i] == b[i] for i in ids)
    prefix = []
    for i in ids:
        n = next((k for k, (x, y) in enumerate(zip(a[i], b[i])) if x != y), min(len(a[i]),
                                                                             len(b[i])))
        prefix.append(n / max(len(a[i]), 1))
    return {"requests_identical": same / len(ids), "mean_prefix_fraction": sum(prefix) / len(ids)}


def bench_dtype(args: argparse.Namespace, model_path: Path, hf_config: dict, dtype_name: str,
                requests: list[BaselineRequest], bandwidth: float, peer: VllmPeer | None = None
                ) -> tuple[dict, dict[str, dict[str, list[int]]]]:
    """Every system on ``requests`` in one dtype (vLLM through ``peer``, started in that dtype):
    the report, and each system's tokens."""
    dtype = parse_dtype(dtype_name)
    config = ModelConfig.from_pretrained(str(model_path))
    engine = baseline = None
    if "loraplex" in args.systems:
        # Prefix caching off: repeats send the same prompts, and the baseline has no cache.
        engine = Engine(EngineConfig(
            model=str(model_path), dtype=dtype_name, enable_prefix_caching=False,
            scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens)))
    if "transformers" in args.systems:
        baseline = TransformersBaseline(model_path, dtype, batch_size=args.batch_size,
                                        pad_token_id=pad_token_id(hf_config))
    warm = [replace(r, request_id=f"warm-{r.request_id}", max_tokens=2)
            for r in requests[:args.batch_size]]
    if engine is not None:
        run_engine(engine, warm)
    if baseline is not None:
        baseline.run(warm)
    if peer is not None:
        peer.warm_up(requests)

    lp_runs: list[EngineRun] = []
    tf_runs: list[BaselineRun] = []
    vl_runs: list[EngineRun] = []
    cpu_s: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for rep in range(args.repeats):
        order = args.systems if rep % 2 == 0 else list(reversed(args.systems))
        for system in order:
            # CPU seconds beside wall seconds: on a shared machine wall time counts the
            # other tenants too (busy-waiting OpenMP threads count as CPU, so only T=1 is
            # clean)
            cpu0 = time.process_time()
            if system == "loraplex" and engine is not None:
                lp_runs.append(run_engine(engine, requests))
                rate = lp_runs[-1].output_tokens_per_s
            elif system == "transformers" and baseline is not None:
                tf_runs.append(baseline.run(requests))
                rate = tf_runs[-1].output_tokens_per_s
            elif system == "vllm-base" and peer is not None:
                # the driver times its own call: wall, and CPU of its whole process tree
                run, peer_cpu = peer.run(requests)
                vl_runs.append(run)
                rate = run.output_tokens_per_s
            cpu_s[system].append(peer_cpu if system == "vllm-base"
                                 else time.process_time() - cpu0)
            print(f"  [{dtype_name} rep {rep}] {system:12} {rate:8.1f} tok/s, "
                  f"{cpu_s[system][-1]:.1f} CPU s, load {os.getloadavg()[0]:.1f}",
                  file=sys.stderr)

    gemm = gemm_throughput(dtype)
    mean_ctx = (sum(len(r.prompt_token_ids) for r in requests) / len(requests)
                + args.max_tokens / 2)
    out: dict = {"gemm_flops": gemm}
    if lp_runs:
        e2e = [r.output_tokens_per_s for r in lp_runs]
        decode = [x for r in lp_runs for x in r.decode_step_rates(len(requests))]
        decode_cpu = [x for r in lp_runs for x in r.decode_step_rates(len(requests), cpu=True)]
        steps = [s.seconds for r in lp_runs for s in r.steps]
        out["loraplex"] = {
            "e2e_tok_s": e2e, "e2e_best": max(e2e), "e2e_median": median(e2e),
            "decode_tok_s_median": median(decode), "decode_batch": len(requests),
            "e2e_tok_cpu_s_median": median([r.num_output_tokens / c
                                            for r, c in zip(lp_runs, cpu_s["loraplex"])]),
            "decode_tok_cpu_s_median": median(decode_cpu),
            "num_decode_steps": len(decode), "num_steps": len(steps) // len(lp_runs),
            "wall_s": [r.wall_s for r in lp_runs], "cpu_s": cpu_s["loraplex"],
            "preemptions": sum(r.num_preemptions for r in lp_runs),
            "roofline": asdict(decode_roofline(config, dtype, len(requests), mean_ctx,
                                               bandwidth, gemm["best"])),
        }
    if tf_runs:
        e2e = [r.output_tokens_per_s for r in tf_runs]
        batch = min(args.batch_size, len(requests))
        full = [b for r in tf_runs for b in r.batches if b.num_requests == batch]
        prefill = [sum(b.prefill_s for b in r.batches) / r.wall_s for r in tf_runs]
        out["transformers"] = {
            "e2e_tok_s": e2e, "e2e_best": max(e2e), "e2e_median": median(e2e),
            "decode_tok_s_median": median([b.decode_tokens_per_s for b in full]),
            "decode_batch": batch, "prefill_fraction": median(prefill),
            "e2e_tok_cpu_s_median": median([r.num_output_tokens / c
                                            for r, c in zip(tf_runs, cpu_s["transformers"])]),
            "decode_tok_cpu_s_median": median([b.decode_tokens_per_cpu_s for b in full]),
            "wall_s": [r.wall_s for r in tf_runs], "cpu_s": cpu_s["transformers"],
            "roofline": asdict(decode_roofline(config, dtype, batch, mean_ctx,
                                               bandwidth, gemm["best"])),
        }
    if vl_runs:
        e2e = [r.output_tokens_per_s for r in vl_runs]
        # one LLM.generate per run, its decode-only steps timed on the engine core's clock
        # (vllm_driver.StepLog; no per-step CPU time there)
        vl_decode = [x for r in vl_runs for x in r.decode_step_rates(len(requests))]
        out["vllm-base"] = {
            "e2e_tok_s": e2e, "e2e_best": max(e2e), "e2e_median": median(e2e),
            "decode_tok_s_median": median(vl_decode), "decode_batch": len(requests),
            "num_decode_steps": len(vl_decode),
            "e2e_tok_cpu_s_median": median([r.num_output_tokens / c
                                            for r, c in zip(vl_runs, cpu_s["vllm-base"])]),
            "decode_tok_cpu_s_median": float("nan"),
            "wall_s": [r.wall_s for r in vl_runs], "cpu_s": cpu_s["vllm-base"],
            "cpu_per_wall_median": median([c / r.wall_s
                                           for r, c in zip(vl_runs, cpu_s["vllm-base"])]),
            "roofline": asdict(decode_roofline(config, dtype, len(requests), mean_ctx,
                                               bandwidth, gemm["best"])),
        }
    if lp_runs and vl_runs:
        lp, vl = out["loraplex"], out["vllm-base"]
        out["ratio_vllm_base"] = {
            "e2e_best": lp["e2e_best"] / vl["e2e_best"],
            "e2e_median": lp["e2e_median"] / vl["e2e_median"],
            "e2e_cpu": lp["e2e_tok_cpu_s_median"] / vl["e2e_tok_cpu_s_median"],
            "decode": lp["decode_tok_s_median"] / vl["decode_tok_s_median"]
            if vl["decode_tok_s_median"] > 0 else float("nan"),
            # the runs made side by side, ratio by ratio
            "e2e_pairwise_median": median([a.output_tokens_per_s / b.output_tokens_per_s
                                           for a, b in zip(lp_runs, vl_runs)]),
            "e2e_cpu_pairwise_median": median([
                (a.num_output_tokens / ca) / (b.num_output_tokens / cb)
                for a, b, ca, cb in zip(lp_runs, vl_runs, cpu_s["loraplex"],
                                        cpu_s["vllm-base"])])}
    if lp_runs and tf_runs:
        lp, tf = out["loraplex"], out["transformers"]
        out["ratio"] = {"e2e_best": lp["e2e_best"] / tf["e2e_best"],
                        "e2e_median": lp["e2e_median"] / tf["e2e_median"],
                        "decode": lp["decode_tok_s_median"] / tf["decode_tok_s_median"],
                        "e2e_cpu": lp["e2e_tok_cpu_s_median"] / tf["e2e_tok_cpu_s_median"],
                        "decode_cpu": (lp["decode_tok_cpu_s_median"]
                                       / tf["decode_tok_cpu_s_median"])}
    if args.profile and engine is not None:
        profile = profile_engine(engine, lambda on_step: run_engine(engine, requests, on_step))
        out["profile"] = {"breakdowns": breakdowns_json(profile),
                          "table": profile_table(profile, call_overhead_s())}
    tokens: dict[str, dict[str, list[int]]] = {}
    if lp_runs:
        tokens["loraplex"] = lp_runs[0].token_ids
    if tf_runs:
        tokens["transformers"] = {r.request_id: r.token_ids for r in tf_runs[0].results}
    if vl_runs:
        tokens["vllm-base"] = vl_runs[0].token_ids
    if lp_runs and tf_runs:
        out["agreement"] = agreement(tokens["loraplex"], tokens["transformers"])
    if lp_runs and vl_runs:
        out["agreement_vllm_base"] = agreement(tokens["loraplex"], tokens["vllm-base"])
    return out, tokens


def print_table(args: argparse.Namespace, report: dict) -> None:
    m = report["machine"]
    print(f"\nengine benchmark: {args.num_requests} requests, prompts "
          f"{args.prompt_len[0]}-{args.prompt_len[1]} tokens, {args.max_tokens} new tokens, "
          f"{args.model} model ({report['model']['num_hidden_layers']} layers x "
          f"{report['model']['hidden_size']}); {m['cpu']}, {m['cores']} cores, "
          f"torch threads {m['torch_threads']} (every system), commit {m['commit']}")
    if "vllm" in report:
        print(f"vLLM peer: {report['vllm']['version']}; "
              + " ".join(f"{k}={v}" for k, v in report["vllm"]["env"].items()
                         if k.startswith("VLLM_CPU")))
    print(f"copy bandwidth {report['copy_bandwidth'] / 1e9:.1f} GB/s (read + write)")
    head = (f"{'dtype':9} {'system':13} {'e2e best':>9} {'e2e med':>9} {'decode':>8} "
            f"{'batch':>5} {'roof mem':>9} {'roof cmp':>9} {'e2e/cpu':>8} {'dec/cpu':>8}  notes")
    print(head)
    print("-" * len(head))
    for dtype, res in report["results"].items():
        for system in SYSTEMS:
            if system not in res:
                continue
            r = res[system]
            roof = r["roofline"]
            if system == "transformers":
                notes = f"prefill {r['prefill_fraction']:.0%} of wall"
            elif system == "vllm-base":
                notes = f"{r['cpu_per_wall_median']:.2f} CPU s per wall s (process tree)"
            else:
                notes = f"{r['num_steps']} steps, {r['preemptions']} preemptions"
            print(f"{dtype:9} {system:13} {r['e2e_best']:9.1f} {r['e2e_median']:9.1f} "
                  f"{r['decode_tok_s_median']:8.1f} {r['decode_batch']:5d} "
                  f"{roof['memory_bound']:9.1f} {roof['compute_bound']:9.1f} "
                  f"{r['e2e_tok_cpu_s_median']:8.1f} {r['decode_tok_cpu_s_median']:8.1f}  {notes}")
        if "ratio" in res:
            q, a = res["ratio"], res["agreement"]
            print(f"{dtype:9} {'ratio':13} {q['e2e_best']:8.2f}x {q['e2e_median']:8.2f}x "
                  f"{q['decode']:7.2f}x {'':5} {'':9} {'':9} {q['e2e_cpu']:7.2f}x "
                  f"{q['decode_cpu']:7.2f}x  GEMM "
                  f"{res['gemm_flops']['best'] / 1e9:.0f} GFLOP/s; identical tokens on "
                  f"{a['requests_identical']:.0%} of requests")
        if "ratio_vllm_base" in res:
            q, a = res["ratio_vllm_base"], res["agreement_vllm_base"]
            print(f"{dtype:9} {'lp/vllm-base':13} {q['e2e_best']:8.2f}x {q['e2e_median']:8.2f}x "
                  f"{q['decode']:7.2f}x {'':5} {'':9} {'':9} {q['e2e_cpu']:7.2f}x {'':>8}  "
                  "vLLM's greedy "
                  f"tokens on {a['requests_identical']:.0%} of requests "
                  f"({a['mean_prefix_fraction']:.0%} of tokens before the first difference)")
        if "profile" in res:
            print(f"\n{dtype} loraplex step profile (a separate pass, "
                  f"{args.num_requests} requests):")
            print("\n".join(res["profile"]["table"]))
            print()
        if "agreement_with_fp32" in res:
            f = res["agreement_with_fp32"]
            print(f"{'':9} {'':13} tokens before the first difference from float32 "
                  f"{report['fp32_reference']}: "
                  + ", ".join(f"{system} {f[system]['mean_prefix_fraction']:.0%}"
                              for system in f))
    print("(tokens/s; decode: median decode-only step for loraplex, batch decode after the "
          "first token for transformers; roof: decode bounds for that batch from bandwidth "
          "(weights + KV read per step) and from GEMM throughput; /cpu: the same per CPU "
          "second of the process (vllm-base: of its driver's process tree, engine core and "
          "worker), which other jobs on the machine inflate far less (with one thread; with "
          "more it counts threads waiting on each other); vllm-base's decode: its engine core's "
          "decode-only steps, timed from their outputs' timestamps, no CPU column)")


def start_peers(args: argparse.Namespace, model_path: Path) -> dict[str, VllmPeer]:
    """One vLLM base engine per dtype where ``vllm-base`` is asked for, loaded side by side and
    ready before anything is timed (a loading engine would take the measured runs' CPU)."""
    if "vllm-base" not in args.systems:
        return {}
    kwargs = engine_kwargs(args.num_requests, args.prompt_len[1] + args.max_tokens,
                           args.max_num_batched_tokens, args.threads)
    peers = {d: VllmPeer(model_path, d, **kwargs) for d in args.dtype}
    try:
        for peer in peers.values():
            peer.wait_ready()
    except BaseException:
        for peer in peers.values():
            peer.close()
        raise
    return peers


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    commit = git_commit()
    if commit.endswith("-dirty") and not args.allow_dirty:
        raise SystemExit(f"commit {commit}: uncommitted changes; commit them (numbers are "
                         "quoted from a committed tree) or pass --allow-dirty")
    torch.set_num_threads(args.threads)
    cache_dir = args.cache_dir or env.cache_dir() / "bench"
    model_path, hf_config = bench_model(args.model, cache_dir, args.num_layers)
    requests = make_requests(args.num_requests, tuple(args.prompt_len), args.max_tokens,
                             hf_config["vocab_size"], seed=args.seed)
    peers = start_peers(args, model_path)
    try:
        bandwidth = copy_bandwidth()
        report: dict = {"args": {k: (str(v) if isinstance(v, Path) else v)
                                 for k, v in vars(args).items()},
                        "machine": machine_info(torch.get_num_threads()), "model": hf_config,
                        "commit": commit, "copy_bandwidth": bandwidth, "results": {}}
        if peers:
            report["vllm"] = peer_info(args.threads)
        # the float32 reference: transformers' tokens, loraplex's where transformers is not run
        fp32_tokens: dict[str, list[int]] | None = None
        for dtype_name in args.dtype:
            peer = peers.pop(dtype_name, None)
            try:
                res, tokens = bench_dtype(args, model_path, hf_config, dtype_name, requests,
                                          bandwidth, peer)
            finally:
                if peer is not None:
                    peer.close()
            if dtype_name == "float32":
                report["fp32_reference"] = next((s for s in ("transformers", "loraplex")
                                                 if s in tokens), None)
                fp32_tokens = tokens.get(report["fp32_reference"] or "")
            elif fp32_tokens is not None:
                # In 16 bits neither system matches float32 for long on a random model: how
                # far each follows it tells a real divergence from rounding noise.
                res["agreement_with_fp32"] = {system: agreement(t, fp32_tokens)
                                              for system, t in tokens.items()}
            report["results"][dtype_name] = res
            gc.collect()
    finally:
        for peer in peers.values():
            peer.close()
    print_table(args, report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "engine_bench.json"
        path.write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
