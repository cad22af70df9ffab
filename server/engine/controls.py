"""The logit controls of the sampler: penalties, logit bias and the min-tokens mask.

``build_controls`` turns each row's ``SamplingParams`` and tokens so far into ``[R]``
parameters and ``(rows, tokens)`` index tensors of ``SamplingMetadata``; ``apply_controls``
applies them to a batch of logits in a few tensor operations, whatever the mix of rows. Every
control names a few hundred ``(row, token)`` entries at most, so none builds an ``[R, V]``
table: each is an index read and write of those entries (dense tables set by a caller are
still applied). A tensor is built only when some row of the batch asks for its control (the
others get neutral values), so a batch that asks for none pays nothing, not even a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from loraplex.server.engine.request import Request
from loraplex.server.engine.row_tokens import output_tokens, seen_tokens

if TYPE_CHECKING:
    from loraplex.server.engine.sampler import SamplingMetadata


def build_controls(requests: Sequence[Request], vocab_size: int | None,
                   eos_token_ids: tuple[int, ...], device: torch.device | None = None
                   ) -> dict[str, Any]:
    """``SamplingMetadata``'s control fields for one row per request, as index tensors on
    ``device`` (default CPU): only token ids cross to the device, never a table.

    Raises:
        ValueError: a row needs a control over the vocabulary and ``vocab_size`` is None.
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
    dev = device or torch.device("cpu")
    if repetition:
        out["repetition_penalty"] = torch.tensor([p.repetition_penalty for p in params],
                                                 dtype=torch.float32)
        out["seen_positions"] = _positions_of(
            [seen_tokens(r) if r.params.repetition_penalty != 1.0 else () for r in requests],
            dev)
    if counted:
        out["frequency_penalty"] = torch.tensor([p.frequency_penalty for p in params],
                                                dtype=torch.float32)
        out["presence_penalty"] = torch.tensor([p.presence_penalty for p in params],
                                               dtype=torch.float32)
        rows, tokens = _positions_of(
            [(output_tokens(r),) if r.params.frequency_penalty or r.params.presence_penalty
             else () for r in requests], dev)
        # Each (row, token) once, with how often it occurs: exact integer counts in float32.
        keys, counts = torch.unique(rows * vocab + tokens, return_counts=True)
        out["count_positions"] = (keys // vocab, keys % vocab)
        out["count_values"] = counts.to(torch.float32)
    if biased:
        rows_b = [i for i, p in enumerate(params) for _ in p.logit_bias]
        tokens_b = [t for p in params for t, _ in p.logit_bias]
        values = [b for p in params for _, b in p.logit_bias]
        out["bias_positions"] = (torch.tensor(rows_b, dtype=torch.int64, device=dev),
                                 torch.tensor(tokens_b, dtype=torch.int64, device=dev))
        out["bias_values"] = torch.tensor(values, dtype=torch.float32, device=dev)
    if blocked:
        rows_m: list[int] = []
        tokens_m: list[int] = []
        for i in blocked:
            p = params[i]
            stops = [t for t in p.stop_token_ids + (() if p.ignore_eos else eos_token_ids)
                     if t < vocab]
            rows_m.extend([i] * len(stops))
            tokens_m.extend(stops)
        out["blocked_positions"] = (torch.tensor(rows_m, dtype=torch.int64, device=dev),
                                    torch.tensor(tokens_m, dtype=torch.int64, device=dev))
    return out


def _positions_of(pieces: Sequence[Sequence[torch.Tensor]], device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(rows, tokens)`` int64 index tensors of every token of every row's tensors."""
    lengths = torch.tensor([sum(t.numel() for t in row) for row in pieces], dtype=torch.int64)
    flat = [t for row in pieces for t in row]
    tokens = torch.cat(flat) if flat else torch.empty(0, dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(pieces)), lengths)
    return rows.to(device), tokens.to(device)


def has_controls(metadata: SamplingMetadata) -> bool:
    """Whether ``apply_controls`` changes any logit of this batch."""
    m = metadata
    return (m.repetition_penalty is not None or m.frequency_penalty is not None
            or m.logit_bias is not None or m.bias_positions is not None
            or m.blocked_tokens is not None or m.blocked_positions is not None)


def apply_controls(logits: torch.Tensor, metadata: SamplingMetadata,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, V]`` logits -> the logits after penalties, logit bias and the min-tokens mask.

    Repetition penalty first, on the model's logits (transformers' order), then the frequency
    and presence penalties, then the bias, then the mask (a bias cannot lift a masked token).

    Args:
        logits: ``[R, V]`` float32, never written (unless it is ``out``).
        metadata: the rows' controls.
        out: ``[R, V]`` float32 to write the result into; default a fresh copy, or ``logits``
            itself when the batch has no control.
    """
    device = logits.device
    m = metadata
    if not has_controls(m):
        return logits if out is None else out.copy_(logits)
    # One copy of the logits, then every control in place: each touches only the tokens it
    # names (a few hundred per row), never a full [R, V] pass per operation. Per token the
    # arithmetic is the dense formula's, so the values are the same.
    logits = logits.clone() if out is None else out.copy_(logits)
    if m.repetition_penalty is not None and (m.seen_positions is not None
                                             or m.seen_tokens is not None):
        rows, tokens = _positions(m.seen_positions, m.seen_tokens, device)
        values = logits[rows, tokens]
        penalty = m.repetition_penalty.to(device)[rows]
        logits[rows, tokens] = torch.where(values < 0, values * penalty, values / penalty)
    counted = _counts(m, device)
    if counted is not None and m.frequency_penalty is not None and m.presence_penalty is not None:
        rows, tokens, counts = counted
        # A token never generated is left alone: x - f * 0 - p * 0 is x.
        logits[rows, tokens] = (logits[rows, tokens]
                                - m.frequency_penalty.to(device)[rows] * counts
                                - m.presence_penalty.to(device)[rows])
    if m.logit_bias is not None:
        logits.add_(m.logit_bias.to(device))
    if m.bias_positions is not None and m.bias_values is not None:
        # x + b at the named entries is the dense table's x + b there (x + 0 elsewhere is x);
        # a request names each token once.
        rows, tokens = m.bias_positions[0].to(device), m.bias_positions[1].to(device)
        logits.index_put_((rows, tokens), m.bias_values.to(device), accumulate=True)
    if m.blocked_tokens is not None:
        logits.masked_fill_(m.blocked_tokens.to(device), float("-inf"))
    if m.blocked_positions is not None:
        rows, tokens = m.blocked_positions[0].to(device), m.blocked_positions[1].to(device)
        logits[rows, tokens] = float("-inf")
    return logits


def _counts(m: SamplingMetadata, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(rows, tokens, counts)`` of the generated tokens, from the positions or a table."""
    if m.count_values is not None and m.count_positions is not None:
        return (m.count_positions[0].to(device), m.count_positions[1].to(device),
                m.count_values.to(device))
    if m.output_token_counts is None:
        return None
    table = m.output_token_counts.to(device)  # [R, V]
    rows, tokens = _positions(m.count_positions, table, device)
    return rows, tokens, table[rows, tokens]


def _positions(positions: tuple[torch.Tensor, torch.Tensor] | None, table: torch.Tensor | None,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # A repeated position is harmless: every write of it stores the same value, computed
    # from the logits before any write.
    if positions is None:
        if table is None:
            raise ValueError("seen_tokens / output_token_counts: a table or its positions")
        rows, tokens = table.to(device).nonzero(as_tuple=True)
        return rows, tokens
    return positions[0].to(device), positions[1].to(device)
