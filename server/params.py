"""What a generation request asks for, shared by both sides of the wire and free of torch:
the client, the gateway and the engine all import these (``engine/request.py`` re-exports
``SamplingParams`` and ``TokenLogprob``, so ``loraplex.server.client`` never loads the
engine)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from loraplex.server.quote import quote

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20
# The sampler divides float32 logits by the temperature, whatever the serving dtype (logits are
# cast to float32 first). At 1e-2 a logit overflows float32 only beyond 3.4e36, far past what
# finite fp16/bf16/fp32 activations give a working model, while 1e-300 turns any logit into
# inf; below 1e-2 sampling is greedy in effect anyway (vLLM clamps at the same bound).
MIN_TEMPERATURE = 1e-2
MAX_LOGIT_BIAS_TOKENS = 300  # OpenAI's bounds for logit_bias: 300 tokens, biases in [-100, 100]
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty in [-2, 2], as OpenAI bounds them
MAX_REPETITION_PENALTY = 10.0
MAX_N = 64  # parallel samples of one request, at most (the gateway's max_n may bound lower)
# Bounds of a structured-output constraint, checked wherever one is built (the gateway first):
# a grammar's compile time and memory grow with its size, and xgrammar recurses on nesting.
MAX_GRAMMAR_BYTES = 64 << 10
MAX_SCHEMA_DEPTH = 32
MAX_CHOICES = 256
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output, compiled against the tokenizer's vocabulary.

    Attributes:
        kind: ``json_schema`` (``value`` is the schema as JSON text), ``json_object`` (any
            JSON object; no ``value``), ``regex`` (``value`` must match the whole output),
            ``choice`` (the output is one of ``choices``) or ``grammar`` (``value`` is an EBNF
            grammar in xgrammar's GBNF dialect, rooted at ``root``).
        value: the schema, regex or grammar text.
        choices: the strings of ``choice``.

    Raises:
        ValueError: naming ``structured`` and the problem (unknown kind, over the size or
            nesting bounds, a schema that is not a JSON object).
    """

    kind: str
    value: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured: kind {quote(self.kind)} is not one of "
                             f"{', '.join(STRUCTURED_KINDS)}")
        size = len(self.value.encode("utf-8", "surrogatepass")) + sum(
            len(c.encode("utf-8", "surrogatepass")) for c in self.choices)
        if size > MAX_GRAMMAR_BYTES:
            raise ValueError(f"structured.{self.kind}: {size} bytes, over the limit of "
                             f"{MAX_GRAMMAR_BYTES}")
        if self.kind == "choice":
            if not 1 <= len(self.choices) <= MAX_CHOICES or not all(self.choices):
                raise ValueError(f"structured.choice: 1..{MAX_CHOICES} non-empty strings")
        elif self.choices:
            raise ValueError(f"structured.{self.kind}: takes no choices")
        if self.kind in ("regex", "grammar") and not self.value:
            raise ValueError(f"structured.{self.kind}: must not be empty")
        if self.kind in ("json_object", "choice") and self.value:
            raise ValueError(f"structured.{self.kind}: takes no value")
        if self.kind == "json_schema":
            _check_schema(self.value)

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """What identifies the compiled grammar (the compile cache's key beside the
        tokenizer)."""
        return (self.kind, self.value, self.choices)


