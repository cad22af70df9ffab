"""The sampler alone: ``sample`` at batch B on a vocabulary of V with every control on.

The rows of ``parallel_sampling_bench.py``'s sampler measurement (temperature 0.8, top-k 50,
top-p 0.9, min-p 0.05, presence and frequency penalties 0.5, repetition penalty 1.2,
min-tokens, a 16-token logit bias, a seed each; 64 prompt and 12 output tokens, or
``--prompt-tokens`` / ``--output-tokens``; with
``--logprobs N`` also the top-N logprobs) on fixed random logits, without a model: the median
wall and CPU (this thread's) time of building ``SamplingMetadata`` and sampling, and a digest
of the tokens (a change to the sampler must leave it unchanged). ``--baseline REV`` runs the
sampler of commit REV (its ``sampler.py``, ``controls.py`` and ``truncation.py``) interleaved
with this tree's, on the same rows, and prints the ratio.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/sampler_bench.py --batch 64 --vocab 49152
--baseline 5bfb51a`` (49152: SmolLM2's vocabulary).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from loraplex.server.engine import sampler as current
from loraplex.server.engine.request import Request, SamplingParams


def load_sampler(rev: str) -> types.ModuleType:
    """The sampler module of commit ``rev``, loaded beside the installed one (its controls
    and truncation modules too, where it has them) for interleaved before/after runs."""
    root = Path(__file__).resolve().parents[1]
    sources: dict[str, str] = {}
    for name in ("controls", "truncation", "sampler"):
        shown = subprocess.run(["git", "-C", str(root), "show", f"{rev}:server/engine/{name}.py"],
                               capture_output=True, text=True)
        if shown.returncode == 0:
            sources[name] = shown.stdout
    if "sampler" not in sources:
        raise ValueError(f"--baseline: no server/engine/sampler.py at {rev}")
    prefix = f"_sampler_{rev.replace('-', '_').replace('~', '_').replace('^', '_')}"
    for name, text in sources.items():
        for other in sources:
            text = text.replace(f"loraplex.server.engine.{other} ", f"{prefix}_{other} ")
        module = types.ModuleType(f"{prefix}_{name}")
        sys.modules[module.__name__] = module  # dataclasses look their module up
        exec(compile(text, f"{rev}:server/engine/{name}.py", "exec"), module.__dict__)
    return sys.modules[f"{prefix}_sampler"]


def bench_requests(batch: int, vocab: int, seed: int = 0, logprobs: int | None = None,
                   prompt_tokens: int = 64, output_tokens: int = 12) -> list[Request]:
    """``batch`` requests with every control on (a seed each) and random tokens so far."""
    rng = random.Random(seed)
    requests = []
    for i in range(batch):
        params = SamplingParams(
            max_tokens=24, temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=i,
            presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
            min_tokens=24, logit_bias={rng.randrange(vocab): 5.0 for _ in range(16)},
            ignore_eos=True, logprobs=logprobs)
        req = Request(f"s{i}", [rng.randrange(vocab) for _ in range(prompt_tokens)], params,
                      generator=torch.Generator().manual_seed(i))
        req.output_token_ids = [rng.randrange(vocab) for _ in range(output_tokens)]
        requests.append(req)
    return requests


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--logprobs", type=int, default=None, help="top-N logprobs on every row")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=12)
    p.add_argument("--baseline", default=None, help="a commit whose sampler runs interleaved")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    vocab = args.vocab
    requests = bench_requests(args.batch, vocab, logprobs=args.logprobs,
                              prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens)
    logits = torch.randn(args.batch, vocab, generator=torch.Generator().manual_seed(1))
    variants = {"this tree": current}
    if args.baseline:
        variants = {f"baseline {args.baseline}": load_sampler(args.baseline), **variants}
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    digests: dict[str, str] = {}
    for repeat in range(args.repeats):
        # Alternate the order so that neither variant always runs second (a warm cache).
        order = list(variants.items())
        for name, module in (order if repeat % 2 == 0 else order[::-1]):
            for i, req in enumerate(requests):
                if req.generator is not None:
                    req.generator.manual_seed(i)  # every repeat draws the same tokens
            start, start_cpu = time.perf_counter(), time.thread_time()
            out = module.sample(logits, module.SamplingMetadata.from_requests(
                requests, vocab, (2,)))
            cpu[name].append(time.thread_time() - start_cpu)
            wall[name].append(time.perf_counter() - start)
            digests.setdefault(name, hashlib.sha256(str(out.token_ids).encode()).hexdigest()[:16])
    for name in variants:
        print(f"{name}: sampler at batch {args.batch}, vocab {vocab}, every control on"
              f"{'' if args.logprobs is None else f' + {args.logprobs} logprobs'}: "
              f"median {statistics.median(wall[name]) * 1e3:.2f} ms wall "
              f"(min {min(wall[name]) * 1e3:.2f}), {statistics.median(cpu[name]) * 1e3:.2f} ms "
              f"CPU; tokens {digests[name]}")
    if args.baseline:
        base, new = (statistics.median(cpu[name]) for name in variants)
        print(f"this tree / baseline, median CPU time: {new / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
