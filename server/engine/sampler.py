"""Token choice per request: greedy, temperature, top-k, top-p, per-request seeds.

Each request samples from its own ``torch.Generator``, so a seeded request draws the same
tokens alone or in any batch, and across preemption (recompute draws nothing).
"""

from __future__ import annotations

import torch

from loraplex.server.engine.request import Request, TokenLogprob


def sample(logits: torch.Tensor, requests: list[Request]) -> tuple[list[int],
                                                                    list[TokenLogprob | None]]:
    """Pick one token per row.

    Args:
        logits: ``[N, vocab]`` float32, row ``i`` for ``requests[i]``.
    Returns:
        token ids and, per request that asked for them, the chosen token's logprob with top-n.
    """
    token_ids = logits.argmax(dim=-1).tolist()
    drawn = [i for i, r in enumerate(requests) if not r.params.greedy]
    if drawn:
        # Request generators are CPU generators (seeded draws do not depend on the device),
        # and torch refuses a CPU generator for CUDA tensors: draw from a CPU copy of the rows.
        rows = logits[drawn].cpu()  # [len(drawn), vocab]
        for row, i in zip(rows, drawn):
            token_ids[i] = _sample_row(row, requests[i])
    logprobs: list[TokenLogprob | None] = [None] * len(requests)
    wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if wanted:
        lp = torch.log_softmax(logits[wanted], dim=-1)  # [len(wanted), vocab]
        for row, i in enumerate(wanted):
            n = requests[i].params.logprobs or 0
            top: tuple[tuple[int, float], ...] = ()
            if n:
                values, ids = lp[row].topk(n)
                top = tuple(zip(ids.tolist(), values.tolist()))
            logprobs[i] = TokenLogprob(token_ids[i], float(lp[row, token_ids[i]]), top)
    return token_ids, logprobs


def _sample_row(logits: torch.Tensor, req: Request) -> int:
    params = req.params
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= params.top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = scaled.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=req.generator).item())
