"""What clients see of a step: ``OutputProcessor`` turns the tokens the scheduler accepted into
``RequestOutput``s.

The scheduler's ``update`` has already appended each request's accepted tokens and finished
those that stop without looking at text (a stop token, EOS, length, a complete grammar). Here,
outside the engine's core loop, each request's tokens are detokenized incrementally (holding
back any tail that could still become a stop string), a stop string ends the request, exact
jump-forward appends the tokens a grammar forces (through the scheduler's ``accept``, as if
they had been sampled; string mode may first take back this step's last, unsent token to
re-cut it with the forced string), and the step's outputs are built: streaming deltas for running
requests, a final output (finish reason, usage, error) for finished ones, each reported once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import replace

from loraplex.server.engine.batch import TokenUpdate
from loraplex.server.engine.request import Request, RequestOutput, RequestStatus, TokenLogprob
from loraplex.server.engine.sampler import draw_uniform
from loraplex.server.engine.scheduler import Scheduler
from loraplex.server.engine.structured import GrammarService
from loraplex.server.engine.tokenizer import Detokenizer, Tokenizer

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Per-sequence detokenizers and the client's request groups; collects a step's outputs
    (``take``)."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer | None,
                 grammars: GrammarService | None, vocab_size: int, jump_forward: str) -> None:
        """Args:
            scheduler: the engine's scheduler (finishes requests, accepts forced tokens).
            tokenizer: the model's tokenizer, or None (outputs then carry no text).
            grammars: structured output's service, if the model has a tokenizer.
            vocab_size: the model's vocabulary (forced tokens lie in it).
            jump_forward: ``off``, ``token`` (exact) or ``string`` (``EngineConfig``).
        """
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.jump_forward = jump_forward
        self._groups: dict[str, list[Request]] = {}  # by the client's id: its n sequences
        self._detok: dict[str, Detokenizer] = {}  # by each sequence's own id, until reported
        self._outputs: list[RequestOutput] = []

    # -- requests (any thread) ------------------------------------------------------------------
    def add(self, group: list[Request]) -> None:
        """Track the n sequences of one client request (``group[0].output_id``)."""
        for req in group:
            self._detok[req.request_id] = Detokenizer(self.tokenizer, req)
        self._groups[group[0].output_id] = group

    def has(self, request_id: str) -> bool:
        return request_id in self._groups

    def sequences(self, request_id: str) -> tuple[Request, ...]:
        """The n sequences of an unfinished client request (empty once all are reported)."""
        return tuple(self._groups.get(request_id, ()))

    # -- a step's outputs (the engine thread) ---------------------------------------------------
    def take(self) -> list[RequestOutput]:
        """This step's outputs, the siblings that ended with their sequence 0 last."""
        for child in self.scheduler.take_orphans():
            self.finish(child, child.status)
        outputs, self._outputs = self._outputs, []
        return outputs

    def process(self, update: TokenUpdate) -> None:
        """Report what ``update`` appended to a request (then jump forward, if its grammar
        forces the next tokens). Raises whatever detokenizing raises (the caller fails the
        request)."""
        out = self._emit(update)
        req = update.request
        if req.grammar is not None and not out.finished:
            out = self._jump_forward(req, out)
        self._report(out)

    def _emit(self, update: TokenUpdate) -> RequestOutput:
        req = update.request
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        detok = self._detok[req.request_id]
        tokens, lps = update.token_ids, update.logprobs
        status = update.status
        text = ""
        for i, token in enumerate(tokens):
            piece, stopped = detok.add(token, finished=status is not None
                                       and i == len(tokens) - 1)
            text += piece
            if stopped:  # a stop string: the tokens after this one are not output
                status = RequestStatus.FINISHED_STOPPED
                self._drop_tail(req, tokens[i + 1:], lps[i + 1:])
                tokens, lps = tokens[:i + 1], lps[:i + 1]
                break
        logprobs = [lp for lp in lps if lp is not None]
        # The prompt's logprobs are all known once its first token is out: they ride with the
        # first token of sequence 0 (its siblings forked off it with the prompt computed).
        first = req.num_output_tokens == len(tokens)
        prompt_lps = list(req.prompt_logprobs) if first else []
        if status is None:
            return RequestOutput(req.output_id, list(tokens), text, False, index=req.index,
                                 logprobs=logprobs, prompt_logprobs=prompt_lps,
                                 num_prompt_tokens=req.num_prompt_tokens,
                                 num_output_tokens=req.num_output_tokens)
        out = self._final(req, status, text, list(tokens), logprobs)
        out.prompt_logprobs = prompt_lps
        return out

    @staticmethod
    def _drop_tail(req: Request, tokens: list[int], lps: list[TokenLogprob | None]) -> None:
        if tokens:
            del req.output_token_ids[-len(tokens):]
        num_lps = sum(lp is not None for lp in lps)
        if num_lps:
            del req.logprobs[-num_lps:]

    def _jump_forward(self, req: Request, out: RequestOutput) -> RequestOutput:
        """Exact jump-forward: append the tokens ``req``'s grammar forces (one allowed token
        each) without a model call; the scheduler computes them as one chunk next step.

        Identical to sampling them: a one-token mask leaves greedy and sampled rows no other
        choice, and a sampled row's generator draws once per forced token as it would have
        (seeded outputs stay the same). Requests asking for logprobs are not jumped (a forced
        token's logprob needs the model's logits). ``jump_forward = string`` first appends
        the string the grammar forces, as the tokenizer cuts it (valid, not identical),
        re-cut together with the last token where that one is not sent yet (``_recut``)."""
        grammar, service = req.grammar, self.grammars
        if (grammar is None or service is None or self.jump_forward == "off"
                or req.params.logprobs is not None):
            return out
        while not out.finished:
            if self.jump_forward == "string":
                forced = grammar.forced_string(req)
                recut = self._recut(req, forced, out) if forced else None
                if recut is not None:
                    out, tokens = recut
                else:
                    tokens = service.tokenize_forced(forced)
                if tokens:
                    for i, token in enumerate(tokens):
                        if out.finished:
                            break
                        if recut is None or i > 0:  # a re-cut's first replaces a token
                            service.num_jumped_tokens += 1
                        out = self._append_forced(req, token, out)
                    continue
            forced = grammar.forced_token(req, self.vocab_size)
            if forced is None:
                return out
            if not req.params.greedy and req.generator is not None:
                draw_uniform(req.generator)  # as sampling the forced token would have
            service.num_jumped_tokens += 1
            out = self._append_forced(req, forced, out)
        return out

    def _recut(self, req: Request, forced: str, out: RequestOutput
               ) -> tuple[RequestOutput, list[int]] | None:
        """SGLang's boundary for string jump-forward: take back ``req``'s last token and cut
        its text together with ``forced`` as the tokenizer would (``"`` + ``, "k": `` ->
        ``",`` `` "`` ...). Returns ``out`` without that token and its text, and the tokens
        to append in its place; None when the cut keeps the token, or the grammar refuses the
        re-cut: the caller tokenizes ``forced`` alone, as before.

        Invariant: only a token of ``out`` (this step's, not reported: the client never sees
        a token taken back) whose KV is not computed yet (a sampled or jumped token is
        computed next step), so pages, ``num_computed_tokens`` and the prefix cache (full
        computed pages only) are untouched; only the token list changes. Not for requests
        asking for logprobs (never jumped). The sampled row's generator draw is not undone:
        string mode keeps outputs valid, not identical."""
        grammar, service = req.grammar, self.grammars
        detok = self._detok.get(req.request_id)
        if (grammar is None or service is None or detok is None or not out.new_token_ids
                or not req.output_token_ids or req.num_computed_tokens >= req.num_tokens
                or out.new_token_ids[-1] != req.output_token_ids[-1]):
            return None
        taken_text = detok.last_emitted()
        if taken_text is None or not out.new_text.endswith(taken_text):
            return None
        tokens = service.retokenize(req.output_token_ids[-1], forced)
        if tokens is None or not grammar.take_back(req, tokens):
            return None
        req.output_token_ids.pop()
        detok.take_back()
        service.num_retokenized += 1
        text = out.new_text[:len(out.new_text) - len(taken_text)]
        return replace(out, new_token_ids=out.new_token_ids[:-1], new_text=text,
                       num_output_tokens=req.num_output_tokens), tokens

    def jump_at_start(self, waiting: Iterable[Request]) -> None:
        """Jump-forward before a constrained request's first model call (n == 1): what its
        grammar forces at the start (``{"name": "``) is appended now and computed with the
        prompt's prefill. Called before each ``schedule``: ``GrammarState.ready`` waits for
        ``take_start``, so no request slips into its prefill first."""
        for req in list(waiting):
            if req.grammar is None or not req.grammar.take_start(req):
                continue
            try:
                out = self._jump_forward(req, RequestOutput(req.output_id, [], "", False,
                                                            index=req.index))
            except Exception as exc:
                self.fail(req, f"internal error in jump-forward: {exc}")
                continue
            if out.new_token_ids or out.finished:
                self._report(out)

    def _append_forced(self, req: Request, token: int, out: RequestOutput) -> RequestOutput:
        nxt = self._emit(self.scheduler.accept(req, [token], [None]))
        return replace(nxt, new_token_ids=out.new_token_ids + nxt.new_token_ids,
                       new_text=out.new_text + nxt.new_text,
                       logprobs=out.logprobs + nxt.logprobs,
                       prompt_logprobs=out.prompt_logprobs or nxt.prompt_logprobs)

    def fail(self, req: Request, error: str, log: bool = True) -> None:
        """End ``req`` with ``error`` (``FINISHED_ERROR``); the rest of the batch goes on."""
        if log:
            logger.exception("request %s failed: %s", req.request_id, error)
        else:
            logger.warning("request %s failed: %s", req.request_id, error)
        req.error = error
        self.finish(req, RequestStatus.FINISHED_ERROR)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End ``req`` (if it has not ended) and report its final output, once."""
        if req.request_id in self._detok:
            self._report(self._final(req, status, ""))

    def _report(self, out: RequestOutput) -> None:
        self._outputs.append(out)

    def _final(self, req: Request, status: RequestStatus, text: str,
               new_token_ids: list[int] | None = None,
               logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        self.scheduler.finish(req, status)
        # Tolerates a request that a failure caught half-way through finishing.
        detok = self._detok.pop(req.request_id, None)
        if detok is not None and status is RequestStatus.FINISHED_ERROR:
            text = ""
        elif detok is not None and status is not RequestStatus.FINISHED_STOPPED:
            text += detok.finish()
        group = self._groups.get(req.output_id, [])
        if all(r.request_id not in self._detok for r in group):
            self._groups.pop(req.output_id, None)
        return RequestOutput(req.output_id, new_token_ids or [], text, True, index=req.index,
                             finish_reason=status.value, logprobs=logprobs or [],
                             num_prompt_tokens=req.num_prompt_tokens,
                             num_output_tokens=req.num_output_tokens,
                             num_cached_tokens=req.num_cached_tokens, error=req.error,
                             num_draft_tokens=req.spec.num_proposed if req.spec else 0,
                             num_accepted_draft_tokens=req.spec.num_accepted if req.spec
                             else 0)
