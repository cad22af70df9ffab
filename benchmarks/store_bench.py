"""Adapter store throughput: push and pull of a 7B-shaped rank-64 adapter on fs and Redis.

The adapter is generated (random float16, all seven modules of Llama-2-7B's 32 layers at rank
64: about 320 MB) and written as a PEFT directory. For each backend we time, median of
``--repeat`` runs (the best run's MB/s too: shared machines are noisy):

* validate: ``load_adapter`` (read, check, hash), shared by both backends;
* push: ``AdapterStore.put`` (stream the blob, fsync / stage chunks, commit);
* pull: ``AdapterStore.fetch`` (read, check every chunk, verify the digest, decode);
* first usable tensor: from the ``fetch`` call until layer 0's first A can be used.
  Fetch verifies the whole digest before it hands out any tensor, so this is the pull time:
  the number a streaming reader would have to beat.

Without ``--redis URL`` a ``redis-server`` is started per Redis backend in a temporary
directory and stopped afterwards: ``redis`` with AOF (``appendfsync everysec``),
``redis-nopersist`` without persistence. Prints a table; writes
``<out>/store_bench.json``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/store_bench.py --out bench-out
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/store_bench.py --scale 0.1   # 3 layers
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import safetensors.torch
import torch

from loraplex.adapter_store.blob import blob_size
from loraplex.adapter_store.format import CanonicalAdapter, load_adapter, peft_key
from loraplex.adapter_store.store import AdapterStore, open_store
from loraplex.server.engine.models.config import LORA_MODULES, ModelConfig

T = TypeVar("T")
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
    "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
}


def generate_adapter(path: Path, base: ModelConfig, rank: int, dtype: torch.dtype) -> None:
    """Write a PEFT adapter directory with random weights for every module of every layer."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(base.num_layers):
        for module, (d_in, d_out) in base.module_shapes().items():
            tensors[peft_key(layer, module, "A")] = (
                torch.randn(rank, d_in, generator=gen) * 0.01).to(dtype)
            tensors[peft_key(layer, module, "B")] = (
                torch.randn(d_out, rank, generator=gen) * 0.01).to(dtype)
    path.mkdir(parents=True)
    safetensors.torch.save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(LORA_MODULES), "task_type": "CAUSAL_LM"}))


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench_backend(store: AdapterStore, adapter: CanonicalAdapter, repeat: int) -> dict:
    """Median push, pull and first-usable-tensor times of one backend."""
    push_s, pull_s, first_s = [], [], []
    for i in range(repeat):
        t, record = timed(lambda: store.put("bench", "adapter-7b", adapter))
        push_s.append(t)
        start = time.perf_counter()
        got = store.fetch(record.digest)
        pull_s.append(time.perf_counter() - start)
        a, _ = got.weights[(0, got.target_modules[0])]
        a.float().sum()  # touch it: usable
        first_s.append(time.perf_counter() - start)
        if i == 0 and got != adapter:
            raise RuntimeError("round trip changed the adapter")
        del got, a
    store.delete("bench", "adapter-7b")
    mb = blob_size(adapter) / 1e6
    push, pull = statistics.median(push_s), statistics.median(pull_s)
    return {"push_s": push, "push_MBps": mb / push, "pull_s": pull, "pull_MBps": mb / pull,
            "first_usable_tensor_s": statistics.median(first_s),
            "push_best_MBps": mb / min(push_s), "pull_best_MBps": mb / min(pull_s),
            "push_runs_s": push_s, "pull_runs_s": pull_s, "first_usable_runs_s": first_s}


class RedisProcess:
    """A throwaway redis-server in a temporary directory, stopped by pid.

    With ``aof`` it persists as we recommend (``appendonly yes``, ``appendfsync everysec``);
    without, it keeps nothing on disk (the cost of persistence is the difference).
    """

    def __init__(self, workdir: Path, aof: bool = True) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        log = workdir / "redis.log"
        log.write_text("")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(workdir), "--logfile", str(log), "--save", "",
             "--appendonly", "yes" if aof else "no", "--appendfsync", "everysec"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while "Ready to accept connections" not in log.read_text(errors="replace"):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"redis-server did not start: {log.read_text()[-500:]}")
            time.sleep(0.05)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", type=float, default=1.0,
                   help="fraction of the 32 layers to generate (default 1: ~320 MB)")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--backends", default="fs,redis",
                   help="any of fs, redis (AOF, everysec), redis-nopersist (no AOF)")
    p.add_argument("--redis", default=None, help="use this server instead of starting one")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workdir", default=None, help="where the temporary files go")
    p.add_argument("--out", default=None, help="write store_bench.json here")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    layers = max(1, round(LLAMA2_7B["num_hidden_layers"] * args.scale))
    base = ModelConfig.from_hf_dict({**LLAMA2_7B, "num_hidden_layers": layers})
    dtype = getattr(torch, args.dtype)
    backends = [b for b in args.backends.split(",") if b]
    work = Path(tempfile.mkdtemp(prefix="store-bench-", dir=args.workdir))
    servers: list[RedisProcess] = []
    try:
        t_gen, _ = timed(lambda: generate_adapter(work / "adapter", base, args.rank, dtype))
        t_val, adapter = timed(lambda: load_adapter(work / "adapter", base))
        mb = blob_size(adapter) / 1e6
        results: dict = {
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
            "python": platform.python_version(), "torch": torch.__version__,
            "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
            "layers": layers, "rank": args.rank, "dtype": args.dtype, "blob_MB": mb,
            "generate_s": t_gen, "validate_s": t_val, "validate_MBps": mb / t_val,
            "backends": {}}
        for backend in backends:
            if backend == "fs":
                spec = f"fs:{work / 'fs-store'}"
            elif backend in ("redis", "redis-nopersist") and args.redis:
                spec = args.redis
            elif backend in ("redis", "redis-nopersist"):
                (work / backend).mkdir()
                servers.append(RedisProcess(work / backend, aof=backend == "redis"))
                spec = servers[-1].url
            else:
                raise SystemExit(f"unknown backend {backend!r}")
            with open_store(spec, base) as store:
                results["backends"][backend] = bench_backend(store, adapter, args.repeat)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"adapter: rank {args.rank}, {len(LORA_MODULES)} modules x {layers} layers, "
          f"{args.dtype}, {mb:.1f} MB; validate {t_val:.2f} s ({mb / t_val:.0f} MB/s)")
    print(f"{'backend':<16} {'push s':>7} {'push MB/s':>10} {'(best)':>7} {'pull s':>7} "
          f"{'pull MB/s':>10} {'(best)':>7} {'first tensor s':>15}")
    for name, r in results["backends"].items():
        print(f"{name:<16} {r['push_s']:>7.2f} {r['push_MBps']:>10.0f} "
              f"{r['push_best_MBps']:>7.0f} {r['pull_s']:>7.2f} {r['pull_MBps']:>10.0f} "
              f"{r['pull_best_MBps']:>7.0f} {r['first_usable_tensor_s']:>15.2f}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "store_bench.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
