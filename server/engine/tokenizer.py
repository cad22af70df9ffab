"""Tokenizers (Hugging Face ``tokenizer.json``, never remote code) and incremental
detokenization with stop strings matched across token boundaries."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from loraplex.server.engine.request import Request

# Tokens decoded before the new ones, so that merges and leading spaces decode as in context.
_CONTEXT_TOKENS = 5


class Tokenizer:
    """A thin wrapper over a Hugging Face fast tokenizer, safe to use from any thread.

    Each thread gets its own instance, loaded from ``path`` on its first use: a fast
    tokenizer's Rust object raises "Already borrowed" when one thread changes its settings
    (transformers does, on a call whose truncation or padding differs from the loaded ones)
    while another encodes or decodes, and the worker encodes prompts on the asyncio thread
    while the engine thread decodes outputs.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._local = threading.local()
        self.eos_token_id: int | None = self.for_this_thread().eos_token_id

    def for_this_thread(self) -> Any:
        """This thread's tokenizer (loaded now if the thread never used one)."""
        tok = getattr(self._local, "tok", None)
        if tok is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.path, trust_remote_code=False)
            self._local.tok = tok
        return tok

    def encode(self, text: str) -> list[int]:
        return list(self.for_this_thread()(text)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return str(self.for_this_thread().decode(token_ids, skip_special_tokens=True))


class Detokenizer:
    """Turns a request's output tokens into text deltas, holding back any tail that could
    still become a stop string so that a stop string is never streamed."""

    def __init__(self, tokenizer: Tokenizer, request: Request) -> None:
        self.tokenizer = tokenizer
        self.stops = request.params.stop
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._ids = list(request.prompt_token_ids)
        self._num_prompt_ids = len(self._ids)
        self._min_tokens = request.params.min_tokens
        self._prefix_offset = max(len(self._ids) - _CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        self.text = ""  # all output text so far (truncated at a stop string)
        self._emitted = 0

    def add(self, token_id: int, finished: bool) -> tuple[str, bool]:
        """Append one token. Returns (text now safe to emit, whether a stop string matched);
        stop strings match only from the request's ``min_tokens``-th token on."""
        self._ids.append(token_id)
        match_stops = len(self._ids) - self._num_prompt_ids >= self._min_tokens
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        full = self.tokenizer.decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            search_from = max(len(self.text) - self._hold, 0)
            self.text += delta
            for stop in self.stops if match_stops else ():
                at = self.text.find(stop, search_from)
                if at >= 0:
                    self.text = self.text[:at]
                    return self._flush(), True
        return (self._flush() if finished else self._emit()), False

    def finish(self) -> str:
        """All held-back text, at the end of the request."""
        return self._flush()

    def _emit(self) -> str:
        upto = max(len(self.text) - self._hold, self._emitted)
        out = self.text[self._emitted:upto]
        self._emitted = upto
        return out

    def _flush(self) -> str:
        out = self.text[self._emitted:]
        self._emitted = len(self.text)
        return out
