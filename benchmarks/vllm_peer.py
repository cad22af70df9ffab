"""vLLM as a peer system of the benchmarks (``lora_bench.py``, ``engine_bench.py``): ``VllmPeer``
starts ``vllm_driver.py`` in the peer venv (``make bench-peers`` makes ``.venv-vllm``; the
``PEER_VENV`` variable names another) and runs traces through it.

The driver stays up between runs (loading vLLM costs tens of seconds), so its runs interleave
with loraplex's in the benchmark's loop; each run is one ``LLM.generate`` with every request.
Wall and CPU seconds come from the driver (CPU: its whole process tree), so the pipe's JSON
is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import psutil
from common import EngineRun, StepTiming

from loraplex.loadtest.baseline import BaselineRequest

ROOT = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"
PEER_VENV = Path(os.environ.get("PEER_VENV", ROOT / ".venv-vllm"))

# vLLM's CPU settings for this machine (docs/benchmarks.md, "against vLLM"): its OpenMP threads
# on cores 0-(threads-1) (``threads_bind``: 0-1 for two, as loraplex's two torch threads), no
# core reserved for the scheduler (its default takes one of the two), and a KV cache space in
# GiB that holds every request of the benchmark.
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def threads_bind(threads: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``threads`` OpenMP threads: cores 0 to threads-1."""
    return "0" if threads == 1 else f"0-{threads - 1}"


def peer_python() -> Path:
    """The peer venv's python; a clear error where ``make bench-peers`` has not run."""
    python = PEER_VENV / "bin" / "python"
    if not (PEER_VENV / ".installed").exists():
        raise FileNotFoundError(f"{PEER_VENV}: no vLLM peer venv; run `make bench-peers` "
                                "(or set PEER_VENV to one)")
    return python


def check_peer_venv(parser: argparse.ArgumentParser, systems: Sequence[str]) -> None:
    """Where ``systems`` asks for a vLLM system and the peer venv is missing, ``parser.error``
    (exit status 2) naming ``make bench-peers``: before anything is built or measured."""
    asked = [s for s in systems if s.startswith("vllm")]
    if asked:
        try:
            peer_python()
        except FileNotFoundError as e:
            parser.error(f"--systems {' '.join(asked)}: {e}")


def peer_version() -> str:
    return (PEER_VENV / ".installed").read_text().strip()


def peer_info(threads: int) -> dict:
    """What the report says about the peer: vLLM's and torch's versions and its environment."""
    return {"version": peer_version(),
            "env": {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": threads_bind(threads)}}


def engine_kwargs(num_requests: int, max_len: int, max_num_batched_tokens: int,
                  threads: int) -> dict:
    """``VllmPeer``'s engine settings for a benchmark that sends ``num_requests`` at once, each
    of up to ``max_len`` tokens (prompt and output): one batch holds every request, the token
    budget is loraplex's, and the model length is rounded up to the KV block (32)."""
    return dict(max_num_seqs=num_requests, max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=-(-max_len // 32) * 32, threads=threads)


def process_cpu_s(pid: int) -> dict[str, float]:
    """User + system CPU seconds of ``pid`` and each live descendant, keyed ``name:pid`` (the
    name is the process title vLLM sets: ``VLLM::EngineCore``, ...)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[f"{p.name()}:{p.pid}"] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


class VllmPeer:
    """One vLLM engine in its own process: LoRA (``max_lora_rank > 0``) or base."""

    def __init__(self, model: Path, dtype: str, max_lora_rank: int = 0, max_loras: int = 1,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_model_len: int = 512, threads: int = 2, profile: bool = False) -> None:
        cmd = [str(peer_python()), str(DRIVER), "--model", str(model), "--dtype", dtype,
               "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras),
               "--max-num-seqs", str(max_num_seqs),
               "--max-num-batched-tokens", str(max_num_batched_tokens),
               "--max-model-len", str(max_model_len)] + (["--profile"] if profile else [])
        env = {**os.environ, **VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": threads_bind(threads)}
        env.pop("PYTHONPATH", None)
        self.lora = max_lora_rank > 0
        self.max_loras = max_loras
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=sys.stderr, text=True, env=env, cwd=ROOT,
                                     start_new_session=True)
        self.ready: dict = {}

    def wait_ready(self) -> VllmPeer:
        """Block until the driver has loaded the model (start every peer first: they load
        side by side)."""
        if not self.ready:
            self.ready = self._read()
            if not self.ready.get("ready"):
                raise RuntimeError(f"vLLM driver did not start: {self.ready}")
        return self

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"vLLM driver exited (rc {self.proc.wait()}); see stderr")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, requests: Sequence[BaselineRequest],
            adapters: Sequence[Path] | None = None) -> tuple[EngineRun, float]:
        """Every request at once; (the run, CPU seconds of the driver's process tree)."""
        out = self._call(requests, adapters)
        tokens = {r.request_id: t for r, t in zip(requests, out["token_ids"])}
        # the engine core's steps (vllm_driver.StepLog); no per-step CPU time there
        steps = [StepTiming(float(sec), float("nan"), int(n)) for sec, n in out.get("steps", [])]
        self.wait_idle()
        return EngineRun(tokens, out["wall_s"], steps), out["cpu_s"]

    def run_profile(self, requests: Sequence[BaselineRequest],
                    adapters: Sequence[Path] | None = None) -> dict:
        """A driver started with ``profile=True`` runs the requests twice, plain and under
        torch's profiler: ``{"profile": vllm_profile.breakdowns, "wall_s", "profiled_wall_s",
        "event_cost_s"}`` (the last: what the profiler adds to one recorded op)."""
        out = self._call(requests, adapters, profile=True)
        self.wait_idle()
        return {k: out[k] for k in ("profile", "wall_s", "profiled_wall_s", "event_cost_s")}

    def _call(self, requests: Sequence[BaselineRequest], adapters: Sequence[Path] | None,
              **extra: object) -> dict:
        self.wait_ready()
        if self.lora and adapters is None:
            raise ValueError("adapters: vLLM's LoRA engine needs an adapter per request")
        msg = {"prompts": [r.prompt_token_ids for r in requests],
               "max_tokens": max(r.max_tokens for r in requests),
               "adapters": [str(p) for p in adapters] if adapters is not None else None,
               **extra}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def wait_idle(self, window_s: float = 0.5, busy: float = 0.05, limit_s: float = 20.0
                  ) -> float:
        """Return once the driver's processes use under ``busy`` of a core over ``window_s``
        (or after ``limit_s``), so that the next system's timed run does not share the CPU with
        vLLM finishing this one; seconds waited."""
        start = time.monotonic()
        before = sum(process_cpu_s(self.proc.pid).values())
        while time.monotonic() - start < limit_s:
            time.sleep(window_s)
            now = sum(process_cpu_s(self.proc.pid).values())
            if now - before < busy * window_s:
                break
            before = now
        return time.monotonic() - start

    def warm_up(self, requests: Sequence[BaselineRequest],
                adapters: Sequence[Path] | None = None) -> None:
        """Two tokens through the first eight requests (untimed): vLLM's first call pays for
        what a benchmark should not time."""
        warm = [replace(r, request_id=f"warm-{r.request_id}", max_tokens=2)
                for r in requests[:8]]
        self.run(warm, adapters[:len(warm)] if adapters is not None else None)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # its own session: the engine core and workers go with it
            os.killpg(self.proc.pid, 9)
