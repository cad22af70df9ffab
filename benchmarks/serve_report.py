"""The tables of ``serve_bench.py``: every run, medians per system and load point with ratios
to vLLM, and issue 22's checks for each run with the inter-token latency target on.

``python benchmarks/serve_report.py bench-out/serve/serve_bench.json`` prints them again from
a report.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def point_name(run: dict) -> str:
    return f"c{run['load']:g}" if run["mode"] == "closed" else f"{run['load']:g}/s"


def tokens_per_cpu_s(run: dict) -> float | None:
    """Output tokens per CPU second of the server's processes (the machine is shared: CPU
    time is far less inflated by other jobs than wall time)."""
    return run["output_tokens"] / run["cpu_s"] if run.get("cpu_s") else None


def print_table(runs: Sequence[dict]) -> None:
    """Every run, in the order they ran."""
    print(f"\n{'system':>15} {'load':>6} {'rnd':>3} {'tok/s':>6} {'TTFT50':>7} {'TTFT99':>7} "
          f"{'ITL50':>6} {'ITL99':>6} {'99/50':>5} {'good/s':>6} {'good%':>5} {'CPU/s':>5} "
          f"{'tok/CPUs':>8} "
          f"{'merged':>6} {'steps>T':>7} {'pred/m':>6} {'step':>5} {'load1':>9} {'err':>3}")
    for r in runs:
        itl = r["itl_s"]
        ratio = itl["p99"] / itl["p50"] if itl["p50"] else None
        print(f"{r['system']:>15} {point_name(r):>6} {r['round']:>3} "
              f"{r['output_tokens_per_s']:>6.1f} {_ms(r['ttft_s']['p50']):>7} "
              f"{_ms(r['ttft_s']['p99']):>7} {_ms(itl['p50']):>6} {_ms(itl['p99']):>6} "
              f"{_f(ratio, '.1f'):>5} {r['goodput']['requests_per_s']:>6.2f} "
              f"{_pct(r['goodput']['fraction']):>5} {r['cpu_s'] / r['wall_s']:>5.2f} "
              f"{_f(tokens_per_cpu_s(r), '.1f'):>8} "
              f"{_pct(r['merged_share']):>6} {_pct(r.get('steps_over_target')):>7} "
              f"{_f(r.get('predicted_over_measured')):>6} {_ms(r.get('mean_step_s')):>5} "
              f"{r['load_before']:>4.1f}-{r['load_after']:<4.1f} {r['num_errors']:>3}")
    print("(latencies in ms; good/s: requests/s within the SLO; CPU/s: the server's CPU "
          "seconds per wall second, all its processes; merged: ITL gaps < 0.5 ms)")
    print(medians_table(runs))


def _median(values: Sequence[float | None]) -> float | None:
    vs = [v for v in values if v is not None]
    return statistics.median(vs) if vs else None


def medians(runs: Sequence[dict]) -> dict[tuple[str, str], dict[str, float | None]]:
    """(system, load point) -> medians over its rounds of the main figures."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["system"], point_name(r)), []).append(r)
    return {key: {"tok_s": _median([r["output_tokens_per_s"] for r in rs]),
                  "tok_cpu_s": _median([tokens_per_cpu_s(r) for r in rs]),
                  "ttft_p50": _median([r["ttft_s"]["p50"] for r in rs]),
                  "ttft_p99": _median([r["ttft_s"]["p99"] for r in rs]),
                  "itl_p50": _median([r["itl_s"]["p50"] for r in rs]),
                  "itl_p99": _median([r["itl_s"]["p99"] for r in rs]),
                  "goodput": _median([r["goodput"]["requests_per_s"] for r in rs]),
                  "n": len(rs)}
            for key, rs in groups.items()}


