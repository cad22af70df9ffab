"""The service's ``Completion`` / ``GenerateChunk`` -> OpenAI response objects (JSON dicts).

The gateway has no tokenizer, so a logprob's ``token`` is the token id written as
``"token_id:<id>"`` (vLLM's ``--return-tokens-as-token-ids`` convention) and ``bytes`` is null.
"""

from __future__ import annotations

from typing import Any

from loraplex.server.api import Usage
from loraplex.server.engine.request import TokenLogprob


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def completion_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
    """The legacy completions ``logprobs`` object (no ``text_offset``: no tokenizer here)."""
    if not logprobs:
        return None
    return {"tokens": [token_name(lp.token_id) for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{token_name(t): v for t, v in lp.top} for lp in logprobs]}


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
    if not logprobs:
        return None
    return {"content": [
        {"token": token_name(lp.token_id), "logprob": lp.logprob, "bytes": None,
         "top_logprobs": [{"token": token_name(t), "logprob": v, "bytes": None}
                          for t, v in lp.top]}
        for lp in logprobs], "refusal": None}


def envelope(kind: str, response_id: str, created: int, model: str,
             choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
    """The fields every response and chunk shares (``kind``: ``text_completion``,
    ``chat.completion`` or ``chat.completion.chunk``)."""
    out: dict[str, Any] = {"id": response_id, "object": kind, "created": created,
                           "model": model, "system_fingerprint": None, "choices": choices}
    if usage is not None:
        out["usage"] = usage_json(usage)
    return out


def total_usage(usages: list[Usage]) -> Usage:
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in usages),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=sum(u.cached_tokens for u in usages))
