"""transformers + peft on a fixed request list: static batches of 16, mixed or grouped by adapter.

The LoRA benchmark (``benchmarks/lora_bench.py``) compares loraplex with the two ways a team
without a serving engine would serve many adapters with peft:

* **mixed**: the requests in their order, ``batch_size`` at a time, whatever their adapters;
  peft runs each batch with ``adapter_names`` (one adapter per row, ``"__base__"`` for none);
* **grouped**: the requests of one adapter together (adapters in order of first appearance),
  ``batch_size`` at a time, that adapter set active: no per-row work, but smaller batches.

Every adapter the requests use is loaded before the first batch (load time is reported apart,
not counted), and only those: peft's mixed path costs per distinct adapter in a batch, not per
adapter loaded, so loading the rest of a large adapter set would only cost memory.

``save_peft_dir`` writes a ``CanonicalAdapter`` as the PEFT directory peft loads, so both
systems serve the same weights and the same scale.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from safetensors.torch import save_file

from loraplex.adapter_store.format import CanonicalAdapter, peft_key
from loraplex.loadtest.baseline import (
    BaselineRequest,
    BaselineResult,
    BaselineRun,
    BatchTiming,
    PeftBaseline,
    static_batches,
)

STATIC_POLICIES = ("mixed", "grouped")


def save_peft_dir(adapter: CanonicalAdapter, path: str | os.PathLike[str]) -> Path:
    """Write ``adapter`` as a PEFT LoRA directory (``adapter_config.json`` and
    ``adapter_model.safetensors``); a directory already there is kept (the name is expected to
    carry the digest)."""
    path = Path(path)
    if (path / "adapter_model.safetensors").exists():
        return path
    tensors = {}
    for (layer, module), (a, b) in adapter.weights.items():
        tensors[peft_key(layer, module, "A")] = a  # [r, d_in]
        tensors[peft_key(layer, module, "B")] = b  # [d_out, r]
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": adapter.rank, "lora_alpha": adapter.lora_alpha,
        "use_rslora": adapter.use_rslora, "target_modules": list(adapter.target_modules),
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}, indent=2))
    os.replace(tmp, path)
    return path


def grouped_batches(requests: Sequence[BaselineRequest], batch_size: int
                    ) -> Iterator[list[BaselineRequest]]:
    """Requests of one adapter together (adapters in order of first appearance, requests in
    their order), at most ``batch_size`` per batch."""
    groups: dict[str, list[BaselineRequest]] = {}
    for r in requests:
        groups.setdefault(r.adapter, []).append(r)
    for group in groups.values():
        yield from static_batches(group, batch_size)


class StaticPeftBaseline(PeftBaseline):
    """transformers + peft over a fixed request list, in static batches.

    Args:
        model_path: the base model directory.
        adapter_dirs: adapter name -> PEFT directory; all of them are loaded at once.
        **kwargs: as for ``TransformersBaseline`` (``dtype``, ``batch_size``, ...).
    """

    def __init__(self, model_path: str | Path, adapter_dirs: Mapping[str, str | Path],
                 **kwargs) -> None:
        super().__init__(model_path, adapter_dirs,
                         max_loaded_adapters=max(1, len(adapter_dirs)), **kwargs)
        self._load(set(self.adapter_dirs))

    def run(self, requests: Sequence[BaselineRequest], policy: str = "mixed") -> BaselineRun:
        """Serve every request in batches of ``policy`` (``STATIC_POLICIES``); results come in
        the order served."""
        if policy == "mixed":
            batches = static_batches(requests, self.batch_size)
        elif policy == "grouped":
            batches = grouped_batches(requests, self.batch_size)
        else:
            raise ValueError(f"policy: {policy!r} is not one of {STATIC_POLICIES}")
        results: list[BaselineResult] = []
        timings: list[BatchTiming] = []
        start = time.perf_counter()
        for batch in batches:
            out, timing = self.generate_batch(batch)
            results.extend(out)
            timings.append(timing)
        return BaselineRun(results, timings, time.perf_counter() - start)


def decode_tokens_per_s(run: BaselineRun, batch_size: int | None = None) -> float:
    """Decode throughput: tokens after each batch's first over the time after its first, summed
    over the batches of ``batch_size`` requests (all batches when ``None``)."""
    chosen = [b for b in run.batches if batch_size is None or b.num_requests == batch_size]
    tokens = sum(b.num_requests * (b.num_steps - 1) for b in chosen if b.num_steps > 1)
    seconds = sum(b.decode_s for b in chosen if b.num_steps > 1)
    return tokens / seconds if seconds > 0 else float("nan")


def decode_step_rates(run: BaselineRun, batch_size: int) -> list[float]:
    """tokens/s of every decode step of the batches of ``batch_size`` requests (each step's
    time from the streamer's timestamps), comparable with loraplex's per-step rates."""
    rates: list[float] = []
    for i, batch in enumerate(run.batches):
        if batch.num_requests != batch_size:
            continue
        first = sum(b.num_requests for b in run.batches[:i])
        times = run.results[first].token_times  # one timestamp per step, shared by the batch
        rates.extend(batch_size / (t1 - t0) for t0, t1 in zip(times, times[1:]) if t1 > t0)
    return rates