def medians_table(runs: Sequence[dict]) -> str:
    """Medians per system and load point, and each against vLLM's at the same point."""
    m = medians(runs)
    lines = ["\nmedians over rounds; x vLLM: the ratio to vllm's median at the same load",
             f"{'system':>15} {'load':>6} {'n':>2} {'tok/s':>6} {'tok/CPUs':>8} {'TTFT50':>7} "
             f"{'ITL50':>6} {'ITL99':>6} {'good/s':>6} | x vLLM: {'tok/s':>6} {'tok/CPUs':>8} "
             f"{'TTFT50':>7} {'ITL50':>6} {'ITL99':>6}"]
    for (system, point), v in sorted(m.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ref = m.get(("vllm", point))

        def x(k: str, v: dict = v, ref: dict | None = ref) -> str:
            a, b = v[k], None if ref is None else ref[k]
            return "-" if a is None or not b else f"{a / b:.2f}"

        lines.append(f"{system:>15} {point:>6} {v['n']:>2} {_f(v['tok_s'], '.1f'):>6} "
                     f"{_f(v['tok_cpu_s'], '.1f'):>8} {_ms(v['ttft_p50']):>7} "
                     f"{_ms(v['itl_p50']):>6} {_ms(v['itl_p99']):>6} {_f(v['goodput']):>6} | "
                     f"        {x('tok_s'):>6} {x('tok_cpu_s'):>8} {x('ttft_p50'):>7} "
                     f"{x('itl_p50'):>6} {x('itl_p99'):>6}")
    return "\n".join(lines)


def checks(runs: Sequence[dict]) -> list[dict]:
    """Issue 22's targets for each target-on run, against the target-off gRPC run of the same
    load point and round and vLLM's median ITL p99 at that load point."""
    off = {(point_name(r), r["round"]): r for r in runs if r["system"] == "loraplex"}
    vllm = medians([r for r in runs if r["system"] == "vllm"])
    out = []
    for r in runs:
        if not r["target_itl_ms"]:
            continue
        b = off.get((point_name(r), r["round"]))
        v = vllm.get(("vllm", point_name(r)), {})
        itl = r["itl_s"]
        out.append({
            "system": r["system"], "load": point_name(r), "round": r["round"],
            "p99_over_p50": itl["p99"] / itl["p50"] if itl["p50"] else None,
            "p99_over_vllm_p99": (itl["p99"] / v["itl_p99"]  # type: ignore[operator]
                                  if v.get("itl_p99") else None),
            "tok_s_over_off": (r["output_tokens_per_s"] / b["output_tokens_per_s"]
                               if b and b["output_tokens_per_s"] else None),
            "ttft_p50_over_off": (r["ttft_s"]["p50"] / b["ttft_s"]["p50"]
                                  if b and b["ttft_s"]["p50"] else None)})
    return out


def checks_table(runs: Sequence[dict]) -> str:
    """``checks`` as a table; each ratio marked ok or NO against its bound."""
    bounds = (("p99_over_p50", 2.0, "<="), ("p99_over_vllm_p99", 1.0, "<="),
              ("tok_s_over_off", 0.9, ">="), ("ttft_p50_over_off", 1.5, "<="))
    lines = ["\nissue 22 checks (ITL p99 <= 2x p50, <= vLLM's p99; tok/s >= 0.9x and TTFT p50 "
             "<= 1.5x the target-off run)",
             f"{'system':>15} {'load':>6} {'rnd':>3} {'p99/p50':>10} {'p99/vLLM':>10} "
             f"{'tok/s x off':>12} {'TTFT x off':>11}"]
    for c in checks(runs):
        cells = []
        for key, bound, op in bounds:
            v = c[key]
            ok = v is not None and (v <= bound if op == "<=" else v >= bound)
            cells.append("-" if v is None else f"{v:.2f} {'ok' if ok else 'NO'}")
        lines.append(f"{c['system']:>15} {c['load']:>6} {c['round']:>3} {cells[0]:>10} "
                     f"{cells[1]:>10} {cells[2]:>12} {cells[3]:>11}")
    return "\n".join(lines)


def main(path: Path) -> None:
    from loraplex.loadtest.records import RunLog

    report = json.loads(path.read_text())
    for run in report["runs"]:
        if "output_tokens" not in run:  # an older report: count them in the run's log
            log = RunLog.load(path.parent / f"{run['system']}-{run['mode']}{run['load']:g}"
                                            f"-r{run['round']}.jsonl")
            run["output_tokens"] = sum(r.num_output_tokens for r in log.measured if r.ok)
    print_table(report["runs"])
    print(checks_table(report["runs"]))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
