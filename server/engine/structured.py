"""Structured output: grammars compiled against the tokenizer's vocabulary (xgrammar), a compile
cache bounded in bytes, per-request matchers, and exact jump-forward.

A constrained request goes through four places:

1. ``GrammarService.submit`` (any thread, from ``Engine.add_request``): a cache hit is ready at
   once; a miss compiles on a compile thread, never on the engine thread. Until it is ready the
   scheduler passes the request over (as it does a request whose adapter is loading), so the
   queue behind it moves on. A grammar that fails to compile, or compiles for longer than
   ``grammar_compile_timeout``, gives the request an error starting ``structured.``, which the
   worker answers with ``INVALID_ARGUMENT``.
2. Each step, ``GrammarService.bitmask`` fills the allowed-token bitmask row of every
   constrained request of the batch (free rows allow every token); the sampler applies it for
   any mix of rows.
3. ``GrammarState.accept`` advances the request's matcher with each appended token and says
   when the grammar has terminated (the request then finishes with reason ``stop``). With
   n > 1 each sequence forked off the prompt's first one gets its own state and matcher
   (``GrammarState.fork_for``, from the engine where the sequences fork).
4. Exact jump-forward (``GrammarState.forced_token``): while the grammar allows exactly one
   token, the engine appends it without a model call; the scheduler computes those tokens as
   one prefill chunk next step (and what is forced at the very start, before the request's
   first model call, with its prompt: ``GrammarState.take_start``). The output is token for
   token what decoding one step per token gives, since a mask of one token leaves the
   sampler no choice. String mode
   (``jump_forward = string``) first appends the whole string the grammar forces
   (``GrammarState.forced_string``): where the last output token has not been sent yet, it is
   taken back and re-cut with the forced string as the tokenizer cuts their text together
   (``GrammarService.retokenize``, ``GrammarState.take_back``: SGLang's boundary), else the
   string is tokenized alone (``GrammarService.tokenize_forced``). It jumps where a BPE
   vocabulary offers several first tokens (``{"`` against ``{``), and its tokens may differ
   from the model's own choice, so it is checked for validity, not identity.

The matcher follows ``output_token_ids``: after a preemption (recompute) the request's tokens
are replayed through a fresh matcher, so a request's grammar state never depends on where its
KV came from (prefix cache, recompute).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch
import xgrammar as xgr

from loraplex.server.engine import cpu_threads
from loraplex.server.engine.grammar_cache import (
    GrammarCache,
    bounded_strings_as_patterns,
    choice_grammar,
    first_line,
    no_token_error,
    timeout_error,
)
from loraplex.server.engine.request import Request
from loraplex.server.engine.tokenizer import Tokenizer
from loraplex.server.engine.utf8_filter import START, Utf8Filter
from loraplex.server.params import StructuredOutput

logger = logging.getLogger(__name__)

_COMPILE_THREADS = 2


class GrammarState:
    """One request's grammar: compiling, failed, or compiled with its matcher."""

    def __init__(self, spec: StructuredOutput, timeout: float) -> None:
        self.spec = spec
        self.timeout = timeout
        self.compiled: Any = None
        self.error: str | None = None
        self.compile_started: float | None = None  # set by the compile thread
        self.utf8: Utf8Filter | None = None  # set with ``compiled``
        self._utf8_state = START
        # The UTF-8 state before the last output token (None: unknown, or taken back already).
        self._utf8_prev: int | None = None
        self._matcher: Any = None
        self._num_preemptions = 0
        self._start_taken = False

    @property
    def ready(self) -> bool:
        """Compiled, and its start jump-forward considered (``take_start``, which the engine
        calls before each schedule: a request cannot slip into a prefill between the two):
        the request may be scheduled."""
        return self.compiled is not None and self._start_taken

    def poll(self, now: float) -> str | None:
        """The request's error, if its grammar failed or has compiled for too long."""
        if self.error is None and self.compiled is None and self.compile_started is not None:
            elapsed = now - self.compile_started
            if elapsed > self.timeout:
                self.error = timeout_error(self.spec, elapsed, self.timeout)
        return self.error

    def _matcher_for(self, req: Request) -> Any:
        if self._matcher is None or self._num_preemptions != req.num_preemptions:
            # Recomputed (or first use): replay the request's tokens through a fresh matcher.
            matcher = xgr.GrammarMatcher(self.compiled)
            self._utf8_state, self._utf8_prev = START, None
            for token in req.output_token_ids:
                if not matcher.accept_token(token):
                    raise ValueError(f"structured.{self.spec.kind}: replaying token {token} "
                                     "was refused by the grammar")
                self._utf8_prev = self._utf8_state
                self._advance_utf8(token)
            self._matcher = matcher
            self._num_preemptions = req.num_preemptions
        return self._matcher

    def fill(self, req: Request, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (``[R, ceil(V / 32)]`` int32)."""
        self._matcher_for(req).fill_next_token_bitmask(bitmask, row)
        if self.utf8 is not None:
            bitmask[row] &= self.utf8.masks[self._utf8_state]

    def fill_draft(self, req: Request, draft: Sequence[int], bitmask: torch.Tensor,
                   row: int) -> None:
        """Rows ``row .. row + len(draft)`` of ``bitmask``: the tokens allowed after the known
        tokens, then after each prefix ``x_1 .. x_j`` of a speculative draft (the matcher
        advances through the draft, then rolls back: it ends where it began). From a draft
        token the grammar refuses, or one that completes it, the rows after stay as they
        are (allocated all-allowed): they are never used, since the row before cannot
        produce that token, or the request stops at it."""
        matcher = self._matcher_for(req)
        utf8_state = self._utf8_state
        advanced = 0
        try:
            for j in range(len(draft) + 1):
                self.fill(req, bitmask, row + j)
                if j == len(draft) or not matcher.accept_token(draft[j]):
                    break
                advanced += 1
                self._advance_utf8(draft[j])
                if matcher.is_terminated():
                    break
        finally:
            if advanced:
                matcher.rollback(advanced)
            self._utf8_state = utf8_state

    def accept(self, req: Request, token: int) -> bool:
        """Advance the matcher with ``token`` (just appended to ``req``'s outputs); True when
        the grammar has terminated. Raises ``ValueError`` if the grammar refuses the token."""
        # The matcher already holds every output but this last one, unless it must be rebuilt.
        if self._matcher is None or self._num_preemptions != req.num_preemptions:
            self._matcher_for(req)  # replays the outputs, the new token included
        elif not self._matcher.accept_token(token):
            raise ValueError(f"structured.{self.spec.kind}: token {token} was refused by the "
                             "grammar")
        else:
            self._utf8_prev = self._utf8_state
            self._advance_utf8(token)
        return bool(self._matcher.is_terminated())

    def take_back(self, req: Request, tokens: Sequence[int]) -> bool:
        """String jump-forward's boundary: whether the grammar accepts ``tokens`` in place of
        ``req``'s last output token. If so, the matcher and the UTF-8 state are rolled back
        to before that token (the caller removes it from the outputs and appends ``tokens``
        through ``accept``), once per accepted token; if not, nothing changes.

        Refused too when the last token did not start at a character boundary (its
        re-tokenization would have to reach further back)."""
        matcher = self._matcher_for(req)
        prev = self._utf8_prev
        if prev is None or prev != START or not req.output_token_ids or matcher.is_terminated():
            return False
        last = req.output_token_ids[-1]
        matcher.rollback(1)
        taken = 0
        for token in tokens:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            taken += 1
        if taken:
            matcher.rollback(taken)
        if taken < len(tokens):
            if not matcher.accept_token(last):  # as it was; it accepted ``last`` before
                raise ValueError(f"structured.{self.spec.kind}: token {last} was refused "
                                 "when restored")
            return False
        self._utf8_state, self._utf8_prev = prev, None
        return True

    def _advance_utf8(self, token: int) -> None:
        if self.utf8 is not None:
            self._utf8_state = self.utf8.advance(self._utf8_state, token)

    def take_start(self, req: Request) -> bool:
        """True once, when the grammar is compiled and ``req`` has neither outputs nor computed
        tokens: the engine then jump-forwards what the grammar forces at the start (``{"name":
        "``), which is computed with the prompt's prefill instead of one step per token.
        False for n > 1 (the other sequences fork off sequence 0 with no outputs) and with
        prompt logprobs (they ride with the first token, after the prefill)."""
        if self._start_taken or self.compiled is None:
            return False
        self._start_taken = True
        return (not req.output_token_ids and req.num_computed_tokens == 0
                and req.params.n == 1 and req.params.prompt_logprobs is None)

    def fork_for(self, parent: Request, child: Request) -> GrammarState:
        """The grammar state of ``child``, a sequence forked off ``parent`` (n > 1) with the
        same outputs so far: the same compiled grammar, and its own matcher in the parent's
        state (``GrammarMatcher.fork``, a deep copy), so the n sequences advance apart.

        Raises ``ValueError`` if the parent's grammar is not compiled (children fork only
        after their parent was scheduled, so it is)."""
        if self.compiled is None:
            raise ValueError(f"structured.{self.spec.kind}: forking a sequence before its "
                             "grammar is compiled")
        state = GrammarState(self.spec, self.timeout)
        state.utf8, state.compiled = self.utf8, self.compiled
        state._start_taken = True  # it starts from sequence 0's outputs
        if (self._matcher is not None and self._num_preemptions == parent.num_preemptions
                and child.output_token_ids == parent.output_token_ids):
            state._matcher, state._utf8_state = self._matcher.fork(), self._utf8_state
            state._utf8_prev = self._utf8_prev
            state._num_preemptions = child.num_preemptions
        # Otherwise the child's first use replays its own outputs through a fresh matcher.
        return state

    def forced_string(self, req: Request) -> str:
        """The text the grammar forces next ("" when the next character is free)."""
        return str(self._matcher_for(req).find_jump_forward_string())

    def forced_token(self, req: Request, vocab_size: int) -> int | None:
        """The one token the grammar allows next, or None when it allows several (or none)."""
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)]
        self.fill(req, bitmask, 0)
        return single_token(bitmask[0], vocab_size)


def single_token(row: torch.Tensor, vocab_size: int) -> int | None:
    """The one token a packed row (``[ceil(V / 32)]`` int32) allows, or None when it allows
    several or none; bits past ``vocab_size`` do not count. Reads the nonzero words only,
    without unpacking the row to ``[V]`` bool each step."""
    words = torch.nonzero(row).flatten().tolist()
    tokens: list[int] = []
    for w in words:
        word = int(row[w]) & 0xFFFFFFFF
        while word and len(tokens) < 2:
            low = word & -word  # the lowest set bit
            token = 32 * w + low.bit_length() - 1
            if token < vocab_size:
                tokens.append(token)
            word ^= low
        if len(tokens) > 1:
            return None
    return tokens[0] if tokens else None


class GrammarService:
    """Compiles requests' constraints off the engine thread and fills their bitmask rows.

    Args:
        tokenizer: the engine's tokenizer (its Hugging Face tokenizer gives the vocabulary).
        vocab_size: the model's vocabulary (logit rows; may exceed the tokenizer's).
        stop_token_ids: tokens that end generation, which a complete grammar allows.
        timeout: ``grammar_compile_timeout`` in seconds (0: every compile fails, cache hits
            pass).
        cache_bytes: bound of the compile cache.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 timeout: float, cache_bytes: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.timeout = timeout
        self.cache = GrammarCache(cache_bytes)
        self._compiler: Any = None
        self.utf8: Utf8Filter | None = None  # built with the compiler
        self._compiler_lock = threading.Lock()
        self._inflight: dict[tuple, list[GrammarState]] = {}
        self._inflight_lock = threading.Lock()
        self._executor = cpu_threads.confined_executor(_COMPILE_THREADS, "grammar")
        # Read the vocabulary now, in the background: the first constrained request then
        # waits for its grammar only.
        self._executor.submit(self._warm).add_done_callback(_log_unexpected)
        self.num_compiles = 0
        self.num_compile_failures = 0
        self.num_jumped_tokens = 0
        self.num_retokenized = 0  # string jump-forward boundaries re-cut with the last token

    def submit(self, spec: StructuredOutput) -> GrammarState:
        """A request's grammar state: ready now on a cache hit, else compiling (any thread)."""
        state = GrammarState(spec, self.timeout)
        compiled = self.cache.get(spec.key)
        if compiled is not None:
            state.utf8, state.compiled = self.utf8, compiled
            return state
        with self._inflight_lock:
            waiters = self._inflight.get(spec.key)
            if waiters is not None:  # the same grammar is compiling: share its result
                waiters.append(state)
                return state
            self._inflight[spec.key] = [state]
        future: Future[None] = self._executor.submit(self._compile, spec)
        future.add_done_callback(_log_unexpected)
        return state

    def _warm(self) -> None:
        try:
            self._get_compiler()
        except Exception:  # each constrained request will then fail with the reason
            logger.exception("xgrammar cannot read this model's tokenizer")

    def _compile(self, spec: StructuredOutput) -> None:
        compiled, error, compiler = None, None, None
        try:
            compiler = self._get_compiler()  # the vocabulary's reading is not the grammar's time
        except Exception as exc:
            error = (f"structured.{spec.kind}: this model's tokenizer cannot be read by "
                     f"xgrammar: {first_line(exc)}")
        started = time.monotonic()
        with self._inflight_lock:
            for state in self._inflight.get(spec.key, []):
                state.compile_started = started
        try:
            if compiler is not None:
                compiled = self._compile_spec(compiler, spec)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError for bad grammars
            error = f"structured.{spec.kind}: does not compile: {first_line(exc)}"
        elapsed = time.monotonic() - started
        if error is None and elapsed > self.timeout:
            error, compiled = timeout_error(spec, elapsed, self.timeout), None
        if compiled is not None:
            self.cache.put(spec.key, compiled)
        with self._inflight_lock:
            self.num_compiles += 1
            self.num_compile_failures += error is not None
            for state in self._inflight.pop(spec.key, []):
                # ``compiled`` last: once it is set the engine thread may use the state.
                state.error, state.utf8, state.compiled = error, self.utf8, compiled

    def _compile_spec(self, compiler: Any, spec: StructuredOutput) -> Any:
        if spec.kind == "json_schema":
            schema = bounded_strings_as_patterns(json.loads(spec.value))
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            return compiler.compile_grammar(choice_grammar(spec.choices))
        return compiler.compile_grammar(spec.value)

    def _get_compiler(self) -> Any:
        # Built on the first compile, on a compile thread: reading a large vocabulary takes a
        # while, and the engine serves free requests meanwhile.
        with self._compiler_lock:
            if self._compiler is None:
                hf = self.tokenizer.for_this_thread()
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
                special = {*info.special_token_ids, *getattr(hf, "all_special_ids", ()),
                           *getattr(hf, "added_tokens_decoder", {})}
                self.utf8 = Utf8Filter(info.decoded_vocab, self.stop_token_ids,
                                       sorted(special))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def tokenize_forced(self, text: str) -> list[int] | None:
        """String jump-forward: ``text`` as the tokenizer cuts it alone, or None when those
        tokens do not spell exactly ``text`` (a tokenizer that adds a prefix space or
        normalizes): the caller then jumps token by token."""
        if self.utf8 is None or not text:
            return None
        ids = list(self.tokenizer.for_this_thread().encode(text, add_special_tokens=False))
        vocab = self.utf8.token_bytes
        if not ids or any(not 0 <= t < len(vocab) or t in self.utf8.special for t in ids):
            return None
        return ids if b"".join(vocab[t] for t in ids) == text.encode() else None

    def retokenize(self, last: int, forced: str) -> list[int] | None:
        """String jump-forward at the boundary, as SGLang does: the text of ``last`` (the
        request's last output token) and ``forced`` as the tokenizer cuts them together
        (``"`` then ``, "key": "`` becomes ``",`` `` "`` ...), when that cut does not keep
        ``last`` whole. None when it does, or when ``last`` is no text of its own (a special
        token, part of a character): the caller then cuts ``forced`` alone."""
        utf8 = self.utf8
        if (utf8 is None or not forced or not 0 <= last < len(utf8.token_bytes)
                or last in utf8.special or last in utf8.stop):
            return None
        try:
            head = utf8.token_bytes[last].decode("utf-8")
        except UnicodeDecodeError:
            return None
        ids = self.tokenize_forced(head + forced) if head else None
        return ids if ids is not None and ids[0] != last else None

    def bitmask(self, requests: Sequence[Request]
                ) -> tuple[torch.Tensor | None, dict[int, str]]:
        """The batch's ``[R, ceil(V / 32)]`` int32 bitmask (row ``i`` for ``requests[i]``; None
        when no request is constrained), and the error of each row that allows no token: its
        grammar can go no further, or filling its row failed. Such a row allows nothing, so
        the sampler reports it failed and its request fails alone."""
        # A request verifying a draft owns 1 + d adjacent rows: its first fills them all.
        grammars = [(i, r, r.grammar) for i, r in enumerate(requests) if r.grammar is not None
                    and (i == 0 or requests[i - 1] is not r)]
        if not grammars:
            return None, {}
        bitmask = xgr.allocate_token_bitmask(len(requests), self.vocab_size)  # all allowed
        errors: dict[int, str] = {}
        for i, req, grammar in grammars:
            try:
                if req.draft_token_ids:
                    grammar.fill_draft(req, req.draft_token_ids, bitmask, i)
                else:
                    grammar.fill(req, bitmask, i)
            except Exception as exc:  # one request's matcher: that request fails, not the batch
                logger.exception("request %s: filling its token mask failed", req.request_id)
                bitmask[i] = 0
                errors[i] = f"internal error in structured output: {exc}"
                continue
            if not bool(bitmask[i].any()):
                errors[i] = no_token_error(grammar.spec)
        return bitmask, errors

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _log_unexpected(future: Future[None]) -> None:
    exc = future.exception() if not future.cancelled() else None
    if exc is not None:
        logger.error("grammar compile thread failed", exc_info=exc)
