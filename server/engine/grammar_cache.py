"""What structured output keeps beside its matchers: the compile cache (bounded in bytes) and
the grammar text and error helpers (schema rewrites for xgrammar 0.2.8, choice grammars, the
messages a failed request gets). No xgrammar state lives here; ``structured.py`` uses these."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from loraplex.server.params import StructuredOutput

_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class GrammarCache:
    """Compiled grammars by key, least recently used first out, bounded in bytes (thread-safe:
    compile threads insert, ``submit`` reads)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, Any] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple) -> Any | None:
        with self._lock:
            compiled = self._entries.get(key)
            if compiled is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return compiled

    def put(self, key: tuple, compiled: Any) -> None:
        size = int(compiled.memory_size_bytes)
        with self._lock:
            if key in self._entries or size > self.max_bytes:
                return
            self._entries[key] = compiled
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= int(old.memory_size_bytes)

    @property
    def num_bytes(self) -> int:
        return self._bytes


def bounded_strings_as_patterns(schema: Any) -> Any:
    """``schema`` with each length-bounded string (``minLength`` / ``maxLength``, no pattern or
    format) turned into the same bounds on a pattern of unescaped JSON string characters.

    xgrammar 0.2.8 compiles a length-bounded string to ``[^"\\\r\n]{0,n}``, which lets raw
    control characters (invalid in JSON) through, and its negated classes admit UTF-8-encoded
    surrogates (which decode to three U+FFFD, breaking the length); the pattern excludes both.
    """
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_strings_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if (out.get("type") == "string" and bounded
            and not {"pattern", "format", "enum", "const"} & out.keys()):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = rf'^[^"\\\x00-\x1f\ud800-\udfff]{{{low},{high}}}$'
    return out


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices``."""
    # JSON string literals are EBNF string literals: quotes, backslashes and control
    # characters escaped, everything else (non-ASCII included) as is.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def no_token_error(spec: StructuredOutput) -> str:
    """The error of a request whose grammar allows no token (it can never be satisfied)."""
    return (f"structured.{spec.kind}: no token can continue the output (the constraint cannot "
            "be satisfied with this model's vocabulary)")


def timeout_error(spec: StructuredOutput, elapsed: float, timeout: float) -> str:
    """The error of a request whose grammar compiled past ``grammar_compile_timeout``."""
    return (f"structured.{spec.kind}: compiling took {elapsed:.3f} s, over the limit of "
            f"{timeout:g} s (grammar_compile_timeout)")


def first_line(exc: BaseException) -> str:
    """An xgrammar exception's first line, without its time and source prefix (300 chars)."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    # xgrammar prefixes its messages with a time and a C++ source location.
    return _XGR_PREFIX.sub("", line)[:300]
