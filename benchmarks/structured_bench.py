"""Structured-output benchmark: a JSON-extraction trace with constraints off, on without
jump-forward, and on with exact and string jump-forward, over many adapters in one batch.

The trace: ``--num-requests`` chat prompts of 64-256 tokens (a short business document with
filler sentences, then the instruction) over ``--num-adapters`` adapters drawn Zipf(1) (and
the base model), each asking for an object with eight fixed keys with long-ish names
(strings bounded by ``maxLength``, enums, bounded integers, a boolean), with ``max_tokens``
large enough that every object finishes. Runs on engines of one configuration, all requests
admitted at once, greedy, interleaved over ``--rounds``:

* ``free``: no constraint, each request generates as many tokens as its constrained run did
  (``ignore_eos``), so both produce the same number of tokens;
* ``constrained``: the schema, ``jump_forward = off``: one model step per token;
* ``exact``: ``jump_forward = exact``: tokens the mask forces alone appended without a model
  step and computed as one chunk (the same tokens as ``constrained``: checked);
* ``string``: ``jump_forward = string``: forced strings appended as the tokenizer cuts them
  (its tokens may differ, so compare requests/s; every output is validated).

Reported per run: output tokens/s and requests/s end to end, per wall and per CPU second of
the process; median TPOT (per request, (finish - prefill done) / (tokens - 1)); median
latency; engine steps; the share of output tokens jumped; how many outputs finished with
``stop`` and how many of those validate against the schema (jsonschema). Then the per-step
cost of the mask at batch 1 / 16 / 64: ``GrammarService.bitmask`` (matchers fill their rows)
and the sampler's masked ``sample`` against an unmasked one, on the model's vocabulary.
Exit status 1 when exact mode's tokens differ or an output does not stop and validate.

Usage: ``python benchmarks/structured_bench.py --model smollm2 --out bench-out`` (default
``demo``, the random byte-level model; ``--model PATH`` for a Hugging Face folder;
``--modes constrained,string`` for a shorter run of some modes). String mode also reports how
many boundaries it re-cut with the last sampled token.
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

from loraplex.adapter_store.format import load_adapter  # noqa: E402
from loraplex.server.commands import write_demo_adapter  # noqa: E402
from loraplex.server.config import EngineConfig, SchedulerConfig  # noqa: E402
from loraplex.server.engine.engine import Engine, resolve_model_path  # noqa: E402
from loraplex.server.engine.models.config import ModelConfig  # noqa: E402
from loraplex.server.engine.sampler import SamplingMetadata, sample  # noqa: E402
from loraplex.server.params import SamplingParams, StructuredOutput  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 24},
        "customer_email_address": {"type": "string", "maxLength": 32},
        "document_category": {"enum": ["invoice", "receipt", "purchase_order", "contract"]},
        "total_amount_in_euros": {"type": "integer", "minimum": 0, "maximum": 100000},
        "payment_status": {"enum": ["paid", "unpaid", "overdue"]},
        "number_of_line_items": {"type": "integer", "minimum": 1, "maximum": 50},
        "is_recurring_customer": {"type": "boolean"},
        "priority_level": {"enum": ["low", "normal", "high", "urgent"]},
    },
    "required": ["customer_full_name", "customer_email_address", "document_category",
                 "total_amount_in_euros", "payment_status", "number_of_line_items",
                 "is_recurring_customer", "priority_level"],
    "additionalProperties": False,
}
FIRST_NAMES = ["Anna", "Jonas", "Marie", "Pedro", "Yuki", "Omar", "Lena", "Kofi", "Sara", "Ivan"]
LAST_NAMES = ["Schmidt", "Garcia", "Tanaka", "Okafor", "Rossi", "Novak", "Berg", "Silva"]
FILLER = [
    "The goods were delivered to the warehouse on the second floor as agreed.",
    "Please keep this document for your records and quote its number in any reply.",
    "Our support team is available on weekdays between nine and five.",
    "Prices include the statutory value added tax unless stated otherwise.",
    "The customer asked for the shipment to be split into two parcels.",
    "Late payments may incur a fee as described in the general terms.",
    "This summary was generated from the scanned original by the archive service.",
    "A copy has been sent to the accounting department for review.",
]


def document(rng: random.Random) -> str:
    """A short business document holding the schema's fields in prose."""
    first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
    kind = rng.choice(["invoice", "receipt", "purchase order", "contract"])
    return (f"{kind.capitalize()} no. {rng.randint(1000, 99999)} for {first} {last} "
            f"({first.lower()}.{last.lower()}@example.com). {rng.randint(1, 20)} line items, "
            f"total {rng.randint(20, 20000)} EUR, status: "
            f"{rng.choice(['paid', 'unpaid', 'overdue'])}. "
            f"{rng.choice(['A returning customer.', 'A first order.'])} "
            f"Marked {rng.choice(['low', 'normal', 'high', 'urgent'])} priority.")


