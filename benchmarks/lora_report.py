"""The LoRA benchmark's figures: per-system summaries, ratios, the issue's targets, the table.

Everything here works on what ``lora_bench.py`` measured (``Measure`` per timed run); nothing
runs a model.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from common import EngineRun, decode_roofline, machine_info, median

from loraplex.loadtest.baseline import BaselineRun  # noqa: I001
from loraplex.loadtest.baseline_peft import decode_step_rates, decode_tokens_per_s
from loraplex.server.engine.models.config import ModelConfig

VLLM_SYSTEMS = ("vllm", "vllm-base")
SYSTEMS = ("loraplex", "loraplex-base", "peft-mixed", "peft-grouped", *VLLM_SYSTEMS)
TARGET_LORA_VS_BASE = 0.9  # at N = 64, end to end
TARGET_LORA_VS_PEFT = 1.6  # at N = 64, end to end
TARGET_FLAT_IN_N = 0.85  # N = 2048 against N = 1
# against vLLM's CPU build (issue 21), end to end, every trace
TARGET_LORA_VS_VLLM_BASE = 1.0  # loraplex at N = 64 against vLLM without adapters
TARGET_BASE_VS_VLLM_BASE = 1.0  # 1.1 on the decode-heavy trace
TARGET_BASE_VS_VLLM_BASE_DECODE_HEAVY = 1.1
TARGET_LORA_VS_VLLM = 3.0  # both with LoRA at N = 64


@dataclass(frozen=True)
class PageSplit:
    """The pool over one loraplex run, sampled after every step."""

    num_pages: int
    kv_max: int
    kv_mean: float
    adapter_max: int
    adapter_mean: float
    pinned_max: int  # adapter pages of running requests (the rest is cached, evictable)
    prefix_max: int


@dataclass(frozen=True)
class Measure:
    """One timed run of one system, with the CPU seconds it took and the 1-minute load average
    after it (the machine is shared: wall time also counts the other tenants)."""

    run: EngineRun | BaselineRun
    cpu_s: float
    load: float
    pages: PageSplit | None = None
    counters: Mapping[str, int] = field(default_factory=dict)  # engine counters over the run


@dataclass(frozen=True)
class TraceInfo:
    """One N's trace: distinct adapters, requests per rank, bytes of its distinct adapters."""

    num_distinct: int
    requests_by_rank: Mapping[int, int]
    adapter_bytes: int


def summarize(system: str, measures: Sequence[Measure], num_requests: int) -> dict:
    """Medians over the repeats, per wall second and per CPU second of the process (other jobs
    on a shared machine inflate CPU time far less than wall time). Decode: loraplex's
    decode-only steps with every request running; peft mixed's full batches after their first
    token (per step on the wall clock, per batch in CPU time); peft grouped's decode tokens over
    its decode time (its batches have every size, ``decode_batch`` is their mean)."""
    runs = [m.run for m in measures]
    e2e = [r.output_tokens_per_s for r in runs]
    e2e_cpu = [r.num_output_tokens / m.cpu_s for r, m in zip(runs, measures)]
    out = {"e2e_tok_s": e2e, "e2e_median": median(e2e), "e2e_cpu_tok_s": e2e_cpu,
           "e2e_cpu_median": median(e2e_cpu), "wall_s": [r.wall_s for r in runs],
           "cpu_s": [m.cpu_s for m in measures], "load": [m.load for m in measures]}
    if system in VLLM_SYSTEMS:
        # one LLM.generate per run; its decode-only steps timed on the engine core's clock
        # (vllm_driver.StepLog), which has no per-step CPU time
        engine_runs = [r for r in runs if isinstance(r, EngineRun)]
        rates = [x for r in engine_runs for x in r.decode_step_rates(num_requests)]
        out.update(decode_median=median(rates), decode_cpu_median=float("nan"),
                   decode_batch=num_requests, num_decode_steps=len(rates))
        return out
    if system.startswith("loraplex"):
        engine_runs = [r for r in runs if isinstance(r, EngineRun)]
        decode = [x for r in engine_runs for x in r.decode_step_rates(num_requests)]
        decode_cpu = [x for r in engine_runs for x in r.decode_step_rates(num_requests, True)]
        splits = [m.pages for m in measures if m.pages is not None]
        out.update(decode_median=median(decode), decode_cpu_median=median(decode_cpu),
                   decode_batch=num_requests, num_decode_steps=len(decode),
                   num_steps=len(engine_runs[0].steps),
                   pages={"num_pages": splits[0].num_pages,
                          "kv_max": max(s.kv_max for s in splits),
                          "kv_mean": median([s.kv_mean for s in splits]),
                          "adapter_max": max(s.adapter_max for s in splits),
                          "adapter_mean": median([s.adapter_mean for s in splits]),
                          "adapter_pinned_max": max(s.pinned_max for s in splits),
                          "prefix_max": max(s.prefix_max for s in splits)},
                   counters={k: sum(m.counters[k] for m in measures)
                             for k in measures[0].counters})
        return out
    peft_runs = [r for r in runs if isinstance(r, BaselineRun)]
    batches = [b for r in peft_runs for b in r.batches]
    if system == "peft-mixed":
        size = max(b.num_requests for b in batches)  # batch_size, unless fewer requests
        decode = median([x for r in peft_runs for x in decode_step_rates(r, size)])
        decode_cpu = median([b.decode_tokens_per_cpu_s for b in batches
                             if b.num_requests == size])
        batch = float(size)
    else:
        decode = median([decode_tokens_per_s(r) for r in peft_runs])
        tokens = sum(b.num_requests * (b.num_steps - 1) for b in batches)
        decode_cpu = ratio(tokens, sum(b.decode_cpu_s for b in batches))
        batch = sum(b.num_requests for b in batches) / len(batches)
    out.update(decode_median=decode, decode_cpu_median=decode_cpu, decode_batch=batch,
               num_batches=len(peft_runs[0].batches))
    return out


