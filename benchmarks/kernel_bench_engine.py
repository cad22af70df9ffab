"""The engine end to end, for ``kernel_bench.py`` (issue 4's last target): decode throughput
with one distinct adapter per request against the base model, on one engine with the Triton
kernels.

Set-up: a random Llama of about 1B parameters (hidden 2048, 16 layers, 16 heads, 8 KV heads,
intermediate 5632, vocab 32000) in bf16, written into a temporary directory with a byte
tokenizer; 64 adapters of ranks 8 and 16 on q, k, v and o, built in memory and served by digest.
The engine warms its kernels up on CUDA before the first round.

Rounds of 64 requests alternate between the base model and one adapter per request (all in
the host cache before the first LoRA round, so that a round times decoding, not adapter loads).
A round prefills every prompt, then times each decode-only step (all 64 requests running, each
decoding one token; the step's wall time, which ends in the sampler's device sync), and aborts
the requests once it has enough. The first steps of a round compile new kernel variants and are
not timed. Reported: each variant's median decode step, decode tokens/s (requests / step) and
their ratio (target: LoRA >= 0.9x base).

Bound by time: no round starts past the deadline, and a round that reaches it is aborted.
"""

from __future__ import annotations

import gc
import logging
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kernel_bench_report import Row

from loraplex.server.engine.models.demo import llama_hf_config

log = logging.getLogger("loraplex.benchmarks.kernel_bench")

_HEADROOM_TOKENS = 64

# about 1B parameters, in bf16
ENGINE_HF_CONFIG = llama_hf_config(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                   num_hidden_layers=16, num_attention_heads=16,
                                   num_key_value_heads=8, head_dim=128, attention_bias=False,
                                   torch_dtype="bfloat16")


@dataclass(frozen=True)
class EngineBenchConfig:
    """What one engine benchmark runs (defaults: issue 4's case on one GPU).

    Attributes:
        hf_config: the random model's Hugging Face config.
        dtype / device: the engine's.
        num_requests: the batch; the LoRA rounds give every request its own adapter.
        ranks: adapter ranks, assigned round-robin; ``modules``: their targets.
        prompt_len: tokens of each (random) prompt.
        decode_steps: decode-only steps timed per round; ``skip_steps`` run untimed first.
        rounds: rounds per variant, interleaved (base, LoRA, base, LoRA, ...).
        page_size / num_pages: the engine's pool.
    """

    hf_config: dict[str, Any] = field(default_factory=lambda: dict(ENGINE_HF_CONFIG))
    dtype: str = "bfloat16"
    device: str = "cuda"
    num_requests: int = 64
    ranks: tuple[int, ...] = (8, 16)
    modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    prompt_len: int = 128
    decode_steps: int = 48
    skip_steps: int = 2
    rounds: int = 2
    page_size: int = 16
    num_pages: int = 4096

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.prompt_len < 1 or self.rounds < 1:
            raise ValueError("num_requests, prompt_len and rounds must be >= 1")
        if self.decode_steps < 1 or self.skip_steps < 0:
            raise ValueError("decode_steps must be >= 1 and skip_steps >= 0")
        if not self.ranks or min(self.ranks) < 1 or not self.modules:
            raise ValueError("ranks must be >= 1 and modules non-empty")


class MemorySource:
    """Adapters built in memory, served by digest (the engine's ``AdapterSource``)."""

    def __init__(self, adapters: Sequence[Any]) -> None:
        self.adapters = {a.digest: a for a in adapters}

    def fetch(self, digest: str) -> Any:
        return self.adapters[digest]


def build_adapters(cfg: EngineBenchConfig, model_config: Any, seed: int = 0) -> list[Any]:
    """``cfg.num_requests`` distinct adapters (``CanonicalAdapter``) in the engine's dtype.

    The weights' values do not change the work, so one random set per rank is drawn (drawing
    normals on the CPU is slow) and adapter ``i`` scales it by ``1 + i / 64`` (steps wider than
    bf16's rounding): distinct digests, distinct pages.
    """
    from loraplex.adapter_store.format import build_adapter
    from loraplex.server.engine.models.config import parse_dtype

    dtype = parse_dtype(cfg.dtype)
    gen = torch.Generator().manual_seed(seed)
    shapes = model_config.module_shapes()
    drawn: dict[int, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}
    for rank in sorted(set(cfg.ranks)):
        drawn[rank] = {
            (layer, m): (torch.randn(rank, shapes[m][0], generator=gen) * shapes[m][0] ** -0.5,
                         torch.randn(shapes[m][1], rank, generator=gen) * 0.01)  # A, B
            for layer in range(model_config.num_layers) for m in cfg.modules}
    adapters = []
    for i in range(cfg.num_requests):
        rank = cfg.ranks[i % len(cfg.ranks)]
        factor = 1.0 + i / 64
        weights = {key: ((a * factor).to(dtype), (b * factor).to(dtype))
                   for key, (a, b) in drawn[rank].items()}
        adapters.append(build_adapter(weights, rank=rank, lora_alpha=2.0 * rank,
                                      base_config=model_config))
    if len({a.digest for a in adapters}) != len(adapters):
        raise RuntimeError("benchmark adapters are not distinct")
    return adapters


