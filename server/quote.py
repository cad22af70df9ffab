"""Quoting what a client sent inside an error message, at most a short prefix of it.

An error message travels back as the ``grpc-message`` trailer: a field echoed whole (a 10k
character stop string) can push it over the metadata limit, and the client then reads
``RESOURCE_EXHAUSTED`` instead of the refusal. Every message that names a client's value goes
through :func:`quote`; ``wire/services.py`` also caps whole messages at ``MAX_MESSAGE_CHARS``.
"""

from __future__ import annotations

MAX_QUOTED_CHARS = 48
MAX_MESSAGE_CHARS = 1024


def quote(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters of the value, with its full length when
    cut: ``'aaaa...' (10000 characters)``."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{value[:limit]!r}... ({len(value)} {unit})"
    text = repr(value)
    return text if len(text) <= limit + 2 else f"{text[:limit]}... ({len(text)} characters)"


def cap_message(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """A status message no longer than ``limit`` characters (a last guard; quote values)."""
    return message if len(message) <= limit else f"{message[:limit]}... (cut)"