def tokens_of(run: EngineRun | BaselineRun) -> dict[str, list[int]]:
    if isinstance(run, EngineRun):
        return run.token_ids
    return {r.request_id: r.token_ids for r in run.results}


def same_tokens(a: Mapping[str, list[int]], b: Mapping[str, list[int]]) -> float:
    return sum(a[k] == b[k] for k in a) / len(a)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


METRICS = {"e2e": "e2e_median", "e2e_cpu": "e2e_cpu_median", "decode": "decode_median",
           "decode_cpu": "decode_cpu_median"}


def ratios(rec: Mapping[str, Sequence[Measure]], row: Mapping[str, dict]) -> dict[str, float]:
    """loraplex against its base (end to end: the median of the ratios of the runs made side
    by side) and against peft mixed; peft grouped against peft mixed; for every metric."""
    out: dict[str, float] = {}
    if rec["loraplex"] and rec["loraplex-base"]:
        pairs = list(zip(rec["loraplex"], rec["loraplex-base"]))
        out["lora_vs_base_e2e"] = median([ratio(a.run.output_tokens_per_s,
                                                b.run.output_tokens_per_s) for a, b in pairs])
        out["lora_vs_base_e2e_cpu"] = median([ratio(b.cpu_s, a.cpu_s) for a, b in pairs])
        for metric in ("decode", "decode_cpu"):
            out[f"lora_vs_base_{metric}"] = ratio(row["loraplex"][METRICS[metric]],
                                                  row["loraplex-base"][METRICS[metric]])
    # against vLLM: medians of the ratios of the runs made side by side (same repeat)
    for mine, theirs, key in (("loraplex", "vllm", "lora_vs_vllm"),
                              ("loraplex", "vllm-base", "lora_vs_vllm_base"),
                              ("loraplex-base", "vllm-base", "base_vs_vllm_base")):
        if rec[mine] and rec[theirs]:
            pairs = list(zip(rec[mine], rec[theirs]))
            out[key + "_e2e"] = median([ratio(a.run.output_tokens_per_s,
                                              b.run.output_tokens_per_s) for a, b in pairs])
            out[key + "_e2e_cpu"] = median([ratio(a.run.num_output_tokens / a.cpu_s,
                                                  b.run.num_output_tokens / b.cpu_s)
                                            for a, b in pairs])
            # decode-only steps, by the wall clock (vLLM's engine core: no per-step CPU time)
            out[key + "_decode"] = ratio(row[mine]["decode_median"],
                                         row[theirs]["decode_median"])
    for system, key in (("loraplex", "lora"), ("peft-grouped", "grouped")):
        if system in row and "peft-mixed" in row:
            for metric, name in METRICS.items():
                out[f"{key}_vs_peft_mixed_{metric}"] = ratio(row[system][name],
                                                             row["peft-mixed"][name])
    return out