class Adapters:
    """An adapter source over adapters loaded from PEFT directories, by digest."""

    def __init__(self, adapters: list) -> None:
        self.by_digest = {a.digest: a for a in adapters}

    def fetch(self, digest: str):
        return self.by_digest[digest]


def make_adapters(model: str, num: int, root: Path) -> list:
    config = ModelConfig.from_pretrained(resolve_model_path(model))
    adapters = []
    for i in range(num):
        path = write_demo_adapter(root / f"a{i}", resolve_model_path(model),
                                  rank=(4, 8, 16)[i % 3], seed=i, std=0.05)
        adapters.append(load_adapter(path, config))
    return adapters


def make_trace(num: int, adapters: list, engine: Engine, seed: int) -> list[tuple]:
    """``num`` chat prompts of 64-256 tokens (a document, filler, the instruction), each for
    an adapter drawn Zipf(1) over the adapters and the base model."""
    if engine.tokenizer is None:
        raise SystemExit("structured output needs a tokenizer")
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) for k in range(len(adapters) + 1)]  # Zipf(1); last: the base
    digests = [a.digest for a in adapters] + [None]
    ask = ("Extract the fields as JSON with the keys " + ", ".join(SCHEMA["required"]) + ".")
    trace = []
    for i in range(num):
        target = rng.randint(64, 256)
        doc, filler = document(rng), ""
        while True:
            messages = [{"role": "system", "content": "You extract fields from documents."},
                        {"role": "user", "content": f"{doc}{filler}\n\n{ask}"}]
            prompt = engine.tokenizer.apply_chat_template(messages)
            if len(prompt) >= target or len(prompt) > 256:
                break
            filler += " " + rng.choice(FILLER)
        trace.append((f"r{i}", prompt[-256:], rng.choices(digests, weights)[0]))
    return trace


def warm(engine: Engine, spec: StructuredOutput) -> None:
    """Compile the schema once (the cache then serves the trace): the runs compare decoding,
    not the first compile."""
    engine.add_request("warm", [1, 2, 3], SamplingParams(max_tokens=4, structured=spec))
    while engine.has_unfinished():
        engine.step()


def run(engine: Engine, trace: list[tuple], params: dict[str, SamplingParams]) -> dict:
    """One pass of the trace, all requests admitted at once."""
    steps_before = engine.stats().num_steps
    jumped_before = engine.grammars.num_jumped_tokens if engine.grammars is not None else 0
    recut_before = engine.grammars.num_retokenized if engine.grammars is not None else 0
    start, cpu_start = time.perf_counter(), time.process_time()
    sampled: dict[str, float] = {}  # after the step that prefilled the prompt
    done: dict[str, float] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid, *_ in trace}
    reasons: dict[str, str | None] = {}
    requests = {rid: engine.add_request(rid, prompt, params[rid], adapter_digest=digest)
                for rid, prompt, digest in trace}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = now
                reasons[out.request_id] = out.finish_reason
        for rid, req in requests.items():
            if rid not in sampled and req.num_computed_tokens >= req.num_prompt_tokens:
                sampled[rid] = now
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    # Per output token after the prefill (forced tokens streamed before it do not count as
    # a head start): (finish - prefill done) / (tokens - 1).
    tpot = [(done[r] - sampled.get(r, done[r])) / (len(t) - 1) for r, t in tokens.items()
            if len(t) > 1]
    latency = sorted(done[r] - start for r in done)
    num_tokens = sum(len(t) for t in tokens.values())
    jumped = (engine.grammars.num_jumped_tokens - jumped_before
              if engine.grammars is not None else 0)
    recut = engine.grammars.num_retokenized - recut_before if engine.grammars is not None else 0
    return {"seconds": elapsed, "cpu_seconds": cpu, "output_tokens": num_tokens,
            "tokens_per_s": num_tokens / elapsed, "tokens_per_cpu_s": num_tokens / cpu,
            "requests_per_s": len(trace) / elapsed, "requests_per_cpu_s": len(trace) / cpu,
            "tpot_p50_ms": 1e3 * statistics.median(tpot),
            "latency_p50_s": statistics.median(latency), "jumped_tokens": jumped,
            "retokenized": recut,
            "steps": engine.stats().num_steps - steps_before, "tokens": tokens,
            "reasons": reasons}


