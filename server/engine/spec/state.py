"""One request's speculation: its proposer context, its adaptive k and its counters.

k adapts from the request's own verifications only (never from the batch): it grows by one
after a fully accepted proposal, falls to one more than what was accepted after a partial
one, and after proposals that were wholly rejected in a row the request stops proposing for
a while (1, 3, 7, ... steps, at most ``MAX_PAUSE``), so a request whose text does not repeat
itself soon costs nothing. A proposer with no guess (no n-gram match) proposes nothing that
step and leaves k alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_PAUSE = 31  # steps without proposing, at most, after repeated wholly rejected proposals


@dataclass
class SpecState:
    """A request's speculative-decoding state (``Request.spec``).

    Attributes:
        context: the proposer's per-request state (``Proposer.new_context``).
        max_k: ``num_speculative_tokens``.
        k: tokens to propose next time.
        pause: steps left without proposing.
        num_rejected_in_row: consecutive verifications with nothing accepted.
        num_proposed / num_accepted / num_verifications: totals for stats.
    """

    context: Any
    max_k: int
    k: int = 0
    pause: int = 0
    num_rejected_in_row: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    num_verifications: int = 0

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"num_speculative_tokens: must be >= 1, got {self.max_k}")
        self.k = self.k or self.max_k

    def next_k(self) -> int:
        """Tokens to propose this step (0: not this step). Counts a paused step."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.k

    def update(self, num_proposed: int, num_accepted: int) -> None:
        """Learn from one verification of ``num_proposed`` tokens."""
        if num_proposed <= 0:
            return
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.num_verifications += 1
        if num_accepted == num_proposed:
            self.k = min(self.max_k, self.k + 1)
        else:
            self.k = max(1, num_accepted + 1)
        if num_accepted == 0:
            self.num_rejected_in_row += 1
            self.pause = min(MAX_PAUSE, 2 ** (self.num_rejected_in_row - 1) - 1)
        else:
            self.num_rejected_in_row = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens (0.0 before any proposal)."""
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0