def build_report(args: argparse.Namespace, hf_config: dict, config: ModelConfig,
                 mean_context: float, infos: Mapping[int, TraceInfo],
                 records: Mapping[int, Mapping[str, Sequence[Measure]]], bandwidth: float,
                 gemm: dict) -> dict:
    """The JSON report: per N, each system's summary, the ratios, token agreement and
    loraplex's decode roofline (with the adapters' bytes read per step)."""
    results: dict[str, dict] = {}
    decode_heavy = args.max_tokens > args.prompt_len[1]
    for n, rec in records.items():
        info = infos[n]
        row: dict = {"num_distinct": info.num_distinct,
                     "requests_by_rank": dict(info.requests_by_rank)}
        for system in SYSTEMS:
            if rec[system]:
                row[system] = summarize(system, rec[system], args.num_requests)
        row["ratio"] = ratios(rec, row)
        if rec["loraplex-base"] and rec["vllm-base"]:
            row["same_tokens_base"] = same_tokens(tokens_of(rec["loraplex-base"][0].run),
                                                  tokens_of(rec["vllm-base"][0].run))
        if rec["loraplex"]:
            # sanity: the adapters change the output, and peft agrees (near-ties aside)
            lora = tokens_of(rec["loraplex"][0].run)
            row["same_tokens"] = {f"loraplex_vs_{s}": same_tokens(lora, tokens_of(rec[s][0].run))
                                  for s in ("loraplex-base", "peft-mixed", "vllm") if rec[s]}
            roof = decode_roofline(config, getattr(torch, args.dtype), args.num_requests,
                                   mean_context, bandwidth, gemm["best"])
            row["loraplex"]["roofline"] = asdict(roof)
            row["loraplex"]["roofline_memory_with_adapters"] = (
                args.num_requests * bandwidth
                / (roof.weight_bytes + roof.kv_bytes + info.adapter_bytes))
        if any(rec[s] for s in SYSTEMS):
            row["roofline_e2e"] = e2e_roofline(args, config, mean_context, bandwidth,
                                               gemm["best"], row)
        results[str(n)] = row
    return {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "decode_heavy": decode_heavy,
            "machine": machine_info(torch.get_num_threads()),
            "env": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
            "model": hf_config, "dtype": args.dtype, "copy_bandwidth": bandwidth,
            "gemm_flops": gemm, "results": results,
            "targets": targets(results, decode_heavy)}


def e2e_roofline(args: argparse.Namespace, config: ModelConfig, mean_context: float,
                 bandwidth: float, gemm_flops: float, row: Mapping[str, dict]) -> dict:
    """The whole run's ceiling: every prompt and output token's FLOPs (weights and attention,
    ``decode_roofline``'s per-token count; LoRA's rank-16 products are under 1%) at the
    measured GEMM peak, and the weights read once per decode step (``max_tokens`` steps at
    least) at the measured copy bandwidth; output tokens over the larger of the two times.
    Each system's fraction: its median end-to-end rate over that bound."""
    roof = decode_roofline(config, getattr(torch, args.dtype), args.num_requests, mean_context,
                           bandwidth, gemm_flops)
    mean_prompt = mean_context - args.max_tokens / 2
    num_tokens = args.num_requests * (mean_prompt + args.max_tokens)
    compute_s = num_tokens * roof.flops_per_token / gemm_flops
    memory_s = args.max_tokens * roof.weight_bytes / bandwidth
    bound = args.num_requests * args.max_tokens / max(compute_s, memory_s)
    return {"compute_s": compute_s, "memory_s": memory_s, "bound_tok_s": bound,
            "flops_per_token": roof.flops_per_token, "weight_bytes": roof.weight_bytes,
            "fraction": {s: row[s]["e2e_median"] / bound for s in SYSTEMS if s in row}}


