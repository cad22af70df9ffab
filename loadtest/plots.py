"""PNG plots of runs and sweeps (matplotlib, Agg backend, small files for the docs).

* ``plot_latency_cdfs``: TTFT, ITL and E2E CDFs of one or more runs side by side;
* ``plot_rate_sweep``: output tokens/s and p99 latency against the offered request rate;
* ``plot_adapter_sweep``: output tokens/s and p99 latency against the number of adapters.

Sweep plots read the JSON that ``sweep.py`` writes: ``{"points": [{"system", "rate" or
"num_adapters", "summary": report summary}, ...]}``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loraplex.loadtest.records import RunLog  # noqa: E402

DPI = 100


def _cdf(ax: plt.Axes, values: list[float], label: str) -> None:
    if not values:
        return
    x = np.sort(np.asarray(values) * 1000.0)
    ax.plot(x, np.arange(1, x.size + 1) / x.size, label=label)


def plot_latency_cdfs(logs: Mapping[str, RunLog], path: str | os.PathLike[str]) -> None:
    """CDFs of TTFT, ITL and E2E (ms) of the measured, successful requests of each run."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for label, log in logs.items():
        ok = [r for r in log.measured if r.ok]
        _cdf(axes[0], [r.ttft for r in ok if r.ttft is not None], label)
        _cdf(axes[1], [g for r in ok for g in r.itls], label)
        _cdf(axes[2], [r.e2e for r in ok], label)
    for ax, title in zip(axes, ("TTFT", "inter-token latency", "end-to-end latency")):
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _series(points: list[dict], x_key: str) -> dict[str, list[dict]]:
    by_system: dict[str, list[dict]] = {}
    for p in points:
        by_system.setdefault(p["system"], []).append(p)
    return {s: sorted(ps, key=lambda p: p[x_key]) for s, ps in by_system.items()}


def _p99_ms(point: dict, key: str) -> float:
    value = point["summary"][key]["p99"]
    return float("nan") if value is None else 1000.0 * value


def _sweep_plot(sweep: Mapping, x_key: str, xlabel: str, path: str | os.PathLike[str],
                log_x: bool) -> None:
    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, (system, pts) in enumerate(_series(list(sweep["points"]), x_key).items()):
        x = [p[x_key] for p in pts]
        color = f"C{i}"
        ax_tp.plot(x, [p["summary"]["output_tokens_per_s"] for p in pts], "o-", color=color,
                   label=system)
        ax_lat.plot(x, [_p99_ms(p, "ttft_s") for p in pts], "o-", color=color,
                    label=f"{system} TTFT p99")
        ax_lat.plot(x, [_p99_ms(p, "e2e_s") for p in pts], "s--", color=color,
                    label=f"{system} E2E p99")
    ax_tp.set_ylabel("output tokens/s")
    ax_tp.set_ylim(bottom=0)
    ax_lat.set_ylabel("p99 latency (ms)")
    ax_lat.set_yscale("log")
    xs = sorted({p[x_key] for p in sweep["points"]})
    for ax in (ax_tp, ax_lat):
        ax.set_xlabel(xlabel)
        if log_x:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    title = sweep.get("title")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_rate_sweep(sweep: Mapping, path: str | os.PathLike[str]) -> None:
    """Throughput and p99 TTFT / E2E against the offered rate, one line per system."""
    _sweep_plot(sweep, "rate", "offered rate (requests/s)", path, log_x=False)


def plot_adapter_sweep(sweep: Mapping, path: str | os.PathLike[str]) -> None:
    """Throughput and p99 TTFT / E2E against the number of adapters (log scale)."""
    _sweep_plot(sweep, "num_adapters", "adapters (Zipf popularity)", path, log_x=True)
