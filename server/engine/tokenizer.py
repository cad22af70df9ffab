"""Tokenizers (Hugging Face ``tokenizer.json``, never remote code), chat templates, and
incremental detokenization with stop strings matched across token boundaries."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loraplex.server.engine.request import Request
from loraplex.server.params import CHAT_ROLES, ChatMessages

logger = logging.getLogger(__name__)

# Tokens decoded before the new ones, so that merges and leading spaces decode as in context.
_CONTEXT_TOKENS = 5
# Any of these makes a model folder's tokenizer loadable; without them the model serves
# token-id prompts only (transformers would fail with "Couldn't instantiate the backend").
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
_SENTINEL = "LORAPLEXENDOFTURNPROBE"


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The model folder's tokenizer, or None when it has no tokenizer files."""
    if not any((Path(path) / name).exists() for name in TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files (%s): serving token-id prompts only", path,
                       ", ".join(TOKENIZER_FILES))
        return None
    return Tokenizer(path)


class Tokenizer:
    """A thin wrapper over a Hugging Face fast tokenizer, safe to use from any thread.

    Each thread gets its own instance, loaded from ``path`` on its first use: a fast
    tokenizer's Rust object raises "Already borrowed" when one thread changes its settings
    (transformers does, on a call whose truncation or padding differs from the loaded ones)
    while another encodes or decodes, and the worker encodes prompts on the asyncio thread
    while the engine thread decodes outputs.

    Attributes:
        eos_token_id: the tokenizer's end-of-sequence token (None: none).
        has_chat_template: whether ``apply_chat_template`` can render messages.
        end_of_turn_id: the token the chat template closes each turn with (``<|im_end|>`` for
            ChatML), which ends a chat request's generation; None when there is none or it
            is not a single special token.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._local = threading.local()
        tok = self.for_this_thread()
        self._backend_decode = _plain_fast_decode(tok)
        self.eos_token_id: int | None = tok.eos_token_id
        self.has_chat_template = bool(getattr(tok, "chat_template", None))
        self.end_of_turn_id = self._end_of_turn_id() if self.has_chat_template else None

    def for_this_thread(self) -> Any:
        """This thread's tokenizer (loaded now if the thread never used one)."""
        tok = getattr(self._local, "tok", None)
        if tok is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.path, trust_remote_code=False)
            self._local.tok = tok
        return tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.for_this_thread()(text, add_special_tokens=add_special_tokens)
                    ["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        tok = self.for_this_thread()
        if self._backend_decode:  # the Rust decode transformers' decode would call, without
            # its per-call Python (1.8 against 3.8 us for a detokenizer's few tokens)
            return str(tok.backend_tokenizer.decode(token_ids,
                                                    skip_special_tokens=skip_special_tokens))
        return str(tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each token's string in the vocabulary (byte-level BPE's ``Ġ`` for a space), as
        vLLM's ``/tokenize`` returns them; a string no wire can carry (a lone surrogate)
        has it replaced."""
        out = self.for_this_thread().convert_ids_to_tokens(token_ids)
        return [str(t).encode("utf-8", "replace").decode("utf-8") if t is not None else ""
                for t in out]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of ``messages`` rendered by the model's chat template, followed by
        the prompt of the assistant's turn.

        Raises:
            ValueError: the model has no chat template, or the template refuses the messages.
        """
        if not self.has_chat_template:
            raise ValueError("messages: this model has no chat template; send text or "
                             "token_ids")
        try:
            out: Any = self.for_this_thread().apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # the template's own checks (jinja2 raise_exception, ...)
            raise ValueError(f"messages: the chat template refused them: {exc}") from None
        if isinstance(out, Mapping) or hasattr(out, "input_ids"):
            out = out["input_ids"]  # newer transformers return a BatchEncoding
        return [int(t) for t in out]

    def _end_of_turn_id(self) -> int | None:
        # Render a finished assistant turn and read the first token after its content: the
        # template's end-of-turn marker, if it is one special token.
        tok = self.for_this_thread()
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
        try:
            text = str(tok.apply_chat_template(turns, tokenize=False))
        except Exception:  # a template that refuses this shape: no end-of-turn stop
            logger.warning("could not probe the chat template's end-of-turn token")
            return None
        at = text.find(_SENTINEL)
        if at < 0:
            return None
        ids = tok(text[at + len(_SENTINEL):], add_special_tokens=False)["input_ids"]
        special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
        return int(ids[0]) if ids and ids[0] in special else None


def _plain_fast_decode(tok: Any) -> bool:
    """Whether ``tok.decode(ids, skip_special_tokens=True)`` is exactly its backend's decode:
    a fast tokenizer whose class keeps transformers' own ``decode`` and ``_decode`` (which
    only convert the ids and call the backend) and does not clean up tokenization spaces."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return False
    cls = type(tok)
    return (isinstance(tok, PreTrainedTokenizerFast)
            and getattr(tok, "backend_tokenizer", None) is not None
            and not getattr(tok, "clean_up_tokenization_spaces", True)
            and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode)


class Detokenizer:
    """Turns a request's output tokens into text deltas, holding back any tail that could
    still become a stop string so that a stop string is never streamed."""

    def __init__(self, tokenizer: Tokenizer | None, request: Request) -> None:
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
        # The state before the last ``add`` (ids, offsets, text, emitted), for ``take_back``.
        self._before_last: tuple[int, int, int, str, int] | None = None

    def add(self, token_id: int, finished: bool) -> tuple[str, bool]:
        """Append one token. Returns (text now safe to emit, whether a stop string matched);
        without a tokenizer the text is always empty; stop strings match only from the
        request's ``min_tokens``-th token on."""
        self._before_last = (len(self._ids), self._prefix_offset, self._read_offset, self.text,
                             self._emitted)
        self._ids.append(token_id)
        if self.tokenizer is None:
            return "", False
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

    def last_emitted(self) -> str | None:
        """The text the last ``add`` returned (None: nothing to take back)."""
        if self._before_last is None:
            return None
        return self.text[self._before_last[4]:self._emitted]

    def take_back(self) -> str:
        """Undo the last ``add`` (once): its token leaves and the state is as before it, so
        the next ``add`` decodes as if it had never come (string jump-forward re-cuts it with
        the forced string). Only for a token whose text the client has not been sent.

        Returns:
            The text that ``add`` returned, which the caller removes from its unsent output.

        Raises:
            ValueError: no ``add`` to undo (none yet, or it was taken back already).
        """
        taken = self.last_emitted()
        if taken is None or self._before_last is None:
            raise ValueError("detokenizer: no token to take back")
        num_ids, self._prefix_offset, self._read_offset, self.text, self._emitted = (
            self._before_last)
        del self._ids[num_ids:]
        self._before_last = None
        return taken

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


def prompt_token_ids(tokenizer: Tokenizer | None, prompt: str | Sequence[int] | ChatMessages,
                     add_special_tokens: bool = True) -> list[int]:
    """A prompt's token ids as a request's are made (any thread): text encoded (with the
    tokenizer's special tokens unless ``add_special_tokens`` is off), messages rendered by the
    chat template with the assistant turn's prompt, token ids as they are.

    Raises:
        ValueError: naming the field (no tokenizer, no template, a bad message).
    """
    if not isinstance(prompt, (str, ChatMessages)):
        return list(prompt)
    if tokenizer is None:
        field_name = "messages" if isinstance(prompt, ChatMessages) else "prompt"
        raise ValueError(f"{field_name}: this model has no tokenizer; send token_ids")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens)
    if not prompt.messages:
        raise ValueError("messages: must not be empty")
    for i, m in enumerate(prompt.messages):
        if m.role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role: {m.role[:32]!r} is not one of "
                             f"{', '.join(CHAT_ROLES)}")
    return tokenizer.apply_chat_template(prompt.as_dicts())


def token_text(tokenizer: Tokenizer | None, vocab_size: int, token_ids: Sequence[int]) -> str:
    """The text of ``token_ids``, special tokens kept (any thread).

    Raises:
        ValueError: no tokenizer, or an id outside the vocabulary (``token_ids[i]``).
    """
    if tokenizer is None:
        raise ValueError("token_ids: this model has no tokenizer")
    for i, t in enumerate(token_ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"token_ids[{i}]: {t} is outside the vocabulary "
                             f"(0..{vocab_size - 1})")
    return tokenizer.decode(list(token_ids), skip_special_tokens=False)
