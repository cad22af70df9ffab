"""vLLM as a peer system: a driver the peer venv (``.venv-vllm``, ``make bench-peers``) runs as a
subprocess of the benchmarks (``lora_bench.py``, ``engine_bench.py``), so that vLLM's pins never
touch the project's venv.

It imports nothing of loraplex: it loads the model folder the benchmark wrote (the same
safetensors loraplex reads) once, then answers one JSON request per stdin line with one JSON
line on stdout, until stdin closes::

    -> {"prompts": [[id, ...], ...], "max_tokens": 32, "adapters": [path | null, ...]}
    <- {"token_ids": [[id, ...], ...], "wall_s": 1.9, "cpu_s": 3.7, "steps": [[0.05, 0], ...]}

Every request goes to one ``LLM.generate`` call (greedy, EOS ignored, token-id prompts, no
tokenizer). ``cpu_s`` is the CPU time of the driver's whole process tree over the call (vLLM V1
runs its engine core in a child process). Adapters are PEFT folders (``save_peft_dir``), one
``LoRARequest`` id per distinct path.

``steps``: one ``[seconds, num_decodes]`` per engine step, read off the engine core's outputs
as ``LLM.generate`` collects them (``StepLog``): a step's seconds are the time between the
engine core's timestamps of its outputs and the previous step's (the call's start for the
first), and ``num_decodes`` is the number of requests that decoded one token in it where every
unfinished request did and none was still waiting for its first token, else 0 (loraplex's
decode-only steps, ``common.StepTiming``). The engine core's process has no per-step CPU time.

``--profile`` (``lora_bench.py --profile``): the engine core runs in this process and a request
with ``"profile": true`` runs its call twice, once plain and once under ``torch.profiler``,
and answers ``"profile"``: where each decode and mixed step's time went (``vllm_profile``),
with ``"profiled_wall_s"`` beside the plain ``"wall_s"`` and ``"event_cost_s"``, what the
profiler adds to one recorded op.

vLLM CPU bug worked around (0.32.0): a request *without* an adapter batched with LoRA requests
gets the last LoRA slot's adapter (the "no LoRA" index -1 wraps). The benchmark therefore gives
every request of a LoRA run an adapter, and runs base-model requests in a driver started
without ``--max-lora-rank`` (vLLM's base engine); this driver refuses a mixed request.

Environment (set by the caller, documented in docs/benchmarks.md): VLLM_CPU_OMP_THREADS_BIND,
VLLM_CPU_NUM_OF_RESERVED_CPU=0 (the default reserves one of two cores), VLLM_CPU_KVCACHE_SPACE.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_profile import LORA_SCOPE, SCHEDULE_SCOPE, STEP_SCOPE, breakdowns  # noqa: E402


def tree_cpu_s() -> float:
    """User + system seconds of this process and all its live descendants."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class StepLog:
    """The steps of one call, from the engine core's outputs (``EngineCoreOutputs``: ``outputs``
    of ``request_id`` / ``new_token_ids`` / ``finish_reason``, ``timestamp`` on the monotonic
    clock, which is the same in every process of the machine)."""

    def __init__(self, num_requests: int, start: float) -> None:
        self.waiting = num_requests  # no token yet
        self.running = 0  # a token, not finished
        self.started: set[str] = set()
        self.last = start
        self.steps: list[list[float]] = []

    def record(self, outs) -> None:
        outputs = list(outs.outputs)
        decode_only = (self.waiting == 0 and self.running > 0 and len(outputs) == self.running
                       and all(len(o.new_token_ids) == 1 and o.request_id in self.started
                               for o in outputs))
        for o in outputs:
            if o.request_id not in self.started and o.new_token_ids:
                self.started.add(o.request_id)
                self.waiting -= 1
                self.running += 1
            if o.finish_reason is not None and o.request_id in self.started:
                self.running -= 1
        self.steps.append([max(outs.timestamp - self.last, 0.0),
                           len(outputs) if decode_only else 0])
        self.last = outs.timestamp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-lora-rank", type=int, default=0, help="0: the base engine, no LoRA")
    p.add_argument("--max-loras", type=int, default=1, help="adapters batched at once")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=32, help="CPU attention: a multiple of 32")
    p.add_argument("--profile", action="store_true",
                   help="the engine core in this process, for requests that ask for a profile")
    args = p.parse_args()
    if args.profile:  # before vLLM reads its environment
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    lora = args.max_lora_rank > 0
    extra = dict(enable_lora=True, max_lora_rank=args.max_lora_rank, max_loras=args.max_loras,
                 max_cpu_loras=max(args.max_loras, 1)) if lora else {}
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True, seed=0,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
              enable_prefix_caching=False, **extra)
    ids: dict[str, int] = {}
    import vllm

    print(json.dumps({"ready": True, "load_s": time.perf_counter() - t0,
                      "vllm": vllm.__version__}), flush=True)
    core = llm.llm_engine.engine_core
    get_output = core.get_output
    log: StepLog | None = None

    def logged_output():  # one engine step's outputs (LLMEngine.step calls it once a step)
        outs = get_output()
        if log is not None and (outs.outputs or outs.scheduler_stats is not None):
            log.record(outs)
        return outs

    core.get_output = logged_output
    kinds: list[str | None] | None = None  # per engine step of a profiled call
    if args.profile:
        scope_steps(llm, lambda: log, lambda: kinds)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=ids_) for ids_ in req["prompts"]]
        params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True,
                                detokenize=False)
        paths = req.get("adapters") or [None] * len(prompts)
        if lora and any(path is None for path in paths):
            # the no-LoRA index wraps to the last slot's adapter (see the module docstring)
            raise ValueError("adapters: a LoRA run needs an adapter for every request")
        if not lora and any(path is not None for path in paths):
            raise ValueError("adapters: this driver is vLLM's base engine (no --max-lora-rank)")
        loras = None
        if lora:
            loras = [LoRARequest(path, ids.setdefault(path, len(ids) + 1), path) for path in paths]
        cpu0, w0 = tree_cpu_s(), time.perf_counter()
        log = StepLog(len(prompts), time.monotonic())
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        wall, cpu = time.perf_counter() - w0, tree_cpu_s() - cpu0
        reply = {"token_ids": [list(o.outputs[0].token_ids) for o in outs],
                 "wall_s": wall, "cpu_s": cpu, "steps": log.steps}
        if req.get("profile"):
            if not args.profile:
                raise ValueError("profile: start the driver with --profile")
            import torch.profiler

            log, kinds = StepLog(len(prompts), time.monotonic()), []
            w0 = time.perf_counter()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
            reply["profiled_wall_s"] = time.perf_counter() - w0
            reply["profile"] = breakdowns(prof.events(), kinds)
            reply["event_cost_s"] = profiler_event_cost()
            kinds = None
        print(json.dumps(reply), flush=True)
        log = None


