"""Where an engine step's time goes: ``--profile`` of the engine and LoRA benchmarks.

``StepProfiler(engine)`` wraps the stages of one ``Engine`` (instance attributes and module
functions, in this process only; nothing in the server changes) with timers, and charges each
stage its *self* time (a stage's time minus the stages nested inside it):

=================  ===========================================================================
``gemm``           the layers' projections (``llama.linear``: qkv, o, gate_up, down)
``lm_head``        the final norm and the vocabulary projection (``compute_logits``)
``attention``      writing K/V into the pages and paged attention (the runner's kernels)
``rope``           rotary embeddings
``lora``           the LoRA deltas (``LoraBatch.__call__``) and building the batch's tables
``model other``    the rest of the forward: embedding, RMSNorms, SiLU, residual adds, views
``batch build``    the runner's inputs: token ids, positions, attention metadata
``sampling``       ``sampler.sample`` on the logits
``scheduling``     ``Scheduler.schedule``
``engine other``   the rest of ``Engine.step``: outputs, detokenizing, stop checks, Python
=================  ===========================================================================

Times are the thread's CPU time (``thread_time``) when torch runs on this one thread, so that
other jobs on a shared machine do not inflate them, else wall-clock (``perf_counter``). CPU
work is synchronous; on CUDA every stage synchronizes first (wall clock), which serializes the
launches: read GPU profiles as attribution, not as speed. Each timed call costs about a
microsecond; the table reports calls per step and the overhead they add, and the benchmarks
run the profile as a separate pass after the timed runs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from loraplex.server.engine import engine as engine_module
from loraplex.server.engine import lora as lora_module
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.models import llama as llama_module

CATEGORIES = ("gemm", "lm_head", "attention", "rope", "lora", "model other", "batch build",
              "sampling", "scheduling", "engine other")
# A nested call charged to its caller's category instead of its own.
_INHERIT = {("lm_head", "gemm")}


@dataclass
class StepBreakdown:
    """Self seconds and calls by category over the steps of one kind."""

    num_steps: int = 0
    clock: str = "wall"  # "cpu": the thread's CPU time (torch on one thread), else wall time
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


class _Timers:
    """Self seconds and calls by category, through wrapped functions that nest."""

    def __init__(self, sync: bool, clock: Callable[[], float] = time.perf_counter) -> None:
        self.sync = sync
        self.clock = clock
        self.stack: list[list[Any]] = []  # [category, start, child seconds]
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def timed(self, fn: Callable[..., Any], category: str) -> Callable[..., Any]:
        stack, seconds, calls, sync, clock = (self.stack, self.seconds, self.calls, self.sync,
                                              self.clock)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            cat = category
            if stack and (stack[-1][0], cat) in _INHERIT:
                cat = stack[-1][0]
            if sync:
                torch.cuda.synchronize()
            frame: list[Any] = [cat, clock(), 0.0]
            stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                if sync:
                    torch.cuda.synchronize()
                elapsed = clock() - frame[1]
                stack.pop()
                seconds[cat] += elapsed - frame[2]
                calls[cat] += 1
                if stack:
                    stack[-1][2] += elapsed
        return wrapper


class StepProfiler:
    """Attach to an engine, drive it (calling ``record`` after each step), read
    ``breakdowns``, then ``detach``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.breakdowns: dict[str, StepBreakdown] = defaultdict(StepBreakdown)
        cuda = engine.device.type == "cuda"
        self.clock = "cpu" if not cuda and torch.get_num_threads() == 1 else "wall"
        self._timers = _Timers(cuda, time.thread_time if self.clock == "cpu" else time.perf_counter)
        self._undo: list[Callable[[], None]] = []
        runner = engine.runner
        self._patch(engine, "step", "engine other")
        self._patch(engine.scheduler, "schedule", "scheduling")
        self._patch(runner, "run", "batch build")
        self._patch(runner, "write_kv", "attention")
        self._patch(runner, "attention", "attention")
        self._patch(runner, "_lora_batch", "lora")
        self._patch(runner.model, "forward", "model other")
        self._patch(runner.model, "compute_logits", "lm_head")
        self._patch(runner.model.rope, "apply", "rope")
        self._patch(runner.model.rope, "apply_qk", "rope")
        self._patch(llama_module, "linear", "gemm")
        self._patch(engine_module, "sample", "sampling")
        self._patch(lora_module.LoraBatch, "__call__", "lora")

    def record(self, kind: str) -> None:
        """Close the step just run, counting it under ``kind`` (``decode`` or ``mixed``)."""
        b = self.breakdowns[kind]
        b.num_steps += 1
        for cat, s in self._timers.seconds.items():
            b.seconds[cat] += s
        for cat, n in self._timers.calls.items():
            b.calls[cat] += n
        self._timers.seconds.clear()
        self._timers.calls.clear()

    def detach(self) -> None:
        """Restore every wrapped attribute."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _patch(self, owner: Any, name: str, category: str) -> None:
        # Modules and classes get their attribute back; an instance loses the attribute that
        # shadowed its class's method (or gets back the one it had, e.g. the runner's kernels).
        original = getattr(owner, name)
        own = name in vars(owner)
        saved = vars(owner).get(name)
        setattr(owner, name, self._timers.timed(original, category))
        if own:
            self._undo.append(lambda: setattr(owner, name, saved))
        else:
            self._undo.append(lambda: delattr(owner, name))


def call_overhead_s(repeats: int = 20000) -> float:
    """Seconds one timed call adds (on the clock a profiler would use here), measured on an
    empty function."""
    def noop() -> None:
        return None

    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    wrapped = _Timers(False, clock).timed(noop, "gemm")
    t0 = time.perf_counter()
    for _ in range(repeats):
        noop()
    plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(repeats):
        wrapped()
    return max(time.perf_counter() - t0 - plain, 0.0) / repeats


def profile_table(breakdowns: dict[str, StepBreakdown], overhead_s: float,
                  what: str = "timed calls") -> list[str]:
    """Lines of a table: ms per step and share of the step, per category and step kind
    (``what``: what the calls column counts, each costing ``overhead_s``)."""
    kinds = [k for k in ("decode", "mixed") if k in breakdowns]
    clock = breakdowns[kinds[0]].clock if kinds else "wall"
    head = f"{clock + ' time':14}" + "".join(f" {k + ' ms/step':>16} {'%':>6} {'calls':>6}"
                                     for k in kinds)
    lines = [head, "-" * len(head)]
    for cat in CATEGORIES:
        row = f"{cat:14}"
        for k in kinds:
            b = breakdowns[k]
            ms = 1000 * b.seconds.get(cat, 0.0) / b.num_steps
            share = b.seconds.get(cat, 0.0) / b.total if b.total else 0.0
            row += f" {ms:16.2f} {share:6.1%} {b.calls.get(cat, 0) / b.num_steps:6.0f}"
        lines.append(row)
    row = f"{'step':14}"
    for k in kinds:
        b = breakdowns[k]
        row += f" {1000 * b.total / b.num_steps:16.2f} {'':6} {b.num_steps:6d}"
    lines.append(row + "   (last column: steps)")
    for k in kinds:
        b = breakdowns[k]
        calls = sum(b.calls.values()) / b.num_steps
        lines.append(f"{k}: {calls:.0f} {what} a step add ~{1000 * calls * overhead_s:.2f} "
                     f"ms ({overhead_s * 1e6:.2f} us each), included above")
    return lines


def breakdowns_json(breakdowns: dict[str, StepBreakdown]) -> dict:
    """The breakdowns as plain JSON: ms per step and calls per step by category."""
    return {k: {"num_steps": b.num_steps, "clock": b.clock,
                "ms_per_step": {c: 1000 * b.seconds.get(c, 0.0) / b.num_steps
                                for c in CATEGORIES},
                "calls_per_step": {c: b.calls.get(c, 0) / b.num_steps for c in CATEGORIES}}
            for k, b in breakdowns.items()}


def breakdowns_from_json(data: dict) -> dict[str, StepBreakdown]:
    """``breakdowns_json``'s output (or the vLLM peer's, ``vllm_profile.breakdowns``) back as
    breakdowns, for ``profile_table``."""
    out = {}
    for kind, d in data.items():
        n = int(d["num_steps"])
        b = StepBreakdown(num_steps=n, clock=d.get("clock", "wall"))
        for c in CATEGORIES:
            b.seconds[c] = d["ms_per_step"].get(c, 0.0) * n / 1000
            b.calls[c] = round(d["calls_per_step"].get(c, 0.0) * n)
        out[kind] = b
    return out


def profile_engine(engine: Engine,
                   drive: Callable[[Callable[[bool], None]], Any]) -> dict[str, StepBreakdown]:
    """Run ``drive(on_step)`` (a benchmark's engine driver, calling ``on_step(decode_only)``
    after each step) with the profiler attached; the breakdowns by step kind."""
    prof = StepProfiler(engine)
    try:
        drive(lambda decode_only: prof.record("decode" if decode_only else "mixed"))
    finally:
        prof.detach()
    for b in prof.breakdowns.values():
        b.clock = prof.clock
    return dict(prof.breakdowns)
