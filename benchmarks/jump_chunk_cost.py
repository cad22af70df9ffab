"""What a jumped token costs the next step: a decode step of ``batch`` requests against the
same step where each request also carries ``k`` tokens appended without a model call (as
jump-forward leaves them: computed as a chunk with the next sampled token, no logits).

Prints per batch the decode step's CPU time, the step with ``k`` = 2 / 4 / 8 jumped tokens
per request, and the added cost per jumped token beside a decoded token's share of the step.

Usage: ``python benchmarks/jump_chunk_cost.py --model smollm2``
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from loraplex.server.config import EngineConfig, SchedulerConfig  # noqa: E402
from loraplex.server.engine.engine import Engine  # noqa: E402
from loraplex.server.params import SamplingParams  # noqa: E402


def step_ms(engine: Engine, rng: random.Random, batch: int, k: int, repeats: int) -> float:
    """Best CPU time of a step of ``batch`` decoding requests with ``k`` pending tokens each."""
    vocab = engine.model_config.vocab_size
    reqs = [engine.add_request(f"b{batch}k{k}i{i}", [rng.randrange(vocab) for _ in range(128)],
                               SamplingParams(max_tokens=200, ignore_eos=True))
            for i in range(batch)]
    engine.step()  # the prefill
    engine.step()
    times = []
    for _ in range(repeats):
        for req in reqs:  # as jump-forward appends them: outputs not yet computed
            req.output_token_ids.extend(rng.randrange(vocab) for _ in range(k))
        t0 = time.process_time()
        engine.step()
        times.append(time.process_time() - t0)
    for req in reqs:
        engine.abort(req.request_id)
    engine.step()
    return 1e3 * min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=args.model, num_pages=4096, seed=0,
                                 enable_prefix_caching=False,
                                 scheduler=SchedulerConfig(max_num_seqs=256,
                                                           max_num_batched_tokens=8192)))
    rng = random.Random(0)
    print(f"{'batch':>5}{'decode ms':>10}{'per decoded tok':>16}  k: step ms (+ms per jumped tok)")
    for batch in (1, 4, 16, 64):
        base = step_ms(engine, rng, batch, 0, args.repeats)
        cells = []
        for k in (2, 4, 8):
            ms = step_ms(engine, rng, batch, k, args.repeats)
            cells.append(f"{k}: {ms:.1f} (+{(ms - base) / (batch * k):.2f})")
        print(f"{batch:>5}{base:>10.1f}{base / batch:>16.2f}  " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
