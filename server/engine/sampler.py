"""Token choice for a batch of rows: ``sample(logits[R, V], SamplingMetadata) -> SamplerOutput``.

The one seam that structured output (an allowed-token bitmask), speculative decoding
(1 + k rows per request) and parallel sampling (n rows per request) fill or read.

1. Every row's logits get its penalties (repetition as transformers defines it over prompt and
   output tokens, then OpenAI's frequency and presence penalties over output tokens), its
   logit bias, its min-tokens mask (EOS and stop tokens -inf until ``min_tokens``) and its
   allowed-token bitmask (masked tokens -inf): the same few tensor ops for every row, a row
   that asks for nothing getting neutral values.
2. Greedy rows take the argmax; the others are scaled by their temperature, cut to their top-k,
   top-p and min-p sets (``truncation.py``: what a full stable sort of each row keeps, found
   among a few hundred candidates per row), and turned into probabilities: a few tensor ops
   for the whole batch, whatever the mix of parameters.
3. Only the random number is per row: one uniform draw from the row's own ``torch.Generator``
   (a CPU generator), then one batched inverse-CDF search over every row's final
   probabilities, so a seeded request draws the same tokens alone or in any batch, on any
   device, and across preemption (recompute draws nothing).
4. A row whose logits or probabilities are not usable (NaN, +inf, nothing left to draw) is
   reported in ``failed_rows``; the sampler never raises for one row's numbers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from loraplex.kernels.cpu_elementwise import row_argmax
from loraplex.server.engine.controls import apply_controls, build_controls, has_controls
from loraplex.server.engine.request import Request, TokenLogprob
from loraplex.server.engine.truncation import Support, top_n, truncate


@dataclass(frozen=True)
class SamplingMetadata:
    """Which request each row belongs to, and the batch's per-row sampling parameters.

    Attributes:
        requests: the distinct requests of the batch.
        row_requests: ``[R]`` index into ``requests`` of each row (one request may own
            several rows: 1 + k when it speculates, n when it samples n sequences).
        generators: ``[R]`` the generator each row draws from (None: greedy rows).
        greedy: ``[R]`` bool, rows that take the argmax.
        temperature: ``[R]`` float32 (1.0 on greedy rows, never used there).
        top_k: ``[R]`` int64, 0: no cut.
        top_p: ``[R]`` float32, 1.0: no cut.
        logprobs: ``[R]`` None for no logprobs; n: the chosen token's and the top n.
        min_p: ``[R]`` float32 or None; drop tokens below ``min_p`` times the row's top
            probability.
        logit_bias: ``[R, V]`` float32 or None, added to the logits after the penalties (a
            caller's dense table; ``from_requests`` fills ``bias_positions`` instead).
        bias_positions / bias_values: ``(rows, tokens)`` int64 and ``[P]`` float32 or None,
            each row's logit bias entries (a token at most once per row).
        repetition_penalty: ``[R]`` float32 or None (1.0: none), on ``seen_positions``.
        seen_positions: ``(rows, tokens)`` int64 or None, the tokens of each row's prompt and
            output (repeats allowed; set with ``repetition_penalty``).
        seen_tokens: ``[R, V]`` bool or None, the same as a table (used when
            ``seen_positions`` is None).
        frequency_penalty / presence_penalty: ``[R]`` float32 or None (0.0: none), on the
            generated tokens' counts.
        count_positions / count_values: ``(rows, tokens)`` int64 and ``[P]`` float32 or None,
            each ``(row, token)`` a row generated, once, with how often it did.
        output_token_counts: ``[R, V]`` float32 or None, the counts as a table (used when
            ``count_values`` is None; ``count_positions`` then names its nonzero entries,
            repeats allowed, or None: found from the table).
        blocked_positions: ``(rows, tokens)`` int64 or None, tokens masked for this step (EOS
            and stop tokens of a row that has not reached its ``min_tokens``).
        blocked_tokens: ``[R, V]`` bool or None, the same as a table.
        allowed_token_bitmask: ``[R, ceil(V / 32)]`` int32 or None; bit ``j`` of word ``w``
            set means token ``32 * w + j`` is allowed (a row of -1 allows every token).
        return_probs: return the final probabilities of every row (speculative verification).
    """

    requests: tuple[Request, ...]
    row_requests: tuple[int, ...]
    generators: tuple[torch.Generator | None, ...]
    greedy: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    logprobs: tuple[int | None, ...]
    min_p: torch.Tensor | None = None
    logit_bias: torch.Tensor | None = None
    allowed_token_bitmask: torch.Tensor | None = None
    return_probs: bool = False
    repetition_penalty: torch.Tensor | None = None
    seen_tokens: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    output_token_counts: torch.Tensor | None = None
    blocked_tokens: torch.Tensor | None = None
    seen_positions: tuple[torch.Tensor, torch.Tensor] | None = None
    count_positions: tuple[torch.Tensor, torch.Tensor] | None = None
    count_values: torch.Tensor | None = None
    bias_positions: tuple[torch.Tensor, torch.Tensor] | None = None
    bias_values: torch.Tensor | None = None
    blocked_positions: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.row_requests)

    @classmethod
    def from_requests(cls, requests: Sequence[Request], vocab_size: int | None = None,
                      eos_token_ids: Iterable[int] = (), device: torch.device | None = None
                      ) -> SamplingMetadata:
        """One row per request, from each request's ``SamplingParams`` (CPU tensors).

        Args:
            requests: one per row.
            vocab_size: ``V``; needed when a row asks for penalties, a logit bias or min
                tokens (the ``[R, V]`` tensors), else unused.
            eos_token_ids: the model's end-of-sequence tokens, masked by ``min_tokens``.
            device: where the ``[R, V]`` tables are made (the logits' device; default CPU).
        Raises:
            ValueError: a row needs ``[R, V]`` tensors and ``vocab_size`` is None.
        """
        params = [r.params for r in requests]
        greedy = [p.greedy for p in params]
        fields = build_controls(requests, vocab_size, tuple(eos_token_ids), device)
        return cls(
            requests=tuple(requests),
            row_requests=tuple(range(len(requests))),
            generators=tuple(None if g else r.generator for r, g in zip(requests, greedy)),
            greedy=torch.tensor(greedy, dtype=torch.bool),
            temperature=torch.tensor([1.0 if g else p.temperature
                                      for p, g in zip(params, greedy)], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            logprobs=tuple(p.logprobs for p in params),
            **fields,
        )


@dataclass(frozen=True)
class SamplerOutput:
    """What ``sample`` picked.

    Attributes:
        token_ids: ``[R]`` the token of each row (unspecified for a failed row).
        logprobs: ``[R]`` per row that asked: the chosen token's logprob and the top n.
        probs: ``[R, V]`` float32 final probabilities when ``return_probs`` was set (a greedy
            row's is one-hot on its token), else None.
        failed_rows: rows whose logits or probabilities were not usable (non-finite, or no
            token left to draw); their requests fail alone.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    probs: torch.Tensor | None
    failed_rows: tuple[int, ...]


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
    """Pick one token per row.

    Args:
        logits: ``[R, V]`` float32, row ``i`` for request ``metadata.row_requests[i]``.
        metadata: the rows' parameters (``SamplingMetadata.from_requests`` for one row each).
    Returns:
        a ``SamplerOutput``; rows that cannot be sampled are in ``failed_rows``, never raised.
    """
    num_rows, vocab = logits.shape
    if num_rows != metadata.num_rows:
        raise ValueError(f"logits: {num_rows} rows for {metadata.num_rows} rows of metadata")
    raw = logits
    greedy = metadata.greedy.tolist()
    drawn = [i for i in range(num_rows) if not greedy[i]]
    if drawn or has_controls(metadata) or metadata.allowed_token_bitmask is not None:
        # This call's working copy: the controls, the mask and the temperature go in place.
        logits = apply_controls(raw, metadata,
                                out=_SCRATCH.get("logits", num_rows, vocab, raw.device))
    if metadata.allowed_token_bitmask is not None:
        logits = apply_bitmask(logits, raw, metadata.allowed_token_bitmask)
    # A row is unusable if it holds NaN or +inf, or masks every token: its maximum (which
    # propagates NaN) is then not finite. One reduction, not a pass per condition.
    # torch.max over the rows gives both in one pass: the maxima and the first index of each
    # (on the CPU the native row_argmax, the same values ten times faster: torch's op runs one
    # element at a time there).
    found = row_argmax(logits) if logits.is_cpu else None
    maxes, argmax = found if found is not None else logits.max(dim=-1)  # [R], [R]
    failed = ~maxes.isfinite()
    # The argmax is the token of greedy rows only (a failed row's token is unspecified).
    greedy_rows = [i for i in range(num_rows) if greedy[i]]
    picked = argmax.tolist() if greedy_rows else []
    token_ids = [picked[i] if greedy[i] else 0 for i in range(num_rows)]
    probs_out = None
    if metadata.return_probs:
        probs_out = torch.zeros(num_rows, vocab, dtype=torch.float32)
        probs_out[greedy_rows, [token_ids[i] for i in greedy_rows]] = 1.0
    failed_rows = set(torch.nonzero(failed.cpu()).flatten().tolist())
    if drawn:
        index = torch.tensor(drawn, device=logits.device)
        probs, support = _probabilities(logits, metadata, index, len(drawn) == num_rows)
        # Inverse-CDF draws: one uniform number per row from the row's own (CPU) generator,
        # so a seeded row draws the same alone or in any batch, on any device; the search
        # is one batched op (a zero-probability token is never found: its CDF step is empty).
        uniform = torch.tensor([draw_uniform(metadata.generators[i]) for i in drawn],
                               dtype=torch.float64, device=probs.device)  # [N]
        picks, usable = _draw(probs, support, uniform)
        chosen, bad = picks.tolist(), (~usable).tolist()
        for row, i in enumerate(drawn):
            if i in failed_rows or bad[row]:
                failed_rows.add(i)
            else:
                token_ids[i] = chosen[row]
        if probs_out is not None:
            probs_out[index.cpu()] = probs.cpu()
    logprobs = _logprobs(raw, metadata, token_ids, failed_rows)
    return SamplerOutput(token_ids, logprobs, probs_out, tuple(sorted(failed_rows)))


def _probabilities(logits: torch.Tensor, metadata: SamplingMetadata, index: torch.Tensor,
                   all_rows: bool = False) -> tuple[torch.Tensor, Support | None]:
    """``[R, V]`` logits (this call's working copy, overwritten) -> the final probabilities
    ``[N, V]`` of the drawn rows ``index`` (on the logits' device) and the support of the rows
    a cut left few tokens (``all_rows``: ``index`` is every row)."""
    dev = index.device
    temperature = metadata.temperature.to(dev)[index, None]
    scaled = logits.div_(temperature) if all_rows else logits[index].div_(temperature)
    num_drawn, vocab = scaled.shape
    min_p = metadata.min_p.to(dev)[index] if metadata.min_p is not None else None
    return truncate(scaled, metadata.top_k.to(dev)[index], metadata.top_p.to(dev)[index],
                    min_p, out=_SCRATCH.get("probs", num_drawn, vocab, dev))


# 64 MiB of float32 per buffer (three per thread): batch 64 at a 256k vocabulary.
SCRATCH_MAX_ELEMENTS = 16 * 1024 * 1024


class _Scratch(threading.local):
    """Per-thread ``[R, V]`` float32 buffers the sampler reuses from call to call on CPU.

    A fresh 12 MB tensor each step can pay its page faults again (milliseconds on a loaded
    host: glibc hands large blocks back to the kernel); nothing ``sample`` returns is one of
    these. Each grows to the largest batch seen, up to ``SCRATCH_MAX_ELEMENTS`` (larger ones
    are plain allocations, as on other devices, where the caching allocator does this).
    """

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        if device.type != "cpu" or rows * cols > SCRATCH_MAX_ELEMENTS:
            return torch.empty(rows, cols, dtype=torch.float32, device=device)
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < rows * cols:
            buffer = self.buffers[name] = torch.empty(rows * cols, dtype=torch.float32)
        return buffer[:rows * cols].view(rows, cols)


_SCRATCH = _Scratch()


def _draw(probs: torch.Tensor, support: Support | None, uniform: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, V]`` probabilities, ``[N]`` float64 uniforms -> ``([N]`` tokens, ``[N]`` bool
    rows whose probabilities sum to a finite positive number): each row's token by
    ``_inverse_cdf`` over its support where it has one, else over its nonzero entries."""
    num_rows, vocab = probs.shape
    tokens = torch.empty(num_rows, dtype=torch.int64, device=probs.device)
    usable = torch.empty(num_rows, dtype=torch.bool, device=probs.device)
    has = support.rows if support is not None else torch.zeros(
        num_rows, dtype=torch.bool, device=probs.device)
    if support is not None and bool(has.any()):
        rows = has.nonzero()[:, 0]
        ids = support.ids[rows]  # [M, K], ascending
        valid = ids < vocab
        packed = probs[rows[:, None], ids.clamp(max=vocab - 1)].masked_fill(~valid, 0.0)
        # Outside the support every probability is zero, so the support's sum is finite and
        # positive exactly when the row's is.
        total = packed.sum(-1)
        usable[rows] = total.isfinite() & (total > 0)
        tokens[rows] = _inverse_cdf(packed, ids.masked_fill(~valid, vocab - 1), uniform[rows],
                                    vocab)
    if not bool(has.all()):
        rows = (~has).nonzero()[:, 0]
        dense = probs[rows]
        total = dense.sum(-1)  # a non-finite probability makes it non-finite
        usable[rows] = total.isfinite() & (total > 0)
        r, t = (dense > 0).nonzero(as_tuple=True)  # row-major: token order in each row
        counts = torch.bincount(r, minlength=rows.numel())
        width = max(int(counts.max()) if r.numel() else 0, 1)
        slots = torch.arange(r.numel(), device=probs.device) - (counts.cumsum(0) - counts)[r]
        packed = torch.zeros(rows.numel(), width, dtype=probs.dtype, device=probs.device)
        packed[r, slots] = dense[r, t]
        ids = torch.full((rows.numel(), width), vocab - 1, dtype=torch.int64,
                         device=probs.device)
        ids[r, slots] = t
        tokens[rows] = _inverse_cdf(packed, ids, uniform[rows], vocab)
    return tokens, usable


def _inverse_cdf(packed: torch.Tensor, ids: torch.Tensor, uniform: torch.Tensor, vocab: int
                 ) -> torch.Tensor:
    """``[N, K]`` probabilities of the tokens ``ids`` ``[N, K]`` (ascending per row; every
    other token of the row has probability zero), ``[N]`` float64 uniforms -> ``[N]`` the
    token whose float64 CDF step holds ``uniform * total`` (the last token past the end).

    A zero adds nothing to a running sum, so every partial sum over the packed tokens is the
    full row's CDF, bit for bit, and a zero's empty step is never found.
    """
    cdf = packed.double().cumsum(-1)  # [N, K]
    found = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)  # [N, 1]
    past = torch.cat([ids, ids.new_full((ids.shape[0], 1), vocab - 1)], 1)  # [N, K + 1]
    return past.gather(1, found)[:, 0]


def _logprobs(logits: torch.Tensor, metadata: SamplingMetadata, token_ids: list[int],
              failed_rows: set[int]) -> list[TokenLogprob | None]:
    # Logprobs are of the model's distribution (raw logits), as OpenAI's API reports them.
    out: list[TokenLogprob | None] = [None] * metadata.num_rows
    wanted = [i for i, n in enumerate(metadata.logprobs) if n is not None and i not in failed_rows]
    if not wanted:
        return out
    dev = logits.device
    rows = logits if len(wanted) == logits.shape[0] else logits[torch.tensor(wanted, device=dev)]
    buffer = _SCRATCH.get("logprobs", len(wanted), rows.shape[1], dev)
    lp = torch.log_softmax(rows, -1, out=buffer)  # [W, V]
    chosen = lp.gather(1, torch.tensor([token_ids[i] for i in wanted], device=dev)[:, None])
    chosen_lp = chosen[:, 0].tolist()
    num_top = max(metadata.logprobs[i] or 0 for i in wanted)
    tops: list[list[tuple[int, float]]] = [[] for _ in wanted]
    if num_top:
        # One batched search for every row's top n (each row cut to its own n), in the
        # order a stable sort gives: more likely first, the lower token id among ties.
        values, ids = top_n(lp, min(num_top, lp.shape[-1]))
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    for row, i in enumerate(wanted):
        n = metadata.logprobs[i] or 0
        out[i] = TokenLogprob(token_ids[i], chosen_lp[row], tuple(tops[row][:n]))
    return out


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int
                   ) -> list[TokenLogprob]:
    """The logprob of ``token_ids[i]`` under row ``i`` of ``logits`` ``[N, V]``, with the top
    ``num_top`` (the model's distribution, as ``logprobs`` reports it)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    ids = torch.tensor(token_ids, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(token_ids)
    if num_top:
        values, top_ids = lp.topk(num_top, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
    return [TokenLogprob(t, c, top) for t, c, top in zip(token_ids, chosen, tops)]


def draw_uniform(generator: torch.Generator | None) -> float:
    """The one number a sampled row draws from its generator per token. A token appended
    without sampling (jump-forward) draws it too, so the tokens after it are those of a run
    that sampled it."""
    return float(torch.rand(1, generator=generator, dtype=torch.float64))


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[R, ceil(V / 32)]`` int32 -> ``[R, V]`` bool, True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_bitmask(logits: torch.Tensor, raw: torch.Tensor, bitmask: torch.Tensor
                  ) -> torch.Tensor:
    """``logits`` ``[R, V]`` with the tokens ``bitmask`` (``[R, ceil(V / 32)]`` int32) does not
    allow set to -inf; ``raw`` (the unprocessed logits, read later for logprobs) is never
    written."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or bitmask.is_cuda:
        allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
        return logits.masked_fill(~allowed, float("-inf"))
    # On CPU xgrammar's kernel reads the packed words in place: unpacking to an [R, V] bool
    # tensor first costs twice as much over a 49k vocabulary (issue 17).
    if logits.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr():
        logits = logits.clone()  # no control touched the logits: keep ``raw`` as it was
    elif not logits.is_contiguous():
        logits = logits.contiguous()
    xgr.apply_token_bitmask_inplace(logits, bitmask.contiguous(), vocab_size=logits.shape[-1])
    return logits
