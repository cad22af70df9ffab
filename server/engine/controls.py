"""The logit controls of the sampler: penalties, logit bias and the min-tokens mask.

``build_controls`` turns each row's ``SamplingParams`` and tokens so far into the batched
``[R]`` and ``[R, V]`` tensors of ``SamplingMetadata``; ``apply_controls`` applies them to a
batch of logits in a few tensor operations, whatever the mix of rows. A tensor is built only
when some row of the batch asks for its control (the others get neutral values), so a batch
that asks for none pays nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from loraplex.server.engine.request import Request

if TYPE_CHECKING:
    from loraplex.server.engine.sampler import SamplingMetadata


def build_controls(requests: Sequence[Request], vocab_size: int | None,
                   eos_token_ids: tuple[int, ...], device: torch.device | None = None
                   ) -> dict[str, Any]:
    """``SamplingMetadata``'s control fields for one row per request. The ``[R, V]`` tables
    are made on ``device`` (default CPU) from small index tensors: only the token ids cross
    to the device, never a table.

    Raises:
        ValueError: a row needs ``[R, V]`` tensors and ``vocab_size`` is None.
    """
    params = [r.params for r in requests]
    out: dict[str, Any] = {}
    if any(p.min_p > 0 for p in params):
        out["min_p"] = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    blocked = [i for i, r in enumerate(requests) if r.num_output_tokens < r.params.min_tokens]
    repetition = any(p.repetition_penalty != 1.0 for p in params)
    counted = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
    biased = any(p.logit_bias for p in params)
    if not (blocked or repetition or counted or biased):
        return out
    if vocab_size is None:
        raise ValueError("vocab_size: needed for penalties, logit_bias and min_tokens")
    vocab = vocab_size
    num_rows = len(requests)
    dev = device or torch.device("cpu")
    if repetition:
        out["repetition_penalty"] = torch.tensor([p.repetition_penalty for p in params],
                                                 dtype=torch.float32)
        positions = _row_tokens(
            [r.all_token_ids if r.params.repetition_penalty != 1.0 else [] for r in requests],
            dev)
        out["seen_tokens"] = token_set(positions, num_rows, vocab)  # [R, V]
        out["seen_positions"] = positions
    if counted:
        out["frequency_penalty"] = torch.tensor([p.frequency_penalty for p in params],
                                                dtype=torch.float32)
        out["presence_penalty"] = torch.tensor([p.presence_penalty for p in params],
                                               dtype=torch.float32)
        positions = _row_tokens(
            [r.output_token_ids if r.params.frequency_penalty or r.params.presence_penalty
             else [] for r in requests], dev)
        out["output_token_counts"] = token_counts(positions, num_rows, vocab)  # [R, V]
        out["count_positions"] = positions
    if biased:
        rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
        tokens = [t for p in params for t, _ in p.logit_bias]
        values = [b for p in params for _, b in p.logit_bias]
        bias = torch.zeros(num_rows, vocab, dtype=torch.float32, device=dev)  # [R, V]
        bias[torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev)] = torch.tensor(
            values, dtype=torch.float32, device=dev)
        out["logit_bias"] = bias
    if blocked:
        rows, tokens = [], []
        for i in blocked:
            p = params[i]
            stops = [t for t in p.stop_token_ids + (() if p.ignore_eos else eos_token_ids)
                     if t < vocab]
            rows.extend([i] * len(stops))
            tokens.extend(stops)
        mask = torch.zeros(num_rows, vocab, dtype=torch.bool, device=dev)  # [R, V]
        mask[torch.tensor(rows, dtype=torch.long, device=dev),
             torch.tensor(tokens, dtype=torch.long, device=dev)] = True
        out["blocked_tokens"] = mask
    return out


def token_counts(positions: tuple[torch.Tensor, torch.Tensor], num_rows: int, vocab: int
                 ) -> torch.Tensor:
    """``[R, V]`` float32: how many times each ``(row, token)`` of ``positions`` occurs."""
    rows, flat = positions
    counts = torch.zeros(num_rows, vocab, dtype=torch.float32, device=flat.device)
    # Accumulated ones straight into the float32 table: exact integer counts, with no int64
    # [R, V] table to fill and convert.
    counts.index_put_((rows, flat), torch.ones(flat.numel(), device=flat.device),
                      accumulate=True)
    return counts


def token_set(positions: tuple[torch.Tensor, torch.Tensor], num_rows: int, vocab: int
              ) -> torch.Tensor:
    """``[R, V]`` bool: True at each ``(row, token)`` of ``positions``."""
    rows, flat = positions
    seen = torch.zeros(num_rows, vocab, dtype=torch.bool, device=flat.device)
    seen[rows, flat] = True
    return seen


def _row_tokens(token_lists: Sequence[Sequence[int]], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(rows, tokens)`` int64 index tensors of every token of every row's list."""
    flat = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64,
                        device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device),
                                   torch.tensor([len(t) for t in token_lists], device=device))
    return rows, flat


def apply_controls(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """``[R, V]`` logits -> the logits after penalties, logit bias and the min-tokens mask.

    Repetition penalty first, on the model's logits (transformers' order), then the frequency
    and presence penalties, then the bias, then the mask (a bias cannot lift a masked token).
    """
    device = logits.device
    m = metadata
    # One copy of the logits, then every control in place: each touches only the tokens it
    # names (a few hundred per row), never a full [R, V] pass per operation. Per token the
    # arithmetic is the dense formula's, so the values are the same.
    logits = logits.clone()
    if m.repetition_penalty is not None and m.seen_tokens is not None:
        rows, tokens = _positions(m.seen_positions, m.seen_tokens, device)
        values = logits[rows, tokens]
        penalty = m.repetition_penalty.to(device)[rows]
        logits[rows, tokens] = torch.where(values < 0, values * penalty, values / penalty)
    if (m.output_token_counts is not None and m.frequency_penalty is not None
            and m.presence_penalty is not None):
        counts = m.output_token_counts.to(device)  # [R, V]
        rows, tokens = _positions(m.count_positions, counts, device)
        # A token never generated is left alone: x - f * 0 - p * 0 is x.
        logits[rows, tokens] = (logits[rows, tokens]
                                - m.frequency_penalty.to(device)[rows] * counts[rows, tokens]
                                - m.presence_penalty.to(device)[rows])
    if m.logit_bias is not None:
        logits.add_(m.logit_bias.to(device))
    if m.blocked_tokens is not None:
        logits.masked_fill_(m.blocked_tokens.to(device), float("-inf"))
    return logits


def _positions(positions: tuple[torch.Tensor, torch.Tensor] | None, table: torch.Tensor,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # A repeated position is harmless: every write of it stores the same value, computed
    # from the logits before any write.
    if positions is None:
        rows, tokens = table.to(device).nonzero(as_tuple=True)
        return rows, tokens
    return positions[0].to(device), positions[1].to(device)
