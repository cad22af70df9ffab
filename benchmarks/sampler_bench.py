"""The sampler alone: ``sample`` at batch B on a vocabulary of V with every control on.

The rows of ``parallel_sampling_bench.py``'s sampler measurement (temperature 0.8, top-k 50,
top-p 0.9, min-p 0.05, presence and frequency penalties 0.5, repetition penalty 1.2,
min-tokens, a 16-token logit bias, a seed each; 64 prompt and 12 output tokens) on fixed
random logits, without a model: the median time of building ``SamplingMetadata`` and
sampling, and a digest of the tokens (a change to the sampler must leave it unchanged).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/sampler_bench.py --batch 64 --vocab 49152``
(49152: SmolLM2's vocabulary).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import time

import torch

from loraplex.server.engine.request import Request, SamplingParams
from loraplex.server.engine.sampler import SamplingMetadata, sample


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    vocab = args.vocab
    requests = []
    for i in range(args.batch):
        params = SamplingParams(
            max_tokens=24, temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=i,
            presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
            min_tokens=24, logit_bias={rng.randrange(vocab): 5.0 for _ in range(16)},
            ignore_eos=True)
        req = Request(f"s{i}", [rng.randrange(vocab) for _ in range(64)], params,
                      generator=torch.Generator().manual_seed(i))
        req.output_token_ids = [rng.randrange(vocab) for _ in range(12)]
        requests.append(req)
    logits = torch.randn(args.batch, vocab, generator=torch.Generator().manual_seed(1))
    times, digest = [], ""
    for repeat in range(args.repeats):
        for i, req in enumerate(requests):
            if req.generator is not None:
                req.generator.manual_seed(i)  # every repeat draws the same tokens
        start = time.perf_counter()
        out = sample(logits, SamplingMetadata.from_requests(requests, vocab, (2,)))
        times.append(time.perf_counter() - start)
        if repeat == 0:
            digest = hashlib.sha256(str(out.token_ids).encode()).hexdigest()[:16]
    print(f"sampler at batch {args.batch}, vocab {vocab}, every control on: median "
          f"{statistics.median(times) * 1e3:.2f} ms, min {min(times) * 1e3:.2f} ms; "
          f"tokens {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
