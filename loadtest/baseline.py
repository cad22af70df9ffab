"""The baseline loraplex is measured against: transformers ``generate`` on the same requests.

Requests run in static batches of ``batch_size`` (left padding with an attention mask, greedy,
EOS ignored through ``min_new_tokens``), the way a team without a serving engine would run a
Hugging Face model. A streamer timestamps every generated token, so the same figures come out
as for loraplex: per-request tokens, time to first token, inter-token gaps, and the split of
each batch's time into prefill and decode.

How the requests are grouped into batches is one function (``static_batches``), so that other
policies (grouped by adapter, dynamic batching over a trace's arrivals) can sit beside it.

With adapters (``PeftBaseline``), transformers + peft serve a load-test trace the way a team
without a serving engine would (``serve_trace``): dynamic batching over the trace's arrivals,
up to 16 requests gathered for at most 50 ms after the oldest one arrived, and either mixed
batches (peft's ``adapter_names``, one adapter per row) or batches grouped by adapter (that
adapter set active). Adapters load on first use, least recently used ones are unloaded beyond
``max_loaded_adapters``, and the load time counts against the requests that wait for it.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer


@dataclass(frozen=True)
class BaselineRequest:
    """One request, as both systems see it: token ids in, ``max_tokens`` greedy tokens out.

    ``adapter`` (a ``PeftBaseline`` adapter name, ``""`` for the base model) and
    ``arrival_time`` (seconds after the start of ``serve_trace``) matter for traces only.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    adapter: str = ""
    arrival_time: float = 0.0


@dataclass
class BaselineResult:
    """One request's output and timings (seconds on ``time.perf_counter``'s clock).

    Attributes:
        token_ids: the generated tokens (``max_tokens`` of them; EOS is not a stop).
        start_time: when its batch began.
        token_times: when each token reached the host; ``token_times[0]`` is the first token.
    """

    request_id: str
    token_ids: list[int]
    start_time: float
    token_times: list[float]

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start_time

    @property
    def finish_time(self) -> float:
        return self.token_times[-1]


@dataclass(frozen=True)
class BatchTiming:
    """One ``generate`` call: ``prefill_s`` up to the first token, ``decode_s`` after it, and
    the same in CPU seconds of this process (which other jobs on the machine inflate less)."""

    num_requests: int
    num_prompt_tokens: int  # real tokens, padding excluded
    padded_len: int
    num_steps: int  # tokens generated per request (1 prefill step + num_steps - 1 decodes)
    prefill_s: float
    decode_s: float
    prefill_cpu_s: float = 0.0
    decode_cpu_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Batch decode throughput: tokens after the first over the time after the first."""
        if self.num_steps < 2 or self.decode_s <= 0:
            return 0.0
        return self.num_requests * (self.num_steps - 1) / self.decode_s

    @property
    def decode_tokens_per_cpu_s(self) -> float:
        if self.num_steps < 2 or self.decode_cpu_s <= 0:
            return 0.0
        return self.num_requests * (self.num_steps - 1) / self.decode_cpu_s


@dataclass
class BaselineRun:
    """Everything one ``run`` produced, in request order."""

    results: list[BaselineResult]
    batches: list[BatchTiming] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def num_output_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.results)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 else 0.0


class _StepClock(BaseStreamer):
    """Records when ``generate`` hands over the prompt and then each step's tokens (wall
    clock, and CPU time of the process)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu_times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        self.cpu_times.append(time.process_time())

    def end(self) -> None:
        pass


def static_batches(requests: Sequence[BaselineRequest], batch_size: int
                   ) -> Iterator[list[BaselineRequest]]:
    """Consecutive groups of ``batch_size`` requests, in the order given."""
    for i in range(0, len(requests), batch_size):
        yield list(requests[i:i + batch_size])


