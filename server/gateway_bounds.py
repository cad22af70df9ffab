"""What the gateway refuses before a request goes to a worker: the bounds of its fields that
need no tokenizer (``check_bounds``), and of a ``/tokenize`` or ``/detokenize`` prompt
(``check_tokenize_bounds``). Each raises ``ServiceError`` INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc

from loraplex.server.api import ChatMessages, GenerateRequest, ServiceError, TokenizeRequest
from loraplex.server.config import GatewayConfig
from loraplex.server.params import check_messages

MAX_STOP_TOKEN_IDS = 64
MAX_CHAT_MESSAGES = 512
MAX_REQUEST_ID_CHARS = 128
MAX_ADAPTER_REF_CHARS = 160


def check_bounds(request: GenerateRequest, config: GatewayConfig) -> None:
    """Refuse a request whose fields are out of bounds (what needs no tokenizer; the engine's
    ``SamplingParams``, built from the message, already bounds stop strings, logprobs and
    the sampling controls; unknown token ids in ``logit_bias`` are the worker's to refuse).

    Raises:
        ServiceError: INVALID_ARGUMENT naming the field.
    """
    def bad(message: str) -> ServiceError:
        return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)

    prompt = request.prompt
    if isinstance(prompt, ChatMessages):
        try:
            check_messages(prompt, MAX_CHAT_MESSAGES, config.max_prompt_bytes)
        except ValueError as exc:
            raise bad(str(exc)) from None
    elif isinstance(prompt, str):
        size = len(prompt.encode("utf-8", "surrogatepass"))
        if size == 0:
            raise bad("prompt: must not be empty")
        if size > config.max_prompt_bytes:
            raise bad(f"prompt: {size} bytes, over the limit of {config.max_prompt_bytes}")
    else:
        if not prompt:
            raise bad("prompt: must not be empty")
        if len(prompt) > config.max_prompt_tokens:
            raise bad(f"prompt: {len(prompt)} token ids, over the limit of "
                      f"{config.max_prompt_tokens}")
    params = request.params
    if params.max_tokens > config.max_tokens_limit:
        raise bad(f"max_tokens: {params.max_tokens}, over the limit of "
                  f"{config.max_tokens_limit}")
    if params.n > config.max_n:
        raise bad(f"n: {params.n}, over the limit of {config.max_n}")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}")
    if len(request.request_id) > MAX_REQUEST_ID_CHARS or not request.request_id.isprintable():
        raise bad(f"request_id: at most {MAX_REQUEST_ID_CHARS} printable characters")
    if len(request.adapter) > MAX_ADAPTER_REF_CHARS:
        raise bad(f"adapter: at most {MAX_ADAPTER_REF_CHARS} characters")


def check_tokenize_bounds(request: TokenizeRequest, config: GatewayConfig) -> None:
    """A generation prompt's bounds, an empty text or token list allowed (``/tokenize`` of
    "" is ``[]``). Raises ``ServiceError`` INVALID_ARGUMENT naming the field."""
    prompt = request.prompt
    if isinstance(prompt, str) and prompt:
        check_bounds(GenerateRequest(prompt=prompt), config)
    elif isinstance(prompt, ChatMessages):
        check_bounds(GenerateRequest(prompt=prompt), config)
    elif isinstance(prompt, tuple) and len(prompt) > config.max_prompt_tokens:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"token_ids: {len(prompt)}, over the limit of "
                           f"{config.max_prompt_tokens}")