def _check_schema(text: str) -> None:
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"structured.json_schema: not valid JSON ({str(exc)[:120]})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("structured.json_schema: must be a JSON object (or true/false)")
    # Depth counted over containers, iteratively: a deep schema must not recurse here either.
    stack: list[tuple[object, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"structured.json_schema: nested deeper than {MAX_SCHEMA_DEPTH}")
        children = node.values() if isinstance(node, dict) else node if isinstance(
            node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy; validation raises ``ValueError``
    naming the field.

    Attributes:
        max_tokens: tokens to generate at most.
        temperature: softmax temperature; 0 picks the most likely token, else at least
            ``MIN_TEMPERATURE`` (0.01).
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the smallest set of tokens whose probability reaches p.
        seed: per-request seed; the same seed gives the same tokens alone or in any batch.
        stop_token_ids: tokens that end generation (kept in the output ids, not in the text).
        stop: strings that end generation; removed from the text, matched across tokens.
        ignore_eos: keep generating past the model's end-of-sequence token.
        logprobs: None for no logprobs; n >= 0 returns the chosen token's logprob and the top n.
        min_tokens: EOS and the stop tokens are masked until this many tokens are generated
            (stop strings are matched only from then on, too).
        presence_penalty: subtracted once from the logit of every token already generated
            (OpenAI's definition), in [-2, 2].
        frequency_penalty: subtracted from a token's logit once per time it was generated,
            in [-2, 2].
        repetition_penalty: transformers' definition over prompt and output tokens: a seen
            token's logit is divided by it when positive, multiplied when negative; 1 disables.
        logit_bias: ``(token_id, bias)`` pairs (a dict is accepted) added to the logits;
            at most ``MAX_LOGIT_BIAS_TOKENS``, biases in [-100, 100]. The engine refuses ids
            outside the vocabulary.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely
            token's (after temperature, top-k and top-p); 0 disables.
        n: sequences to sample from the one prompt (1..``MAX_N``): n children of one request
            that share the prompt's KV pages; child ``i`` draws with ``seed + i`` when seeded.
        prompt_logprobs: None for none; n >= 0 returns, for each prompt token after the
            first, its logprob given the tokens before it and the top n (computed during
            prefill; such a request reuses no cached prefix it has not computed itself).
        structured: a constraint on the output (JSON schema, regex, choice, grammar), or None.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    prompt_logprobs: int | None = None
    n: int = 1
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        bias = self.logit_bias
        try:
            pairs = tuple((t, b) for t, b in (bias.items() if isinstance(bias, dict) else bias))
        except (TypeError, ValueError):
            raise ValueError("logit_bias: must map token ids to biases") from None
        object.__setattr__(self, "logit_bias", pairs)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: must be finite and >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature: must be 0 (greedy) or >= {MIN_TEMPERATURE}, got "
                             f"{self.temperature!r} (smaller ones overflow the float32 "
                             "logits the sampler divides)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (isinstance(self.seed, int)
                                          and 0 <= self.seed < 2**63):
            raise ValueError(f"seed: must be an integer in [0, 2^63), got {self.seed!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: must be non-negative integers")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN:
                shown = quote(s) if isinstance(s, str) else type(s).__name__
                raise ValueError(f"stop: each stop string must be 1..{MAX_STOP_STRING_LEN} "
                                 f"characters, got {shown}")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs: must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        self._check_controls()

    def _check_controls(self) -> None:
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: must be an integer in [0, max_tokens "
                             f"{self.max_tokens}], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise ValueError(f"{name}: must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                                 f"got {value!r}")
        rp = self.repetition_penalty
        if not (isinstance(rp, (int, float)) and 0 < rp <= MAX_REPETITION_PENALTY):
            raise ValueError(f"repetition_penalty: must be in (0, {MAX_REPETITION_PENALTY:g}] "
                             f"(1 disables), got {rp!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n: must be an integer in [1, {MAX_N}], got {self.n!r}")
        plp = self.prompt_logprobs
        if plp is not None and not (isinstance(plp, int) and 0 <= plp <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs: must be in [0, {MAX_LOGPROBS}], got "
                             f"{self.prompt_logprobs!r}")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_TOKENS} tokens, got "
                             f"{len(self.logit_bias)}")
        seen: set[int] = set()
        for token, value in self.logit_bias:
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias: token ids must be non-negative integers, got "
                                 f"{token!r}")
            if token in seen:
                raise ValueError(f"logit_bias: token {token} appears twice")
            seen.add(token)
            if not (isinstance(value, (int, float)) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias: the bias of token {token} must be in "
                                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r}")

    @property
    def penalized(self) -> bool:
        """Whether any of the three penalties is on."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class TokenLogprob:
    """The chosen token's logprob and, when asked for, the top-n alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation: ``role`` is one of ``CHAT_ROLES`` (bounded by the gateway
    and the engine, not here, so that a client can send what it likes and get the server's
    ``INVALID_ARGUMENT``)."""

    role: str
    content: str


@dataclass(frozen=True)
class ChatMessages:
    """A chat prompt: the worker renders ``messages`` with the model's chat template and the
    prompt of the assistant's next turn, and stops at the template's end-of-turn token."""

    messages: tuple[ChatMessage, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(self.messages))

    def as_dicts(self) -> list[dict[str, str]]:
        """The ``[{"role": ..., "content": ...}]`` list chat templates take."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


def check_messages(messages: ChatMessages, max_messages: int, max_bytes: int) -> None:
    """Bound a chat prompt: 1..``max_messages`` messages, known roles, at most ``max_bytes``
    bytes of content in all.

    Raises:
        ValueError: naming the field (``messages``, ``messages[i].role``, ...).
    """
    if not messages.messages:
        raise ValueError("messages: must not be empty")
    if len(messages.messages) > max_messages:
        raise ValueError(f"messages: {len(messages.messages)} messages, over the limit of "
                         f"{max_messages}")
    total = 0
    for i, m in enumerate(messages.messages):
        if m.role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role: {quote(m.role)} is not one of "
                             f"{', '.join(CHAT_ROLES)}")
        total += len(m.content.encode("utf-8", "surrogatepass"))
        if total > max_bytes:
            raise ValueError(f"messages[{i}].content: the messages' content passes the limit "
                             f"of {max_bytes} bytes")