def profiler_event_cost(n: int = 20000) -> float:
    """Seconds torch's profiler adds to one recorded op (a tiny ``torch.add``, timed with and
    without the profiler): what each event in a profile's table costs."""
    import torch
    import torch.profiler

    x = torch.zeros(1)
    t0 = time.perf_counter()
    for _ in range(n):
        torch.add(x, 1)
    plain = time.perf_counter() - t0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        t0 = time.perf_counter()
        for _ in range(n):
            torch.add(x, 1)
        profiled = time.perf_counter() - t0
    return max(profiled - plain, 0.0) / n


def scope_steps(llm, current_log, current_kinds) -> None:
    """Profiler scopes around each engine step (``peer: step N``, N counting the steps of
    the profiled call, whose kinds go to ``current_kinds()``), the scheduler and
    ``PunicaWrapperCPU``'s LoRA calls. ``LLM.generate`` calls ``llm_engine.step`` once a step;
    the step's outputs reach ``current_log()`` (``StepLog``) inside it."""
    from torch.profiler import record_function
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    def scoped(fn, name):
        def wrapper(*a, **kw):
            with record_function(name) if current_kinds() is not None else nullcontext():
                return fn(*a, **kw)
        return wrapper

    for name in ("add_lora_linear", "add_lora_logits", "add_lora_embedding"):
        setattr(PunicaWrapperCPU, name, scoped(getattr(PunicaWrapperCPU, name), LORA_SCOPE))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # InprocClient's EngineCore
    scheduler.schedule = scoped(scheduler.schedule, SCHEDULE_SCOPE)
    step = llm.llm_engine.step

    def scoped_step():
        kinds, log = current_kinds(), current_log()
        if kinds is None or log is None:
            return step()
        before = len(log.steps)
        with record_function(f"{STEP_SCOPE}{len(kinds)}"):
            out = step()
        kinds.append(None if len(log.steps) == before
                     else "decode" if log.steps[-1][1] > 0 else "mixed")
        return out

    llm.llm_engine.step = scoped_step


if __name__ == "__main__":
    main()