class TransformersBaseline:
    """transformers ``generate`` in static batches.

    Args:
        model_path: a Hugging Face model directory.
        dtype: weights and activations dtype.
        batch_size: requests per ``generate`` call.
        pad_token_id: id used for left padding (any id: padded positions are masked).
    """

    def __init__(self, model_path: str | Path, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", batch_size: int = 16, pad_token_id: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
        self.model.to(device)  # type: ignore[arg-type]  # transformers' wrapper mistypes .to
        self.model.eval()
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id

    def run(self, requests: Sequence[BaselineRequest]) -> BaselineRun:
        """Serve every request, ``batch_size`` at a time, in order."""
        results: list[BaselineResult] = []
        batches: list[BatchTiming] = []
        start = time.perf_counter()
        for batch in static_batches(requests, self.batch_size):
            out, timing = self.generate_batch(batch)
            results.extend(out)
            batches.append(timing)
        return BaselineRun(results, batches, time.perf_counter() - start)

    @torch.inference_mode()
    def generate_batch(self, batch: Sequence[BaselineRequest]
                       ) -> tuple[list[BaselineResult], BatchTiming]:
        """One ``generate`` call over ``batch``, left-padded to its longest prompt."""
        if not batch:
            raise ValueError("batch: must not be empty")
        num_new = max(r.max_tokens for r in batch)
        padded_len = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), padded_len), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), padded_len), dtype=torch.long)  # [B, padded_len]
        for row, req in enumerate(batch):
            n = len(req.prompt_token_ids)
            ids[row, padded_len - n:] = torch.tensor(req.prompt_token_ids)
            mask[row, padded_len - n:] = 1
        extra = self._generate_kwargs(batch)  # may load adapters (and wrap the model)
        clock = _StepClock()
        start = time.perf_counter()
        sequences = self.model.generate(
            ids.to(self.device), attention_mask=mask.to(self.device), do_sample=False,
            max_new_tokens=num_new, min_new_tokens=num_new, pad_token_id=self.pad_token_id,
            streamer=clock, **extra)
        new_tokens = sequences[:, padded_len:].tolist()
        # times[0]: the prompt was handed over (prefill starts); times[i]: token i-1 is out.
        token_times = clock.times[1:]
        results = [BaselineResult(req.request_id, new_tokens[row][:req.max_tokens], start,
                                  token_times[:req.max_tokens])
                   for row, req in enumerate(batch)]
        timing = BatchTiming(
            num_requests=len(batch),
            num_prompt_tokens=sum(len(r.prompt_token_ids) for r in batch),
            padded_len=padded_len,
            num_steps=len(token_times),
            prefill_s=token_times[0] - clock.times[0],
            decode_s=token_times[-1] - token_times[0],
            prefill_cpu_s=clock.cpu_times[1] - clock.cpu_times[0],
            decode_cpu_s=clock.cpu_times[-1] - clock.cpu_times[1])
        return results, timing

    def _generate_kwargs(self, batch: Sequence[BaselineRequest]) -> dict:
        """Extra ``generate`` arguments for ``batch`` (the adapters, in ``PeftBaseline``)."""
        return {}

    def serve_trace(self, requests: Sequence[BaselineRequest], policy: str = "mixed",
                    max_batch_size: int = 16, window_s: float = 0.05,
                    max_duration_s: float = float("inf")) -> BaselineRun:
        """Serve requests as they arrive (``arrival_time``), with dynamic batching.

        A batch leaves when it holds ``max_batch_size`` requests, when ``window_s`` has passed
        since its oldest request arrived, or when nothing else is due; requests arriving during
        a ``generate`` call wait for the next batch. Which requests share a batch is
        ``next_batch(waiting, policy, max_batch_size)``.

        Returns:
            the results in service order; in each, ``start_time`` is the request's arrival
            and every time is in seconds after the start of the run. Requests not begun
            within ``max_duration_s`` are left out.
        """
        future = deque(sorted(requests, key=lambda r: r.arrival_time))
        waiting: list[BaselineRequest] = []
        results: list[BaselineResult] = []
        batches: list[BatchTiming] = []
        start = time.perf_counter()
        while future or waiting:
            now = time.perf_counter() - start
            if now > max_duration_s:
                break
            while future and future[0].arrival_time <= now:
                waiting.append(future.popleft())
            if not waiting:
                time.sleep(max(0.0, future[0].arrival_time - now))
                continue
            batch = next_batch(waiting, policy, max_batch_size)
            gather_until = waiting[0].arrival_time + window_s
            if len(batch) < max_batch_size and future and now < gather_until:
                time.sleep(max(0.0, min(gather_until, future[0].arrival_time) - now))
                continue
            chosen = {id(r) for r in batch}
            waiting = [r for r in waiting if id(r) not in chosen]
            out, timing = self.generate_batch(batch)
            batches.append(timing)
            results.extend(replace(res, start_time=req.arrival_time,
                                   token_times=[t - start for t in res.token_times])
                           for req, res in zip(batch, out))
        return BaselineRun(results, batches, time.perf_counter() - start)


