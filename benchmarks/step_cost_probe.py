"""Where an inter-token latency target is missed: the step cost model's prediction against
the measured time of every engine step, on ``serve_bench.py``'s trace, in process.

An ``Engine`` with ``target_itl_ms`` serves the trace in a closed loop (``replay_engine``,
the load tester's in-process replay; the same adapters as ``serve_bench.py``), and every
step's shape, prediction and measured time is logged (by wrapping ``StepTimer.record``, the
engine's one seam where both are known). Reported: the client-side ITL percentiles (in
process a token's gap is one step), and per kind of step (decode only, decode with a
prefill chunk, prefill only) the count, measured and predicted mean, the share over the
target and the prefill tokens a step carried; the coefficients after calibration and at the
end; and an offline least-squares refit on the live steps, which says what a better-fitted
model of the same features would predict.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/step_cost_probe.py --target-ms 250 --concurrency 32``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
from serve_bench import NUM_ADAPTERS  # noqa: E402
from stall_free import TARGETS, model_path  # noqa: E402

from loraplex.adapter_store.directory_source import DirectoryAdapterSource  # noqa: E402,I001
from loraplex.loadtest.adapters import ensure_adapter_dirs  # noqa: E402
from loraplex.loadtest.engine_replay import replay_engine  # noqa: E402
from loraplex.loadtest.report import build_report  # noqa: E402
from loraplex.loadtest.runner import RunConfig  # noqa: E402
from loraplex.loadtest.trace import TraceConfig, adapter_name, generate_trace  # noqa: E402
from loraplex.server import env  # noqa: E402
from loraplex.server.config import EngineConfig, SchedulerConfig  # noqa: E402
from loraplex.server.engine.engine import Engine  # noqa: E402
from loraplex.server.engine.models.config import ModelConfig  # noqa: E402
from loraplex.server.engine.step_cost import FEATURES, StepShape, nnls  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--target-ms", type=float, default=250.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-len", default="uniform:64:192")
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--min-prefill-chunk", type=int, default=32)
    p.add_argument("--num-pages", type=int, default=768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the steps as JSON here")
    return p.parse_args(argv)


def kind(shape: StepShape) -> str:
    if shape.num_prefill_tokens and shape.num_decode_tokens:
        return "mixed"
    return "prefill" if shape.num_prefill_tokens else "decode"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    path = model_path(args.model)
    config = ModelConfig.from_pretrained(path)
    tc = TraceConfig(num_requests=args.num_requests, rate=float("inf"), adapters="uniform",
                     num_adapters=NUM_ADAPTERS, prompt_len=args.prompt_len,
                     output_len=f"fixed:{args.output_len}",
                     vocab_size=min(config.vocab_size, 32000), seed=args.seed)
    trace = generate_trace(tc)
    warmup = generate_trace(replace(tc, num_requests=8, seed=args.seed + 1))
    root = env.cache_dir() / "loadtest" / f"adapters-serve-bench-{Path(path).name}"
    for i in range(NUM_ADAPTERS):  # the same folders serve_bench.py writes
        ensure_adapter_dirs(root, [adapter_name(i)], config, rank=8 if i % 2 == 0 else 16,
                            targets=TARGETS, seed=i)
    source = DirectoryAdapterSource(root, config)
    engine = Engine(EngineConfig(
        model=path, enable_prefix_caching=False, num_pages=args.num_pages, max_rank=16,
        scheduler=SchedulerConfig(target_itl_ms=args.target_ms,
                                  min_prefill_chunk=args.min_prefill_chunk)),
        adapter_source=source)
    names = source.names()
    replay_engine(engine, warmup, RunConfig(mode="closed", concurrency=8, progress=False), names)
    timer = engine.step_timer
    calibrated = timer.model.coefficients  # after calibration and the warm-up's steps
    steps: list[tuple[StepShape, float, float]] = []
    record = timer.record

    def logged(shape: StepShape, seconds: float) -> None:
        steps.append((shape, timer.model.predict(shape), seconds))
        record(shape, seconds)

    timer.record = logged  # type: ignore[method-assign]
    log = replay_engine(engine, trace, RunConfig(mode="closed", concurrency=args.concurrency,
                                                 progress=False), names)
    engine.close()
    s = build_report(log)["summary"]
    t = args.target_ms / 1000
    print(f"target {args.target_ms:g} ms, concurrency {args.concurrency}: "
          f"{s['output_tokens_per_s']:.1f} tok/s, TTFT p50 {1000 * s['ttft_s']['p50']:.0f} ms, "
          f"ITL p50 {1000 * s['itl_s']['p50']:.0f} / p99 {1000 * s['itl_s']['p99']:.0f} ms, "
          f"{len(steps)} steps")
    print(f"\n{'kind':>8} {'steps':>5} {'meas ms':>8} {'pred ms':>8} {'p90 meas':>8} "
          f"{'>target':>7} {'pred>T':>6} {'prefill tok p50':>15} {'at min chunk':>12}")
    for k in ("decode", "mixed", "prefill"):
        rows = [(sh, p, m) for sh, p, m in steps if kind(sh) == k]
        if not rows:
            continue
        meas = np.array([m for _, _, m in rows])
        pred = np.array([p for _, p, _ in rows])
        pre = [sh.num_prefill_tokens for sh, _, _ in rows]
        at_min = sum(0 < n <= args.min_prefill_chunk for n in pre) / len(rows)
        print(f"{k:>8} {len(rows):>5} {1000 * meas.mean():>8.0f} {1000 * pred.mean():>8.0f} "
              f"{1000 * np.percentile(meas, 90):>8.0f} {np.mean(meas > t):>7.0%} "
              f"{np.mean(pred > t):>6.0%} {int(np.median(pre)):>15} {at_min:>12.0%}")
    x = np.array([sh.features() for sh, _, _ in steps], dtype=np.float64)
    y = np.array([m for _, _, m in steps])
    refit = nnls(x, y)
    resid = y - x @ refit
    r2 = 1 - float(resid.var() / y.var()) if y.var() > 0 else 0.0
    print(f"\n{'feature':>22} {'calibrated':>11} {'at the end':>11} {'live refit':>11}")
    for name, a, b, c in zip(FEATURES, calibrated, timer.model.coefficients, refit):
        print(f"{name:>22} {a:>11.3g} {b:>11.3g} {c:>11.3g}")
    print(f"live refit: R^2 {r2:.2f}, residual sd {1000 * resid.std():.0f} ms "
          f"(measured sd {1000 * y.std():.0f} ms)")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "summary": s,
            "calibrated": calibrated, "final": timer.model.coefficients,
            "refit": refit.tolist(), "features": FEATURES,
            "steps": [[list(sh.features()), p, m] for sh, p, m in steps]}, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
