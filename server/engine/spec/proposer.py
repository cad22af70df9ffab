"""Proposers: guess the next few tokens of a request cheaply, for the target model to verify.

``Proposer`` is the interface (batched, so a draft model can run one forward pass for the
step); ``NgramProposer`` is prompt lookup (vLLM's and SGLang's ``ngram``): find the latest
earlier occurrence of the request's last ``n`` tokens in its own prompt and output (longest
``n`` first) and propose what followed it. Its index (``NgramIndex``) is built incrementally,
once per known token, so a step's lookup costs a few dictionary probes per request, not a
scan of the context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Proposer(Protocol):
    """Proposes tokens to follow each request's known tokens (prompt then outputs).

    A proposer keeps per-request state in a context it makes (``new_context``; the engine
    keeps it on the request's ``SpecState``): an n-gram index, or a draft model's KV."""

    def new_context(self) -> Any:
        """A fresh context for one request."""
        ...

    def propose(self, contexts: Sequence[Any], token_lists: Sequence[list[int]],
                ks: Sequence[int]) -> list[list[int]]:
        """Up to ``ks[i]`` tokens to follow ``token_lists[i]`` (fewer, or none, when it has
        no guess); ``contexts[i]`` is that request's context. One call per step for the
        whole batch (a draft model runs one forward pass)."""
        ...


class NgramIndex:
    """One request's n-grams of ``min_n..max_n`` tokens -> the position right after their
    latest occurrence whose next token is known.

    Invariant: every n-gram ending at a position ``i < num_indexed`` is indexed. The tokens
    only ever grow (outputs are appended, never removed: a rejected proposal never enters
    them), so the index never has to forget.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._next: dict[tuple[int, ...], int] = {}
        self.num_indexed = 1

    def _extend(self, tokens: Sequence[int]) -> None:
        # An n-gram ending at i (tokens[i - n:i]) is indexed once tokens[i] is known, i < L:
        # the last n-gram, the one being looked up, has no known continuation yet.
        index = self._next
        for i in range(self.num_indexed, len(tokens)):
            for n in range(self.min_n, min(self.max_n, i) + 1):
                index[tuple(tokens[i - n:i])] = i
        self.num_indexed = max(self.num_indexed, len(tokens))

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens following the latest earlier occurrence of the longest suffix
        of ``tokens`` (``max_n`` down to ``min_n`` tokens); [] when none occurred before.

        A continuation that runs into the suffix itself goes on with the proposed tokens
        (a repeating pattern proposes its next period, not only what is left of it)."""
        if k <= 0:
            return []
        self._extend(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            start = self._next.get(tuple(tokens[length - n:]))
            if start is None:
                continue
            out: list[int] = []
            for j in range(start, start + k):
                out.append(tokens[j] if j < length else out[j - length])
            return out
        return []


class NgramProposer:
    """Prompt lookup over each request's own prompt and output (no model, no other
    request's tokens: a request's proposals depend on nothing else in the batch).

    Args:
        min_n / max_n: the n-gram sizes matched, longest first.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        NgramIndex(min_n, max_n)  # validates the sizes now, not at the first request
        self.min_n = min_n
        self.max_n = max_n

    def new_context(self) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n)

    def propose(self, contexts: Sequence[NgramIndex], token_lists: Sequence[list[int]],
                ks: Sequence[int]) -> list[list[int]]:
        return [ctx.lookup(tokens, k) for ctx, tokens, k in zip(contexts, token_lists, ks)]
