"""Speculative-decoding benchmark: n-gram prompt lookup on and off, side by side in one run,
on a copy-heavy trace (the prompt holds a passage the answer repeats or edits) and a
free-generation trace, at several concurrencies, with adapters drawn Zipf.

    .venv/bin/python benchmarks/spec_bench.py --model smollm2 --out /tmp/spec
    .venv/bin/python benchmarks/spec_bench.py --model random --out /tmp/spec-random

``--model random`` is the engine benchmarks' random Llama (hidden 1024 x 8 layers,
``common.BENCH_HF_CONFIG``, byte tokenizer): random weights never copy a prompt, so its one
traces (``ids``: random token-id prompts; ``rep``: a random span twice; EOS ignored)
measure only acceptance and the cost of speculating (decode tokens per CPU second on / off).
Neither makes drafts in practice: the prompt's suffix n-gram matches only before the first
output token, which prefill samples, and random outputs never repeat the context.

For each trace and concurrency (closed loop: that many requests in flight) it runs the same
requests with speculation off and on, interleaved, and reports: acceptance rate, tokens per
request-step (emitted tokens over decode rows), decode tokens/s (and per CPU second: the
machine is shared) over decode-only steps, TPOT p50/p99, and whether the greedy tokens are
the same. Prints a table and writes JSON; the report carries the commit and refuses a tree
with uncommitted changes unless ``--allow-dirty``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from common import MODEL_CHOICES, bench_model, git_commit  # noqa: E402

from loraplex.adapter_store.format import load_adapter  # noqa: E402
from loraplex.server import env  # noqa: E402
from loraplex.server.commands import write_demo_adapter  # noqa: E402
from loraplex.server.config import EngineConfig, SchedulerConfig  # noqa: E402
from loraplex.server.engine.engine import Engine  # noqa: E402
from loraplex.server.engine.models.config import ModelConfig  # noqa: E402
from loraplex.server.params import ChatMessage, ChatMessages, SamplingParams  # noqa: E402

SENTENCES = [
    "The committee met on Tuesday to review the budget for the new library.",
    "Rain is expected in the northern valleys through the weekend, with clear skies after.",
    "Our team shipped the billing service two weeks ahead of the planned release date.",
    "The museum will open a new wing dedicated to maritime history next spring.",
    "Please remember to back up your files before installing the operating system update.",
    "The recipe calls for two cups of flour, one egg, and a pinch of salt.",
    "Local farmers reported a strong harvest of apples and pears this autumn.",
    "The train to the coast leaves every hour from platform four.",
    "Students must submit their essays by Friday at noon through the online portal.",
    "The bridge on Mill Road will be closed for repairs until the end of the month.",
    "Our support desk answers questions by email within one business day.",
    "The orchestra rehearses on Thursday evenings in the old town hall.",
]
COPY_TASKS = [
    "Repeat the following text exactly, word for word:",
    "Rewrite the following text with every sentence in the same order, changing nothing "
    "but the first word of each sentence to upper case:",
    "Copy this note so I can paste it into an email:",
]
TOPICS = ["a lighthouse keeper", "the history of bread", "a robot learning to paint",
          "why the sky is blue", "a trip to the mountains", "how bees make honey",
          "a city under the sea", "the first day at a new job"]


class Adapters:
    """An adapter source over adapters loaded from PEFT directories, by digest."""

    def __init__(self, adapters: list) -> None:
        self.by_digest = {a.digest: a for a in adapters}

    def fetch(self, digest: str):
        return self.by_digest[digest]


def make_adapters(model_path: Path, num: int, root: Path, std: float) -> list:
    config = ModelConfig.from_pretrained(str(model_path))
    return [load_adapter(write_demo_adapter(root / f"a{i}", str(model_path),
                                            rank=(4, 8, 16)[i % 3], seed=i, std=std), config)
            for i in range(num)]


def make_trace(kind: str, num: int, adapters: list, seed: int, vocab: int) -> list[tuple]:
    """``(request id, prompt, adapter digest or None)``: adapters Zipf(1) with the base model
    as one more choice; the prompt is chat messages (``copy``, ``free``), 64-128 random
    token ids below ``vocab`` (``ids``), or a random span of 32-64 ids twice (``rep``)."""
    rng = random.Random(seed)
    digests = [a.digest for a in adapters] + [None]
    weights = [1.0 / (k + 1) for k in range(len(digests))]
    trace = []
    for i in range(num):
        prompt: ChatMessages | list[int]
        if kind == "ids":
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(64, 128))]
        elif kind == "rep":
            span = [rng.randrange(vocab) for _ in range(rng.randint(32, 64))]
            prompt = span + span
        else:
            if kind == "copy":
                passage = " ".join(rng.sample(SENTENCES, rng.randint(3, 5)))
                text = f"{rng.choice(COPY_TASKS)}\n\n{passage}"
            elif kind == "free":
                text = f"Write a short story about {rng.choice(TOPICS)}."
            else:
                raise ValueError(f"--traces: {kind!r} is not one of copy, free, ids, rep")
            prompt = ChatMessages((ChatMessage("user", text),))
        trace.append((f"{kind}{i}", prompt, rng.choices(digests, weights)[0]))
    return trace


def run(engine: Engine, trace: list[tuple], concurrency: int, max_tokens: int,
        ignore_eos: bool = False) -> dict:
    """The trace, closed loop at ``concurrency``; greedy, EOS kept (answers end naturally)
    unless ``ignore_eos`` (the random model: every request runs ``max_tokens``)."""
    sched = engine.scheduler
    spec_before = engine.stats().spec
    pending = list(trace)
    tokens: dict[str, list[int]] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    decode_s = decode_cpu_s = 0.0
    decode_tokens = decode_rows = decode_steps = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    in_flight = 0
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            rid, prompt, digest = pending.pop(0)
            engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens,
                                                           ignore_eos=ignore_eos),
                               adapter_digest=digest)
            tokens[rid] = []
            in_flight += 1
        running = list(sched.running)
        decode_only = (sched.num_waiting == 0 and bool(running)
                       and all(r.num_output_tokens and r.num_tokens - r.num_computed_tokens == 1
                               for r in running))
        t0, c0 = time.perf_counter(), time.process_time()
        outputs = engine.step()
        t1, c1 = time.perf_counter(), time.process_time()
        emitted = 0
        for out in outputs:
            if out.error:
                raise RuntimeError(f"{out.request_id}: {out.error}")
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = t1
            tokens[out.request_id].extend(out.new_token_ids)
            emitted += len(out.new_token_ids)
            if out.finished:
                done[out.request_id] = t1
                in_flight -= 1
        if decode_only:
            decode_s += t1 - t0
            decode_cpu_s += c1 - c0
            decode_tokens += emitted
            decode_rows += len(running)
            decode_steps += 1
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tpot = sorted((done[r] - first[r]) / (len(t) - 1) for r, t in tokens.items() if len(t) > 1)
    spec = engine.stats().spec
    proposed = spec.num_proposed_tokens - spec_before.num_proposed_tokens
    accepted = spec.num_accepted_tokens - spec_before.num_accepted_tokens
    return {
        "wall_s": wall, "cpu_s": cpu, "output_tokens": sum(len(t) for t in tokens.values()),
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
        "decode_tokens_per_cpu_s": decode_tokens / decode_cpu_s if decode_cpu_s else 0.0,
        "tokens_per_step": decode_tokens / decode_rows if decode_rows else 0.0,
        "decode_steps": decode_steps,
        "tpot_p50_ms": 1e3 * statistics.median(tpot) if tpot else 0.0,
        "tpot_p99_ms": 1e3 * tpot[min(len(tpot) - 1, int(0.99 * len(tpot)))] if tpot else 0.0,
        "proposed": proposed, "accepted": accepted,
        "acceptance": accepted / proposed if proposed else 0.0,
        "gated": spec.num_gated_tokens - spec_before.num_gated_tokens,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", choices=MODEL_CHOICES,
                        help="smollm2: the real SmolLM2-135M-Instruct; random: hidden 1024 x 8 "
                             "layers, random weights (acceptance and overhead only)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where the random model is built once (default: the data cache)")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--requests", default="2,4,16,64",
                        help="requests per concurrency (same order)")
    parser.add_argument("--traces", default=None,
                        help="copy, free (chat prompts), ids (random token ids) and rep (a "
                             "random span twice); default copy,free on smollm2, ids,rep on "
                             "random")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--num-adapters", type=int, default=64)
    parser.add_argument("--adapter-std", type=float, default=0.02,
                        help="random adapters' weight scale (small: the model stays fluent)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--no-cost-gate", action="store_true")
    parser.add_argument("--num-pages", type=int, default=2048,
                        help="per engine (two engines: keep both pools in memory; on random a "
                             "page is 1 MiB, use ~900)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--allow-dirty", action="store_true",
                        help="report from a tree with uncommitted changes (the commit says -dirty)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    commit = git_commit()
    if commit.endswith("-dirty") and not args.allow_dirty:
        raise SystemExit(f"commit {commit}: uncommitted changes; commit them (numbers are "
                         "quoted from a committed tree) or pass --allow-dirty")
    traces = args.traces or ("ids,rep" if args.model == "random" else "copy,free")
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    num_requests = [int(n) for n in args.requests.split(",")]
    model_path, hf_config = bench_model(args.model, args.cache_dir or env.cache_dir() / "bench")
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(model_path, args.num_adapters, Path(tmp), args.adapter_std)

    def engine(method: str) -> Engine:
        # No prefix cache: both modes replay the same prompts (the second would skip prefill).
        return Engine(EngineConfig(
            model=str(model_path), num_pages=args.num_pages, seed=0, enable_prefix_caching=False,
            speculative_method=method, num_speculative_tokens=args.num_speculative_tokens,
            speculative_cost_gate=not args.no_cost_gate,
            scheduler=SchedulerConfig(max_num_seqs=256)), adapter_source=Adapters(adapters))

    engines = {"off": engine("off"), "ngram": engine("ngram")}
    results = []
    for kind in traces.split(","):
        for c, n in zip(concurrency, num_requests):
            trace = make_trace(kind, n, adapters, seed=c, vocab=int(hf_config["vocab_size"]))
            # Off first, then on: interleaved per cell, so load drifts hit both alike.
            row = {"trace": kind, "concurrency": c, "requests": n}
            for mode, eng in engines.items():
                row[mode] = run(eng, trace, c, args.max_tokens,
                                ignore_eos=kind in ("ids", "rep"))
            off, on = row["off"], row["ngram"]
            row["same_tokens"] = sum(off["tokens"][r] == on["tokens"][r] for r, *_ in trace)
            row["speedup"] = on["decode_tokens_per_s"] / max(off["decode_tokens_per_s"], 1e-9)
            row["speedup_cpu"] = (on["decode_tokens_per_cpu_s"]
                                  / max(off["decode_tokens_per_cpu_s"], 1e-9))
            _print_row(row)
            sys.stdout.flush()
            results.append({**row, **{m: {k: v for k, v in row[m].items() if k != "tokens"}
                                      for m in engines}})
            if args.out is not None:  # after every cell: a killed run keeps what it measured
                _write(args, commit, load_start, results)
    load = os.getloadavg()
    print(f"model {args.model}, {args.num_adapters} adapters (Zipf, std {args.adapter_std}), "
          f"k <= {args.num_speculative_tokens}, cost gate {not args.no_cost_gate}, "
          f"max_tokens {args.max_tokens}, {args.threads} thread(s), commit {commit}, "
          f"load at start {load_start[0]:.1f}, at end {load[0]:.1f} (1-minute)")
    if args.out is not None:
        _write(args, commit, load_start, results, load)
    return 0


def _write(args: argparse.Namespace, commit: str, load_start: tuple, results: list[dict],
           load_end: tuple | None = None) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spec_bench.json").write_text(json.dumps({
        "args": {k: str(v) for k, v in vars(args).items()}, "commit": commit,
        "load_1min": {"start": load_start[0], "end": load_end[0] if load_end else None},
        "results": results}, indent=2))


HEADER = (f"{'trace':<6}{'conc':>5}{'mode':>7}{'accept':>8}{'tok/step':>9}{'dec tok/s':>10}"
          f"{'tok/cpu-s':>10}{'TPOT p50':>9}{'p99':>8}{'speedup':>8}{'same':>6}{'drafts':>7}")


def _print_row(row: dict) -> None:
    if not getattr(_print_row, "printed", False):
        print(HEADER)
        _print_row.printed = True  # type: ignore[attr-defined]
    for mode in ("off", "ngram"):
        r = row[mode]
        extra = (f"{row['speedup']:>7.2f}x{row['same_tokens']:>3}/{row['requests']}"
                 if mode == "ngram" else " " * 14)
        print(f"{row['trace']:<6}{row['concurrency']:>5}{mode:>7}{r['acceptance']:>8.2f}"
              f"{r['tokens_per_step']:>9.2f}{r['decode_tokens_per_s']:>10.1f}"
              f"{r['decode_tokens_per_cpu_s']:>10.1f}{r['tpot_p50_ms']:>9.1f}"
              f"{r['tpot_p99_ms']:>8.1f}{extra}{r['proposed']:>7}")


if __name__ == "__main__":
    raise SystemExit(main())
