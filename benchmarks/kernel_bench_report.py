"""The report of ``kernel_bench.py``: its ``Row``, the run's environment, a markdown table per
benchmark, the issue's targets checked against the measured rows, and the JSON and markdown
files."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Row:
    """One measured case: sizes, times in microseconds, derived ratios, or the error."""

    bench: str
    case: dict[str, Any]
    bytes: int = 0
    us: dict[str, float] = field(default_factory=dict)
    gbps: float = 0.0
    copy_frac: float = 0.0
    speedup: dict[str, float] = field(default_factory=dict)
    max_abs_err: float = 0.0
    error: str | None = None


def environment() -> dict[str, Any]:
    """GPU, driver, library versions and commit of this run."""
    import triton

    props = torch.cuda.get_device_properties(0)
    env = dict(gpu=props.name, sms=props.multi_processor_count,
               memory_gib=round(props.total_memory / 2**30, 1), torch=torch.__version__,
               triton=triton.__version__, cuda=torch.version.cuda, python=sys.version.split()[0])
    from loraplex.loadtest.records import git_commit  # after import_from_checkout

    try:
        env["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["driver"] = "unknown"
    env["commit"] = git_commit()
    return env


def markdown(env: dict[str, Any], rows: list[Row], peak_gbps: float, dtype: torch.dtype
             ) -> str:
    """The whole report as markdown (``dtype``: the kernel cases')."""
    lines = [f"# Kernel benchmark: {env['gpu']}", "",
             ", ".join(f"{k} {v}" for k, v in env.items()), "",
             f"Large-copy bandwidth measured in this run: {peak_gbps:.0f} GB/s (read + write).",
             ""]
    lora = [r for r in rows if r.bench in ("shrink", "expand", "sgmv")]
    lines += [f"## SGMV ({dtype})", "",
              "| op | phase | d | rank | T | adapters | us | eager us | GB/s | of peak "
              "| copy frac | vs ref | vs padded bmm | max err |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in lora:
        c = r.case
        head = f"| {r.bench} | {c['phase']} | {c['d']} | {c['rank']} | {c['tokens']} | " \
               f"{c['adapters']} |"
        if r.error:
            lines.append(f"{head} {r.error} ||||||||")
            continue
        lines.append(f"{head} {r.us['triton']:.1f} | {r.us['triton_eager']:.1f} | "
                     f"{r.gbps:.0f} | {r.gbps / peak_gbps:.2f} | {r.copy_frac:.2f} | "
                     f"{r.speedup['reference']:.1f}x | "
                     f"{r.speedup['padded_bmm']:.2f}x | {r.max_abs_err:.2g} |")
    lines += ["", f"## Paged decode attention ({dtype}) vs SDPA on contiguous K/V", "",
              "| batch | context | heads | us | SDPA us | SDPA backend | vs SDPA | GB/s "
              "| copy frac | max err |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r.bench == "decode_attention"):
        c = r.case
        head = f"| {c['batch']} | {c['context']} | {c['heads']} |"
        if r.error:
            lines.append(f"{head} {r.error} ||||||")
            continue
        lines.append(f"{head} {r.us['triton']:.1f} | {r.us['sdpa']:.1f} | "
                     f"{c['sdpa_backend']} | {r.speedup['sdpa']:.2f}x | {r.gbps:.0f} | "
                     f"{r.copy_frac:.2f} | {r.max_abs_err:.2g} |")
    lines += ["", "## Engine end to end: decode with one adapter per request vs the base model",
              "", *engine_table(rows), "", "## Targets (issue 4, H200)", "", *targets(rows), ""]
    return "\n".join(lines)


def engine_table(rows: list[Row]) -> list[str]:
    """The engine rows as a markdown table."""
    engine = [r for r in rows if r.bench == "engine"]
    if not engine:
        return ["Not run (`--no-engine`)."]
    lines = ["| model | dtype | batch | adapters (ranks on modules) | base step ms "
             "| LoRA step ms | base tok/s | LoRA tok/s | LoRA / base | timed steps |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in engine:
        c = r.case
        head = (f"| {c['model']} | {c['dtype']} | {c['batch']} | {c['adapters']} "
                f"({c['ranks']} on {c['modules']}) |")
        if r.error:
            lines.append(f"{head} {r.error} ||||||")
            continue
        base, lora = r.us["base"], r.us["lora"]
        lines.append(f"{head} {base / 1e3:.2f} | {lora / 1e3:.2f} | "
                     f"{c['batch'] / base * 1e6:.0f} | {c['batch'] / lora * 1e6:.0f} | "
                     f"{r.speedup['lora_vs_base']:.2f}x | {c['timed_steps']} |")
    return lines


def targets(rows: list[Row]) -> list[str]:
    """The issue's targets, checked against this run's rows (worst case of each)."""
    decode = [r for r in rows if r.bench in ("shrink", "expand") and not r.error
              and r.case["phase"] == "decode" and r.case["adapters"] == 256]
    attention = [r for r in rows if r.bench == "decode_attention" and not r.error]
    out = []
    if decode:
        frac = min(r.copy_frac for r in decode)
        speed = min(r.speedup["padded_bmm"] for r in decode)
        out.append(f"- SGMV decode, 256 adapters: worst {frac:.2f} of copy bandwidth (target "
                   f">= 0.60: {'met' if frac >= 0.6 else 'NOT met'}); worst {speed:.2f}x the "
                   f"padded gather + bmm (target >= 3x: {'met' if speed >= 3 else 'NOT met'})")
    if attention:
        ratio = max(1 / r.speedup["sdpa"] for r in attention)
        out.append(f"- paged decode attention: worst {ratio:.2f}x SDPA's time on contiguous K/V "
                   f"(target <= 1.3x: {'met' if ratio <= 1.3 else 'NOT met'})")
    for r in (r for r in rows if r.bench == "engine" and not r.error):
        ratio = r.speedup["lora_vs_base"]
        out.append(f"- engine, {r.case['adapters']} distinct adapters: {ratio:.2f}x the base "
                   f"model's decode throughput (target >= 0.9x: "
                   f"{'met' if ratio >= 0.9 else 'NOT met'})")
    return out or ["- no completed case to check"]


def write_results(out: Path, env: dict[str, Any], rows: list[Row], peak_gbps: float,
                  dtype: torch.dtype, start: float) -> str:
    """Write ``bench.json`` and ``bench.md`` (again, as more rows come in); returns the table."""
    env["seconds"] = round(time.monotonic() - start, 1)
    (out / "bench.json").write_text(json.dumps(
        dict(environment=env, copy_gbps=peak_gbps, rows=[asdict(r) for r in rows]), indent=1))
    table = markdown(env, rows, peak_gbps, dtype)
    (out / "bench.md").write_text(table)
    return table