def mask_cost(engine: Engine, batch: int, repeats: int) -> dict:
    """Per-step cost of the bitmask at ``batch`` constrained rows, in milliseconds."""
    if engine.grammars is None or engine.tokenizer is None:
        raise SystemExit("structured output needs a tokenizer")
    grammars = engine.grammars
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    requests = []
    for i in range(batch):
        req = engine.add_request(f"m{batch}-{i}", [1, 2, 3], SamplingParams(
            max_tokens=64, structured=spec))
        requests.append(req)
    deadline = time.monotonic() + 60
    while not all(r.grammar is not None and r.grammar.compiled is not None for r in requests):
        if time.monotonic() > deadline:
            raise RuntimeError("grammar did not compile")
        time.sleep(0.01)
    # Mid-object: a few tokens accepted (the grammar's separators), in the model's own
    # vocabulary (bytes on the demo model, BPE pieces on a real one).
    tokenizer = engine.tokenizer.for_this_thread()
    prefix = tokenizer('{"customer_full_name": "An', add_special_tokens=False)["input_ids"]
    for req in requests:
        for token in prefix:
            req.output_token_ids.append(token)
            if req.grammar is not None:
                req.grammar.accept(req, token)
    vocab = engine.model_config.vocab_size
    logits = torch.randn(batch, vocab)
    metadata = SamplingMetadata.from_requests(requests)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * min(times)

    fill = best(lambda: grammars.bitmask(requests))
    bitmask, _ = grammars.bitmask(requests)
    masked = SamplingMetadata(**{**metadata.__dict__, "allowed_token_bitmask": bitmask})
    plain_ms = best(lambda: sample(logits, metadata))
    masked_ms = best(lambda: sample(logits, masked))
    for req in requests:
        engine.abort(req.request_id)
    engine.step()
    return {"batch": batch, "fill_ms": fill, "sample_ms": plain_ms,
            "masked_sample_ms": masked_ms, "apply_ms": masked_ms - plain_ms}


