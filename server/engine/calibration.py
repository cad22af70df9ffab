"""Warm-up calibration of the step cost model: before a worker with ``target_itl_ms`` serves,
it times the model on a few dummy steps of different shapes (prefill chunks of growing size,
decode batches of growing width and context, a mixed step), so the first real steps are
already sized by a fitted model rather than by a guess.

The steps run on pages borrowed from the pager's free list, which all go back; nothing else
is touched (no request, no prefix-cache entry, no adapter). Their outputs are thrown away.
Calibration steps stay in the model's fit for good (``StepCostModel.observe(calibration=
True)``); live steps then correct what the dummy ones miss (scheduling and sampling overhead,
adapters, the machine's load).
"""

from __future__ import annotations

import logging
import time

import torch

from loraplex.server.engine.model_runner import ModelRunner
from loraplex.server.engine.pager import Pager
from loraplex.server.engine.step_cost import StepCostModel, StepShapeBuilder
from loraplex.server.engine.warmup import run_dummy_step

logger = logging.getLogger(__name__)


def calibration_shapes(max_tokens: int, max_model_len: int, max_chunk: int = 256
                       ) -> list[tuple[list[int], list[int]]]:
    """``(prefill chunk lengths, decode context lengths)`` per dummy step, within the token
    budget and the context."""
    chunk_cap = max(1, min(max_chunk, max_tokens, max_model_len - 1))
    ctx_cap = max(1, max_model_len - 2)
    chunks = sorted({min(c, chunk_cap) for c in (16, 64, max_chunk)})
    shapes: list[tuple[list[int], list[int]]] = [([c], []) for c in chunks]
    for rows, ctx in ((1, 128), (8, 128), (32, 128), (8, 512)):
        rows = min(rows, max_tokens)
        shapes.append(([], [min(ctx, ctx_cap)] * rows))
    mixed_rows = min(8, max(0, max_tokens - chunks[-1]))
    shapes.append(([chunks[-1]], [min(128, ctx_cap)] * mixed_rows))
    return shapes


@torch.inference_mode()
def calibrate(runner: ModelRunner, pager: Pager, model: StepCostModel, max_tokens: int,
              max_model_len: int, repeats: int = 2) -> int:
    """Time the dummy steps of ``calibration_shapes`` and feed them to ``model``.

    Args:
        runner: the engine's model runner.
        pager: the engine's pager; shapes that do not fit its free pages are skipped.
        model: the cost model to calibrate.
        max_tokens: the step's token budget (``max_num_batched_tokens``).
        max_model_len: the context served.
        repeats: runs per shape; the first warms caches and is not recorded.
    Returns:
        The calibration steps recorded.
    """
    start = time.perf_counter()
    page_size = runner.page_size
    recorded = 0
    for chunks, contexts in calibration_shapes(max_tokens, max_model_len):
        q_lens = chunks + [1] * len(contexts)
        seq_lens = chunks + [c + 1 for c in contexts]
        num_pages = sum(-(-n // page_size) for n in seq_lens)
        if num_pages > pager.num_free:
            continue
        pages = pager.allocate(num_pages)
        try:
            tables, i = [], 0
            for n in seq_lens:
                k = -(-n // page_size)
                tables.append(pages[i:i + k])
                i += k
            shape = StepShapeBuilder()
            for q, n in zip(q_lens, seq_lens):
                shape.add(n - q, q, decode=q == 1 and n > 1)
            for r in range(max(1, repeats)):
                t0 = time.perf_counter()
                _run(runner, tables, q_lens, seq_lens)
                if r or repeats == 1:
                    model.observe(shape.shape(), time.perf_counter() - t0, calibration=True)
                    recorded += 1
        finally:
            pager.free(pages)
    logger.info("step cost calibration: %d steps in %.1f s, coefficients %s", recorded,
                time.perf_counter() - start, ", ".join(f"{c:.3g}" for c in model.coefficients))
    return recorded


def _run(runner: ModelRunner, tables: list[list[int]], q_lens: list[int],
         seq_lens: list[int]) -> None:
    with runner.device_context():
        logits = run_dummy_step(runner, tables, q_lens, seq_lens, None, runner.attention)
        logits.argmax(dim=-1).tolist()  # as sampling does: waits for the device
