"""The acceptance rule of speculative decoding, as pure functions.

A request proposes ``x_1 .. x_k`` and the target model scores ``1 + k`` rows in one pass: row
``j`` is the target's distribution ``p_j`` after the known tokens and ``x_1 .. x_j``.

- Greedy: accept the longest prefix of the proposal that equals the rows' argmax; then append
  the argmax of the first row that disagrees (or of the last row: the bonus token). The
  output is token for token plain greedy decoding's.
- Sampled, deterministic proposer (its ``q_j`` is a point mass on ``x_j``): the standard rule
  (Leviathan et al., Chen et al.) accepts ``x_j`` with probability ``min(1, p_j(x_j) /
  q_j(x_j)) = p_j(x_j)`` and, on rejection, draws from ``max(0, p_j - q_j)`` normalised: ``p_j``
  with ``x_j`` removed. ``verify`` implements it by coupling: each row draws its token ``t_j``
  from ``p_j`` by inverse CDF with the request's next uniform ``u_j`` (what the sampler does
  for any row), and ``x_j`` is accepted iff ``t_j == x_j``. Then ``P(accept) = p_j(x_j)``, and
  given a rejection ``t_j`` is distributed as ``p_j`` conditioned on ``!= x_j``: exactly the
  residual. Each emitted token consumes exactly one uniform of the request's own generator
  (``keep_draws`` rewinds the unused ones), as without speculation, so a seeded request's
  tokens are those of plain sampling (up to float rounding of a differently shaped pass)
  whatever its k, its proposals or the rest of the batch.
- ``rejection_sample`` is the general rule for a proposer with a distribution (a draft
  model), written out; for a point mass it is the same law as ``verify``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class Verdict(NamedTuple):
    """What a verification appends to a request."""

    token_ids: list[int]  # the accepted proposals, then the target's own token: 1..k+1 tokens
    num_accepted: int  # proposals accepted (len(token_ids) - 1)


def verify(proposal: Sequence[int], target_token_ids: Sequence[int]) -> Verdict:
    """Accept the longest prefix of ``proposal`` that the target's own tokens repeat.

    Args:
        proposal: ``x_1 .. x_k``, the proposed tokens.
        target_token_ids: ``[k + 1]`` the target's token at each row (argmax for greedy rows,
            the inverse-CDF draw with the request's next uniform for sampled rows).
    Returns:
        the accepted proposals then the first disagreeing (or the bonus) target token.
    Raises:
        ValueError: ``target_token_ids`` is not one longer than ``proposal``.
    """
    if len(target_token_ids) != len(proposal) + 1:
        raise ValueError(f"target_token_ids: {len(target_token_ids)} rows for "
                         f"{len(proposal)} proposed tokens (need 1 + k)")
    accepted = 0
    for x, t in zip(proposal, target_token_ids):
        if x != t:
            break
        accepted += 1
    return Verdict(list(target_token_ids[:accepted + 1]), accepted)


def keep_draws(generator: torch.Generator, state: torch.Tensor, num_used: int) -> None:
    """Leave ``generator`` as if only ``num_used`` of the uniforms drawn since ``state`` (its
    ``get_state()`` before the rows were sampled) had been drawn: one per emitted token."""
    generator.set_state(state)
    if num_used:
        torch.rand(num_used, generator=generator, dtype=torch.float64)


def rejection_sample(target_probs: torch.Tensor, proposal: Sequence[int],
                     generator: torch.Generator,
                     draft_probs: torch.Tensor | None = None) -> Verdict:
    """The standard speculative-sampling rule, for a proposer with distribution ``q``.

    Accept ``x_j`` with probability ``min(1, p_j(x_j) / q_j(x_j))``; on the first rejection
    draw from ``max(0, p_j - q_j)`` normalised and stop; when every proposal is accepted draw
    the bonus token from ``p_k``. The output is distributed as ``1..k+1`` tokens sampled from
    the target alone.

    Args:
        target_probs: ``[k + 1, V]`` float, the target's row distributions.
        proposal: ``[k]`` the proposed tokens.
        generator: the request's own generator (every draw comes from it).
        draft_probs: ``[k, V]`` the proposer's distributions; None: a deterministic proposer
            (a point mass on each ``x_j``).
    Raises:
        ValueError: shapes that do not fit.
    """
    k = len(proposal)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs: need [{k + 1}, V], got {tuple(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs: need [{k}, {target_probs.shape[1]}], got "
                         f"{tuple(draft_probs.shape)}")
    p = target_probs.double()
    for j, x in enumerate(proposal):
        if draft_probs is None:
            q = torch.zeros_like(p[j])
            q[x] = 1.0
        else:
            q = draft_probs[j].double()
        ratio = float(p[j, x] / q[x]) if q[x] > 0 else 0.0
        if float(torch.rand(1, generator=generator, dtype=torch.float64)) < min(1.0, ratio):
            continue
        residual = (p[j] - q).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q: a rejection has probability 0
            residual = p[j]
        token = int(torch.multinomial(residual, 1, generator=generator))
        return Verdict([*proposal[:j], token], j)
    bonus = int(torch.multinomial(p[k], 1, generator=generator))
    return Verdict([*proposal, bonus], k)