def validate(result: dict, engine: Engine) -> tuple[int, int]:
    """(outputs that finished with ``stop``, those of them that parse and validate against
    the schema with jsonschema)."""
    import jsonschema

    if engine.tokenizer is None:
        return 0, 0
    stopped = valid = 0
    for rid, tokens in result["tokens"].items():
        if result["reasons"].get(rid) != "stop":
            continue
        stopped += 1
        try:
            jsonschema.validate(json.loads(engine.tokenizer.decode(tokens)), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            continue
        valid += 1
    return stopped, valid


MODES = ("free", "constrained", "exact", "string")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-adapters", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="requests running at once (the rest wait)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20, help="timings of each mask cost")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved runs of each mode")
    parser.add_argument("--skip-mask-cost", action="store_true")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated runs (constrained always runs: the others are "
                             "compared with it, and free takes its token counts)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    modes = [m for m in MODES if m in {*args.modes.split(","), "constrained"}]
    if unknown := set(args.modes.split(",")) - set(MODES):
        parser.error(f"--modes: {sorted(unknown)} not among {MODES}")
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(args.model, args.num_adapters, Path(tmp))

    page_size = SchedulerConfig().page_size
    # Every request's whole context at once, and room for the adapters (three engines live
    # side by side: a fixed large pool would not fit a small machine's memory).
    num_pages = (args.num_requests * -(-(256 + args.max_tokens) // page_size)
                 + 8 * args.num_adapters)

    def engine(jump_forward: str) -> Engine:
        # No prefix cache: the runs replay the same prompts, and with it whichever run came
        # second on an engine (free, after constrained) skipped its prefill (issue 17).
        return Engine(EngineConfig(model=args.model, device=args.device, num_pages=num_pages,
                                   jump_forward=jump_forward, seed=0,
                                   enable_prefix_caching=False,
                                   scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs)),
                      adapter_source=Adapters(adapters))

    jump = {"constrained": "off", "exact": "exact", "string": "string"}
    engines = {m: engine(jump[m]) for m in modes if m in jump}
    engines["free"] = engines["constrained"]
    trace = make_trace(args.num_requests, adapters, engines["constrained"], seed=1)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    constrained_modes = [m for m in modes if m in jump]
    for name in constrained_modes:
        warm(engines[name], spec)
    constrained = {rid: SamplingParams(max_tokens=args.max_tokens, structured=spec)
                   for rid, *_ in trace}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    free_params: dict[str, SamplingParams] = {}
    for _ in range(args.rounds):  # interleaved: the machine is shared
        for mode in modes:
            if mode == "free":
                if not free_params:  # as many tokens as the constrained run: measured first
                    continue
                runs[mode].append(run(engines[mode], trace, free_params))
                continue
            runs[mode].append(run(engines[mode], trace, constrained))
            if mode == "constrained" and not free_params and "free" in modes:
                free_params = {rid: SamplingParams(max_tokens=max(1, len(t)), ignore_eos=True)
                               for rid, t in runs[mode][0]["tokens"].items()}
                runs["free"].append(run(engines["free"], trace, free_params))
    # Each mode's median run by CPU time (the steadier clock on a shared machine).
    rows = {m: sorted(rs, key=lambda r: r["cpu_seconds"])[len(rs) // 2]
            for m, rs in runs.items()}
    costs = [] if args.skip_mask_cost else [mask_cost(engines["constrained"], b, args.repeats)
                                            for b in (1, 16, 64)]
    plain = rows["constrained"]
    jumped = rows.get("exact", plain)
    same = sum(plain["tokens"][r] == jumped["tokens"][r] for r, *_ in trace)
    checks = {m: validate(rows[m], engines[m]) for m in constrained_modes}
    prompt_lens = sorted(len(p) for _, p, _ in trace)
    print(f"model {args.model}, {args.num_requests} requests (prompts {prompt_lens[0]}-"
          f"{prompt_lens[-1]} tokens), {args.num_adapters} adapters (Zipf), max_tokens "
          f"{args.max_tokens}, max_num_seqs {args.max_num_seqs}, {args.threads} thread(s), "
          f"device {args.device}, {args.rounds} interleaved round(s)")
    print(f"{'run':<13}{'tok/s':>8}{'tok/cpu-s':>10}{'req/s':>7}{'req/cpu-s':>10}"
          f"{'TPOT p50':>9}{'lat p50':>8}{'steps':>6}{'tokens':>7}{'jumped':>8}"
          f"{'stop':>5}{'valid':>6}")
    for name, r in rows.items():
        stop, valid = checks.get(name, (sum(v == "stop" for v in r["reasons"].values()), 0))
        print(f"{name:<13}{r['tokens_per_s']:>8.1f}{r['tokens_per_cpu_s']:>10.1f}"
              f"{r['requests_per_s']:>7.2f}{r['requests_per_cpu_s']:>10.2f}"
              f"{r['tpot_p50_ms']:>9.1f}{r['latency_p50_s']:>8.1f}{r['steps']:>6}"
              f"{r['output_tokens']:>7}{r['jumped_tokens'] / r['output_tokens']:>8.1%}"
              f"{stop:>5}{valid if name in checks else '-':>6}")
    for key in ("tokens_per_s", "tokens_per_cpu_s", "requests_per_s", "requests_per_cpu_s"):
        ratios = [f"{m} / constrained {rows[m][key] / plain[key]:.3f}" for m in rows
                  if m != "constrained"]
        print(f"{key}: " + ", ".join(ratios))
    if "exact" in rows:
        print(f"exact tokens equal to constrained: {same}/{len(trace)}")
    if "string" in rows:
        print(f"string mode: {rows['string']['retokenized']} boundaries re-cut with the last "
              "sampled token")
    if costs:
        print(f"{'batch':>6}{'fill ms':>10}{'sample ms':>11}{'masked ms':>11}{'apply ms':>10}")
    for c in costs:
        print(f"{c['batch']:>6}{c['fill_ms']:>10.3f}{c['sample_ms']:>11.3f}"
              f"{c['masked_sample_ms']:>11.3f}{c['apply_ms']:>10.3f}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        summary = {name: {k: v for k, v in r.items() if k not in ("tokens", "reasons")}
                   for name, r in rows.items()}
        (args.out / "structured_bench.json").write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "runs": summary,
            "exact_equal": same, "stop_valid": checks, "mask_cost": costs}, indent=2))
    complete = all(stop == valid == len(trace) for stop, valid in checks.values())
    return 0 if same == len(trace) and complete else 1


if __name__ == "__main__":
    sys.exit(main())