def run_engine_bench(cfg: EngineBenchConfig, deadline: float) -> Row:
    """Build the model and adapters, run the rounds until done or ``deadline``
    (``time.monotonic()``), and return one row: ``us`` holds each variant's median decode step
    in microseconds, ``speedup["lora_vs_base"]`` the throughput ratio. Errors are recorded in
    the row, never raised."""
    case: dict[str, Any] = dict(
        model=_model_name(cfg.hf_config), dtype=cfg.dtype, batch=cfg.num_requests,
        adapters=cfg.num_requests, ranks="/".join(map(str, cfg.ranks)),
        modules=",".join(m.removesuffix("_proj") for m in cfg.modules),
        prompt=cfg.prompt_len)
    row = Row("engine", case)
    try:
        with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as tmp:
            times = _run(cfg, Path(tmp) / "model", deadline, row)
    except Exception as exc:  # record and go on: the kernel rows are already written
        log.exception("engine benchmark failed")
        row.error = f"{type(exc).__name__}: {exc}"[:300]
        return row
    row.case["timed_steps"] = {k: len(v) for k, v in times.items()}
    if not times["base"] or not times["lora"]:
        row.error = row.error or "skipped: time budget"
        return row
    for variant, seconds in times.items():
        row.us[variant] = statistics.median(seconds) * 1e6
    row.speedup = {"lora_vs_base": row.us["base"] / row.us["lora"]}
    return row


def _run(cfg: EngineBenchConfig, path: Path, deadline: float, row: Row
         ) -> dict[str, list[float]]:
    from loraplex.server.config import EngineConfig, SchedulerConfig
    from loraplex.server.engine.engine import Engine
    from loraplex.server.engine.models.config import ModelConfig
    from loraplex.server.engine.models.demo import write_byte_tokenizer, write_random_llama

    start = time.monotonic()
    write_random_llama(path, cfg.hf_config, seed=0, std=0.02)
    write_byte_tokenizer(path)
    model_config = ModelConfig.from_pretrained(path)
    adapters = build_adapters(cfg, model_config)
    log.info("engine bench: model and %d adapters built in %.0f s", len(adapters),
             time.monotonic() - start)
    engine = Engine(EngineConfig(
        model=str(path), dtype=cfg.dtype, device=cfg.device, kernels="triton",
        num_pages=cfg.num_pages, max_rank=max(cfg.ranks), enable_prefix_caching=False,
        scheduler=SchedulerConfig(page_size=cfg.page_size,
                                  max_num_seqs=max(256, cfg.num_requests))),
        adapter_source=MemorySource(adapters))
    row.case["setup_s"] = round(time.monotonic() - start, 1)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model_config.vocab_size, (cfg.prompt_len,),
                             generator=gen).tolist() for _ in range(cfg.num_requests)]
    times: dict[str, list[float]] = {"base": [], "lora": []}
    try:
        for r in range(cfg.rounds):
            for variant in ("base", "lora"):
                if time.monotonic() > deadline:
                    return times
                digests = ([a.digest for a in adapters] if variant == "lora"
                           else [None] * cfg.num_requests)
                if variant == "lora" and r == 0:
                    _load_into_host_cache(engine, [a.digest for a in adapters], deadline)
                log.info("engine bench: round %d, %s", r, variant)
                times[variant] += _round(engine, f"{variant}{r}", prompts, digests, cfg,
                                         deadline)
    finally:
        if engine.adapters is not None:
            engine.adapters.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return times


def _load_into_host_cache(engine: Any, digests: list[str], deadline: float) -> None:
    adapters = engine.adapters
    for digest in digests:
        adapters.prefetch(digest)
    while not set(digests) <= set(adapters.host_digests()) and time.monotonic() < deadline:
        failures = adapters.take_failures()
        if failures:
            raise RuntimeError(next(iter(failures.values())))
        time.sleep(0.01)


def _round(engine: Any, tag: str, prompts: list[list[int]], digests: list[str | None],
           cfg: EngineBenchConfig, deadline: float) -> list[float]:
    """Run one batch of requests until ``cfg.decode_steps`` decode-only steps are timed (or the
    deadline passes), then abort them; the wall times of the timed steps."""
    from loraplex.server.engine.request import SamplingParams

    # Requests admitted in different steps start decoding at different times: headroom, so
    # that none finishes before enough steps with all of them decoding are timed.
    max_tokens = 1 + cfg.skip_steps + cfg.decode_steps + _HEADROOM_TOKENS
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt, digest in zip(ids, prompts, digests):
        engine.add_request(rid, prompt, params, adapter_digest=digest)
    sched = engine.scheduler
    times: list[float] = []
    num_decode_steps = 0
    while engine.has_unfinished():
        if time.monotonic() > deadline or len(times) == cfg.decode_steps:
            for rid in ids:
                engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
            break
        decoding = (sched.num_waiting == 0 and len(sched.running) == len(prompts)
                    and all(r.num_tokens - r.num_computed_tokens == 1 for r in sched.running))
        t0 = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - t0
        for out in outputs:
            if out.error:
                raise RuntimeError(f"request {out.request_id}: {out.error}")
        if decoding:
            num_decode_steps += 1
            if num_decode_steps > cfg.skip_steps:
                times.append(seconds)
    return times


def _model_name(hf: dict[str, Any]) -> str:
    return (f"random Llama h{hf['hidden_size']} L{hf['num_hidden_layers']} "
            f"{hf['num_attention_heads']}/{hf['num_key_value_heads']} heads "
            f"i{hf['intermediate_size']} v{hf['vocab_size']}")
