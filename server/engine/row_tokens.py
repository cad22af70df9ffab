"""Each request's token ids as int64 tensors, kept from step to step for the penalties.

A request's penalties read every token of its prompt and output, every step: turning those
Python lists into tensors costs ~25 ns a token (12 ms a step at batch 64 with 2k-token
prompts). Here a prompt becomes a tensor of its distinct tokens once, and the outputs a
tensor that grows by the tokens appended since the last step.

The entry of a request lives exactly as long as the ``Request`` object (a weak reference
drops it when the request is collected), so a finished request leaves nothing behind. A
preempted request keeps its entry: recompute changes neither its prompt nor its outputs.
Each step the entry is checked against the request before use (the prompt list is the same
object of the same length; the cached outputs are still the first outputs, compared token by
token), and rebuilt when not: outputs taken back and replaced (a rejected speculation) are
found. Forked sequences (n > 1) are distinct ``Request`` objects with entries of their own.
"""

from __future__ import annotations

import weakref

import torch

from loraplex.server.engine.request import Request


class _Entry:
    __slots__ = ("prompt_list", "prompt_len", "prompt", "outputs_list", "outputs")

    def __init__(self, req: Request) -> None:
        self.prompt_list = req.prompt_token_ids
        self.prompt_len = len(req.prompt_token_ids)
        # Distinct tokens: a penalty applies once per token, however often it occurs.
        self.prompt = torch.tensor(req.prompt_token_ids, dtype=torch.int64).unique()
        self.outputs_list: list[int] = []
        self.outputs = torch.empty(0, dtype=torch.int64)

    def valid(self, req: Request) -> bool:
        return req.prompt_token_ids is self.prompt_list and len(req.prompt_token_ids) == \
            self.prompt_len

    def update(self, outputs: list[int]) -> None:
        n = len(self.outputs_list)
        if len(outputs) < n or outputs[:n] != self.outputs_list:
            n = 0  # outputs taken back: rebuild them
            self.outputs_list = []
        if len(outputs) > n:
            new = outputs[n:]
            self.outputs_list.extend(new)
            tensor = torch.tensor(new, dtype=torch.int64)
            self.outputs = tensor if n == 0 else torch.cat([self.outputs[:n], tensor])
        elif n == 0:
            self.outputs = torch.empty(0, dtype=torch.int64)


_ENTRIES: dict[int, tuple[weakref.ref[Request], _Entry]] = {}


def _entry(req: Request) -> _Entry:
    key = id(req)
    found = _ENTRIES.get(key)
    if found is not None and found[0]() is req and found[1].valid(req):
        entry = found[1]
    else:
        entry = _Entry(req)
        if found is None or found[0]() is not req:
            weakref.finalize(req, _ENTRIES.pop, key, None)
        _ENTRIES[key] = (weakref.ref(req), entry)
    entry.update(req.output_token_ids)
    return entry


def seen_tokens(req: Request) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt, outputs)`` int64 CPU tensors: the prompt's distinct tokens and the output
    tokens in order (together every token the request has seen, some twice)."""
    entry = _entry(req)
    return entry.prompt, entry.outputs


def output_tokens(req: Request) -> torch.Tensor:
    """The request's output tokens in order, an int64 CPU tensor."""
    return _entry(req).outputs


def num_cached() -> int:
    """How many requests have an entry (for tests: finished requests leave none)."""
    return len(_ENTRIES)