def targets(results: Mapping[str, dict], decode_heavy: bool = False) -> list[dict]:
    """The issue's targets where this run measured them, on the wall clock and in CPU time.

    N=2048 against N=1 also comes normalised by each N's own base-only runs (``lora_vs_base``
    at 2048 over the same at 1): the base does not depend on N, so this cancels the load
    other jobs put on the machine while one N or the other ran.
    """
    out = []

    def add(name: str, value: float | None, minimum: float) -> None:
        if value is not None:
            out.append({"target": name, "value": value, "min": minimum,
                        "met": value >= minimum})

    r64 = results.get("64", {}).get("ratio", {})
    add("N=64: loraplex / loraplex-base, end to end (paired runs)",
        r64.get("lora_vs_base_e2e"), TARGET_LORA_VS_BASE)
    add("N=64: loraplex / loraplex-base, end to end per CPU second (paired runs)",
        r64.get("lora_vs_base_e2e_cpu"), TARGET_LORA_VS_BASE)
    add("N=64: loraplex / peft-mixed, end to end", r64.get("lora_vs_peft_mixed_e2e"),
        TARGET_LORA_VS_PEFT)
    add("N=64: loraplex / peft-mixed, end to end per CPU second",
        r64.get("lora_vs_peft_mixed_e2e_cpu"), TARGET_LORA_VS_PEFT)
    base_min = TARGET_BASE_VS_VLLM_BASE_DECODE_HEAVY if decode_heavy else TARGET_BASE_VS_VLLM_BASE
    for n, row in results.items():
        q = row["ratio"]
        for suffix, label in (("_e2e", ""), ("_e2e_cpu", " per CPU second")):
            add(f"N={n}: loraplex-base / vllm-base, end to end{label}",
                q.get("base_vs_vllm_base" + suffix), base_min)
            if n == "64":
                add(f"N=64: loraplex / vllm-base, end to end{label}",
                    q.get("lora_vs_vllm_base" + suffix), TARGET_LORA_VS_VLLM_BASE)
                add(f"N=64: loraplex / vllm (both LoRA), end to end{label}",
                    q.get("lora_vs_vllm" + suffix), TARGET_LORA_VS_VLLM)
    lo, hi = results.get("1", {}), results.get("2048", {})
    if "loraplex" in lo and "loraplex" in hi:
        for metric, name in METRICS.items():
            add(f"loraplex N=2048 / N=1, {metric.replace('_cpu', ' per CPU second')}",
                ratio(hi["loraplex"][name], lo["loraplex"][name]), TARGET_FLAT_IN_N)
        if "lora_vs_base_e2e" in lo["ratio"] and "lora_vs_base_e2e" in hi["ratio"]:
            add("loraplex N=2048 / N=1, end to end, each against its base-only runs",
                ratio(hi["ratio"]["lora_vs_base_e2e"], lo["ratio"]["lora_vs_base_e2e"]),
                TARGET_FLAT_IN_N)
    return out