BATCH_POLICIES = ("mixed", "grouped")


def next_batch(waiting: Sequence[BaselineRequest], policy: str, max_batch_size: int
               ) -> list[BaselineRequest]:
    """The next batch out of ``waiting`` (in arrival order): ``mixed`` takes the oldest
    ``max_batch_size`` whatever their adapters; ``grouped`` takes the oldest request's adapter
    and up to ``max_batch_size`` requests for it."""
    if policy == "mixed":
        return list(waiting[:max_batch_size])
    if policy == "grouped":
        adapter = waiting[0].adapter
        return [r for r in waiting if r.adapter == adapter][:max_batch_size]
    raise ValueError(f"policy: {policy!r} is not one of {BATCH_POLICIES}")


class PeftBaseline(TransformersBaseline):
    """transformers + peft: LoRA adapters by name, loaded from PEFT directories on first use.

    A batch of one adapter runs with that adapter active; a batch of several runs peft's
    mixed-batch path (``adapter_names``, ``"__base__"`` for base-model rows). At most
    ``max_loaded_adapters`` stay loaded (least recently used ones are deleted); ``num_loads``
    and ``load_seconds`` count the loads.

    Args:
        model_path: the base model directory.
        adapter_dirs: adapter name -> PEFT adapter directory.
        max_loaded_adapters: adapters kept loaded at once (a batch may exceed it).
        **kwargs: as for ``TransformersBaseline``.
    """

    def __init__(self, model_path: str | Path, adapter_dirs: Mapping[str, str | Path],
                 max_loaded_adapters: int = 64, **kwargs) -> None:
        if max_loaded_adapters < 1:
            raise ValueError(f"max_loaded_adapters: must be >= 1, got {max_loaded_adapters}")
        super().__init__(model_path, **kwargs)
        self.adapter_dirs = {name: Path(p) for name, p in adapter_dirs.items()}
        self.max_loaded_adapters = max_loaded_adapters
        self._base = self.model
        self._loaded: OrderedDict[str, None] = OrderedDict()
        self.num_loads = 0
        self.load_seconds = 0.0

    def _load(self, names: set[str]) -> None:
        from peft import PeftModel

        for name in sorted(names):
            if name in self._loaded:
                self._loaded.move_to_end(name)
                continue
            if name not in self.adapter_dirs:
                raise ValueError(f"adapter: {name!r} has no directory")
            t0 = time.perf_counter()
            path = str(self.adapter_dirs[name])
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(path, adapter_name=name)
            else:
                peft_model: Any = PeftModel.from_pretrained(self._base, path, adapter_name=name)
                peft_model.eval()
                self.model = peft_model
            self._loaded[name] = None
            self.num_loads += 1
            self.load_seconds += time.perf_counter() - t0
        while len(self._loaded) > self.max_loaded_adapters:
            victim = next((n for n in self._loaded if n not in names), None)
            if victim is None:
                break
            if self.model.active_adapter == victim:
                self.model.set_adapter(next(n for n in self._loaded if n != victim))
            self.model.delete_adapter(victim)
            del self._loaded[victim]

    def _generate_kwargs(self, batch: Sequence[BaselineRequest]) -> dict:
        names = {r.adapter for r in batch if r.adapter}
        self._load(names)
        if not self._loaded:
            return {}
        if len(names) == 1 and all(r.adapter for r in batch):
            self.model.set_adapter(names.pop())
            return {}
        return {"adapter_names": [r.adapter or "__base__" for r in batch]}
