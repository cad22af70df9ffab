"""Where a vLLM step's time goes: the peer's side of ``lora_bench.py --profile``.

``vllm_driver.py --profile`` runs vLLM's engine core in the driver's own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with vLLM's own profiling scopes on
(``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``), adds scopes of its own around each engine step, the
scheduler and the LoRA wrapper, and runs one call under ``torch.profiler``. This module turns
the profiler's events into the categories of loraplex's ``step_profile`` (the same names, the
same JSON), charging each event its *self* time:

=================  ===========================================================================
``gemm``           oneDNN / aten matrix products (the layers' projections)
``lm_head``        the runner's postprocess scope: the vocabulary projection and its slicing
``attention``      ops named for attention or the KV cache (vLLM's CPU attention kernels)
``rope``           ops named for rotary embeddings (none where inductor fused them)
``lora``           ``PunicaWrapperCPU``'s LoRA calls and everything inside them
``model other``    the rest of the runner's forward scope: on a compiled model, the inductor
                   graph's own time (embedding, RMSNorms, RoPE, SiLU, residual adds fused)
``batch build``    the runner's preprocess scope (its inputs and attention metadata)
``sampling``       the runner's sample scope
``scheduling``     ``Scheduler.schedule``
``engine other``   the rest of the engine step: outputs, bookkeeping, Python
=================  ===========================================================================

An event inside a LoRA scope is LoRA whatever its name; a matrix product inside the
postprocess scope is ``lm_head``. Steps are the driver's ``peer: step N`` scopes, counted as
decode or mixed by ``vllm_driver.StepLog`` (loraplex's decode-only steps). Times are wall
time on the profiler's clock and include its overhead (the driver reports the profiled
call's wall time beside an unprofiled one). It imports nothing of vLLM or loraplex, so that
the project's tests can run it on torch's own profiler events.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

CATEGORIES = ("gemm", "lm_head", "attention", "rope", "lora", "model other", "batch build",
              "sampling", "scheduling", "engine other")
STEP_SCOPE = "peer: step "
LORA_SCOPE = "peer: lora"
SCHEDULE_SCOPE = "peer: schedule"
# vLLM's own scopes (``record_function_or_nullcontext`` in its model runner) and ours
SCOPES = {LORA_SCOPE: "lora", SCHEDULE_SCOPE: "scheduling",
          "gpu_model_runner: preprocess": "batch build",
          "gpu_model_runner: forward": "model other",
          "gpu_model_runner: postprocess": "lm_head",
          "gpu_model_runner: sample": "sampling"}
GEMM_OPS = frozenset({"_C::onednn_mm", "_C::onednn_scaled_mm", "aten::mm", "aten::addmm",
                      "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul",
                      "mkldnn::_linear_pointwise", "aten::mkldnn_linear"})


def op_category(name: str) -> str | None:
    """The category an op's name gives it, or None (then its scope decides)."""
    if name in GEMM_OPS:
        return "gemm"
    low = name.lower()
    if "rotary" in low or "rope" in low:
        return "rope"
    if "attention" in low or "attn" in low or "kv_cache" in low:
        return "attention"
    return None


def step_index(name: str) -> int | None:
    if name.startswith(STEP_SCOPE):
        try:
            return int(name[len(STEP_SCOPE):])
        except ValueError:
            return None
    return None


def classify(event: Any) -> tuple[int | None, str]:
    """(the step an event belongs to or None, its category), from its name and its parents'
    (``cpu_parent``, as torch's ``FunctionEvent`` has)."""
    scope: str | None = None
    lora = False
    step: int | None = None
    node = event.cpu_parent
    while node is not None:
        name = node.name
        if name == LORA_SCOPE:
            lora = True
        elif scope is None and name in SCOPES:
            scope = SCOPES[name]
        idx = step_index(name)
        if idx is not None:
            step = idx
            break
        node = node.cpu_parent
    own = step_index(event.name)
    if own is not None:
        return own, "engine other"
    if lora or event.name == LORA_SCOPE:
        return step, "lora"
    if event.name in SCOPES:
        return step, SCOPES[event.name]
    cat = op_category(event.name)
    if cat == "gemm" and scope == "lm_head":
        return step, "lm_head"
    return step, cat or scope or "engine other"


def breakdowns(events: Iterable[Any], step_kinds: Sequence[str | None]) -> dict:
    """Per step kind (``decode`` / ``mixed``, ``step_kinds[N]`` for ``peer: step N``; None
    leaves a step out): ms and events per step by category, as ``step_profile``'s
    ``breakdowns_json``. Events outside every step are left out."""
    seconds: dict[str, dict[str, float]] = {}
    calls: dict[str, dict[str, int]] = {}
    for ev in events:
        step, cat = classify(ev)
        kind = step_kinds[step] if step is not None and step < len(step_kinds) else None
        if kind is None:
            continue
        seconds.setdefault(kind, dict.fromkeys(CATEGORIES, 0.0))[cat] += (
            ev.self_cpu_time_total / 1e6)
        calls.setdefault(kind, dict.fromkeys(CATEGORIES, 0))[cat] += 1
    out = {}
    for kind in ("decode", "mixed"):
        n = sum(1 for k in step_kinds if k == kind)
        if n == 0 or kind not in seconds:
            continue
        out[kind] = {"num_steps": n, "clock": "wall",
                     "ms_per_step": {c: 1000 * seconds[kind][c] / n for c in CATEGORIES},
                     "calls_per_step": {c: calls[kind][c] / n for c in CATEGORIES}}
    return out