def print_table(args: argparse.Namespace, report: dict) -> None:
    m = report["machine"]
    print(f"\nLoRA benchmark: {args.num_requests} requests, prompts {args.prompt_len[0]}-"
          f"{args.prompt_len[1]} tokens, {args.max_tokens} new tokens, {args.dtype}, "
          f"{getattr(args, 'model', 'random')} model ({report['model']['num_hidden_layers']} "
          f"layers x {report['model']['hidden_size']}); adapters rank 8/16 on q,k,v,o, "
          f"Zipf(1); {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, "
          f"OMP_NUM_THREADS={report['env']['OMP_NUM_THREADS']}, commit {m['commit']}")
    head = (f"{'N':>5} {'distinct':>8} {'system':14} {'e2e':>7} {'e2e/cpu':>7} {'decode':>7} "
            f"{'dec/cpu':>7} {'batch':>5} {'runs':>4} {'load':>4}  pages (KV max/mean, "
            "adapter max/mean of the pool)")
    print(head)
    print("-" * len(head))
    first = None
    for n, row in report["results"].items():
        for system in SYSTEMS:
            if system in row:
                print(_system_line(n, row, system))
        q = row["ratio"]
        parts = [f"{label} {q[key + '_e2e']:.2f}x ({q[key + '_e2e_cpu']:.2f}x), "
                 f"decode {q[key + '_decode']:.2f}x ({q[key + '_decode_cpu']:.2f}x)"
                 for key, label in (("lora_vs_base", "LoRA/base"),
                                    ("lora_vs_peft_mixed", "loraplex/peft-mixed"),
                                    ("grouped_vs_peft_mixed", "grouped/mixed"))
                 if key + "_e2e" in q]
        parts += [f"{label} {q[key + '_e2e']:.2f}x ({q[key + '_e2e_cpu']:.2f}x)"
                  + (f", decode {q[key + '_decode']:.2f}x"
                     if math.isfinite(q.get(key + "_decode", math.nan)) else "")
                  for key, label in (("lora_vs_vllm", "loraplex/vllm"),
                                     ("lora_vs_vllm_base", "loraplex/vllm-base"),
                                     ("base_vs_vllm_base", "base/vllm-base"))
                  if key + "_e2e" in q]
        if "loraplex" in row:
            lp = row["loraplex"]
            first = first or lp
            parts.append(f"vs N={next(iter(report['results']))} "
                         f"{ratio(lp['e2e_median'], first['e2e_median']):.2f}x "
                         f"({ratio(lp['e2e_cpu_median'], first['e2e_cpu_median']):.2f}x)")
        if "same_tokens" in row:
            parts.append("same tokens as " + ", ".join(
                f"{k.removeprefix('loraplex_vs_')} {v:.0%}" for k, v in row["same_tokens"].items()))
        if "same_tokens_base" in row:
            parts.append(f"base same tokens as vllm-base {row['same_tokens_base']:.0%}")
        print(f"{'':>5} {'':>8} {'ratios':14} " + "; ".join(parts))
        if "roofline_e2e" in row:
            rf = row["roofline_e2e"]
            print(f"{'':>5} {'':>8} {'roofline':14} e2e bound {rf['bound_tok_s']:.0f} tok/s "
                  f"(FLOPs at GEMM peak {rf['compute_s']:.1f} s, weights per decode step at "
                  f"copy bandwidth {rf['memory_s']:.1f} s); fraction: " + ", ".join(
                      f"{k} {v:.0%}" for k, v in rf["fraction"].items()))
    print("(output tokens/s, medians over the runs: per wall second, and per CPU second of the "
          "process (in parentheses for ratios); decode: loraplex's median decode-only step "
          "with every request running, peft mixed's full batches after their first token, "
          "peft grouped's decode tokens over decode time (batch: its mean); LoRA/base "
          "end to end: median of the paired runs' ratios; load: median 1-minute load "
          "average; pages sampled after every step, pinned: adapters of running requests)")
    for t in report["targets"]:
        print(f"target {t['target']}: {t['value']:.2f}x (>= {t['min']}x) "
              f"{'met' if t['met'] else 'MISSED'}")
    for line in report["skipped"]:
        print(f"skipped: {line}")
    print(f"total {report['total_s'] / 60:.1f} min (adapters built in "
          f"{report['adapter_build_s']:.0f} s, {report['peft_adapters_loaded']} peft adapters "
          f"loaded in {report['peft_load_s']:.0f} s, untimed)")


def _system_line(n: str, row: dict, system: str) -> str:
    r = row[system]
    notes = ""
    if "pages" in r:
        p, c = r["pages"], r["counters"]
        notes = (f"KV {p['kv_max']}/{p['kv_mean']:.0f}, adapter {p['adapter_max']}/"
                 f"{p['adapter_mean']:.0f} ({p['adapter_pinned_max']} pinned) of "
                 f"{p['num_pages']}")
        if system == "loraplex":
            notes += (f"; {c['device_misses']} copies in, {c['adapter_evictions']} evictions, "
                      f"{c['num_preemptions']} preemptions")
    return (f"{n:>5} {row['num_distinct']:>8} {system:14} {r['e2e_median']:7.1f} "
            f"{r['e2e_cpu_median']:7.1f} {r['decode_median']:7.1f} {r['decode_cpu_median']:7.1f} "
            f"{r['decode_batch']:5.0f} {len(r['e2e_tok_s']):4d} {median(r['load']):4.1f}  {notes}")
