"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from loraplex.server.config import EngineConfig, SchedulerConfig
from loraplex.server.engine.engine import STALLED_WAIT_SECONDS, Engine
from loraplex.server.engine.request import SamplingParams, TokenLogprob
from loraplex.server.params import ChatMessages


@dataclass
class Completion:
    """One finished generation."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    num_preemptions: int = 0


class LLM:
    """Run many prompts through one engine, all at once (continuous batching)."""

    def __init__(self, model: str = "demo", engine: Engine | None = None, **kwargs) -> None:
        if engine is None:
            sched_fields = set(SchedulerConfig.__dataclass_fields__)
            sched = SchedulerConfig(**{k: kwargs.pop(k) for k in list(kwargs)
                                       if k in sched_fields})
            engine = Engine(EngineConfig(model=model, scheduler=sched, **kwargs))
        self.engine = engine
        self._ids = itertools.count()

    def generate(self, prompts: Sequence[str | list[int] | ChatMessages],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapters: Sequence[str | None] | None = None) -> list[Completion]:
        """Generate for every prompt; results in prompt order (a prompt with ``n > 1`` gives
        its n completions one after another, by index).

        Args:
            prompts: text, token ids, or chat messages (rendered by the chat template).
            sampling_params: one for all, or one per prompt.
            adapters: adapter digest per prompt (None: the base model).
        """
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError("sampling_params: need one per prompt")
        adapters = list(adapters) if adapters is not None else [None] * len(prompts)
        results: dict[tuple[str, int], Completion] = {}
        order = []
        for prompt, p, adapter in zip(prompts, params, adapters):
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, prompt, p, adapter_digest=adapter)
            for req in self.engine.sequences(rid):
                results[rid, req.index] = Completion(rid, list(req.prompt_token_ids))
                order.append((rid, req))
        while self.engine.has_unfinished():
            outputs = self.engine.step()
            if not outputs and not self.engine.last_step_ran:
                time.sleep(STALLED_WAIT_SECONDS)  # everything waits on other threads
            for out in outputs:
                done = results.get((out.request_id, out.index))
                if done is None:
                    continue
                done.token_ids.extend(out.new_token_ids)
                done.text += out.new_text
                done.logprobs.extend(out.logprobs)
                done.prompt_logprobs.extend(out.prompt_logprobs)
                if out.finished:
                    done.finish_reason = out.finish_reason
                    done.error = out.error
        return [replace(results[rid, req.index], num_preemptions=req.num_preemptions)
                for rid, req in order]
