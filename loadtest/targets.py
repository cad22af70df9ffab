"""The systems a trace can be run against, behind one interface (``Target.run``):

* ``GrpcTarget``: a loraplex gateway (``loraplex serve`` or a cluster), through the asyncio
  runner; the trace's adapters are uploaded to each tenant's namespace first if missing;
* ``OpenAITarget``: an OpenAI-compatible HTTP server (loraplex's HTTP API, ``vllm serve``,
  ...) through the ``openai`` client (``openai_http``);
* ``EngineTarget``: a loraplex ``Engine`` in this process (``engine_replay``);
* ``BaselineTarget``: transformers + peft in this process with dynamic batching
  (``baseline.PeftBaseline.serve_trace``), mixed or grouped by adapter.

Each run returns a ``RunLog``, so the report treats them alike. Every target makes the same
random adapters (``AdapterSet``), so a comparison is on identical weights and work.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from loraplex.loadtest.adapters import DEFAULT_TARGETS, ensure_adapter_dirs, upload_missing
from loraplex.loadtest.records import RequestRecord, RunLog
from loraplex.loadtest.runner import RunConfig, run_grpc, trace_rate
from loraplex.loadtest.trace import Trace
from loraplex.server.client import AsyncClient
from loraplex.server.config import EngineConfig
from loraplex.server.engine.engine import resolve_model_path
from loraplex.server.engine.models.config import ModelConfig

if TYPE_CHECKING:
    from loraplex.adapter_store.directory_source import DirectoryAdapterSource
    from loraplex.server.engine.engine import Engine

SYSTEMS = ("loraplex", "loraplex-http", "openai", "loraplex-engine", "transformers-mixed",
           "transformers-grouped")


class Target(Protocol):
    """Something that serves a trace and logs it."""

    name: str

    def run(self, trace: Trace, config: RunConfig) -> RunLog: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class AdapterSet:
    """Where the random adapters of a model live, and their shape.

    Attributes:
        root: a folder of PEFT adapter directories, one per name (made on demand).
        model: the base model (a directory or ``demo``) the adapters fit.
        rank / targets / seed: as for ``adapters.write_random_adapter``.
    """

    root: Path
    model: str = "demo"
    rank: int = 8
    targets: tuple[str, ...] = DEFAULT_TARGETS
    seed: int = 0

    def model_config(self) -> ModelConfig:
        if self.model == "demo":  # its shapes, without building its weights here
            from loraplex.server.engine.models.demo import demo_model_config

            return demo_model_config()
        return ModelConfig.from_pretrained(resolve_model_path(self.model))

    def ensure(self, trace: Trace, progress: bool = False) -> dict[str, Path]:
        """Directories of every adapter ``trace`` names, written if missing."""
        names = {n for names in trace.adapters_by_tenant().values() for n in names}
        return ensure_adapter_dirs(self.root, names, self.model_config(), rank=self.rank,
                                   targets=self.targets, seed=self.seed, progress=progress)


class GrpcTarget:
    """A loraplex gateway at ``address``."""

    name = "loraplex"

    def __init__(self, address: str, adapters: AdapterSet | None, upload: bool = True) -> None:
        self.address = address
        self.adapters = adapters
        self.upload = upload

    def run(self, trace: Trace, config: RunConfig) -> RunLog:
        self.upload_missing(trace, config)
        return asyncio.run(run_grpc(trace, self.address, config))

    def upload_missing(self, trace: Trace, config: RunConfig) -> None:
        """Upload the adapters ``trace`` names that its tenants do not have yet."""
        if self.adapters is not None and self.upload:
            dirs = self.adapters.ensure(trace, config.progress)
            asyncio.run(self._upload(trace, config, dirs))

    async def _upload(self, trace: Trace, config: RunConfig, dirs: dict[str, Path]) -> None:
        default = AsyncClient(self.address, api_key=config.default_api_key)
        clients = {t: AsyncClient(self.address, api_key=k) for t, k in config.api_keys}
        try:
            await upload_missing(clients, default, trace.adapters_by_tenant(), dirs,
                                 config.progress)
        finally:
            for client in [default, *clients.values()]:
                await client.close()

    def close(self) -> None:
        pass


class OpenAITarget:
    """An OpenAI-compatible server at ``base_url`` (``http://host:port/v1``).

    ``loraplex-http`` is loraplex's HTTP API: the trace's adapters are first uploaded through
    the same gateway's gRPC API (``uploader``). ``openai`` is any other server (``vllm serve
    --enable-lora --lora-modules NAME=PATH ...``): it must already serve the trace's adapter
    names as models. ``base_model`` names the base model (None: the first model listed).
    """

    def __init__(self, name: str, base_url: str, base_model: str | None = None,
                 uploader: GrpcTarget | None = None) -> None:
        self.name = name
        self.base_url = base_url
        self.base_model = base_model
        self.uploader = uploader

    def run(self, trace: Trace, config: RunConfig) -> RunLog:
        try:
            from loraplex.loadtest.openai_http import base_model_name, run_openai
        except ImportError as exc:  # the openai client is a dev extra
            raise ValueError(f"system {self.name}: needs the openai package ({exc}); "
                             "pip install openai") from None

        if self.uploader is not None:
            self.uploader.upload_missing(trace, config)
        # Any of the run's keys may list the models (every tenant sees the base model).
        key = config.default_api_key or next((k for _, k in config.api_keys), None)
        model = self.base_model or asyncio.run(base_model_name(self.base_url, key))
        return asyncio.run(run_openai(trace, self.base_url, config, model, self.name))

    def close(self) -> None:
        pass


class EngineTarget:
    """A loraplex engine in this process, built on first use and kept across runs."""

    name = "loraplex-engine"

    def __init__(self, config: EngineConfig, adapters: AdapterSet | None) -> None:
        self.config = config
        self.adapters = adapters
        self._engine: Engine | None = None
        self._source: DirectoryAdapterSource | None = None

    def run(self, trace: Trace, config: RunConfig) -> RunLog:
        from loraplex.adapter_store.directory_source import DirectoryAdapterSource
        from loraplex.loadtest.engine_replay import replay_engine
        from loraplex.server.engine.engine import Engine

        names: dict[str, str] = {}
        if self.adapters is not None:
            self.adapters.ensure(trace, config.progress)
            if self._source is None:
                self._source = DirectoryAdapterSource(self.adapters.root,
                                                      self.adapters.model_config())
            else:
                self._source.refresh()
            names = self._source.names()
        if self._engine is None:
            self._engine = Engine(self.config, adapter_source=self._source)
        return replay_engine(self._engine, trace, config, names)

    def close(self) -> None:
        if self._engine is not None and self._engine.adapters is not None:
            self._engine.adapters.close()
        self._engine = None


class BaselineTarget:
    """transformers + peft in this process, dynamic batching ``policy`` (mixed | grouped)."""

    def __init__(self, model: str, adapters: AdapterSet | None, policy: str = "mixed",
                 max_batch_size: int = 16, window_s: float = 0.05,
                 max_loaded_adapters: int = 64, dtype: str = "float32",
                 device: str = "cpu") -> None:
        self.name = f"transformers-{policy}"
        self.model = model
        self.adapters = adapters
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.window_s = window_s
        self.max_loaded_adapters = max_loaded_adapters
        self.dtype = dtype
        self.device = device

    def run(self, trace: Trace, config: RunConfig) -> RunLog:
        from loraplex.loadtest.baseline import BaselineRequest, PeftBaseline
        from loraplex.server.engine.models.config import parse_dtype
        from loraplex.server.engine.tokenizer import Tokenizer

        if config.mode != "open":
            raise ValueError("the transformers baseline replays arrivals: open loop only")
        trace = config.bounded(trace)
        path = resolve_model_path(self.model)
        dirs = self.adapters.ensure(trace, config.progress) if self.adapters else {}
        pad = json.loads((Path(path) / "config.json").read_text()).get("pad_token_id") or 0
        baseline = PeftBaseline(path, dirs, self.max_loaded_adapters,
                                dtype=parse_dtype(self.dtype), device=self.device,
                                batch_size=self.max_batch_size, pad_token_id=pad)
        tokenizer = Tokenizer(path)
        # As the runners do: requests due after the sending bound are never sent, and those
        # sent get the drain time; any not begun by then is recorded CANCELLED, not dropped.
        sent = [r for r in trace.requests if r.arrival_time <= config.max_duration_s]
        requests = [BaselineRequest(r.request_id, tokenizer.encode(r.prompt)
                                    if isinstance(r.prompt, str) else list(r.prompt),
                                    r.output_len, r.adapter, r.arrival_time) for r in sent]
        run = baseline.serve_trace(requests, self.policy, self.max_batch_size, self.window_s,
                                   config.max_duration_s + config.drain_timeout_s)
        results = {res.request_id: res for res in run.results}
        records = []
        for i, (req, breq) in enumerate(zip(sent, requests)):
            rec = RequestRecord(req.request_id, req.tenant, req.adapter, req.arrival_time,
                                req.arrival_time, num_prompt_tokens=len(breq.prompt_token_ids),
                                warmup=i < config.warmup_requests)
            res = results.get(req.request_id)
            if res is None:
                rec.end_time, rec.status = run.wall_s, "CANCELLED"
                rec.error = "not served within the run's time bound"
            else:
                rec.end_time, rec.token_times = res.finish_time, list(res.token_times)
            records.append(rec)
        meta = {"system": self.name, "target": "in-process", "mode": "open",
                "rate": config.rate or trace_rate(trace), "max_batch_size": self.max_batch_size,
                "window_s": self.window_s, "adapter_loads": baseline.num_loads,
                "adapter_load_s": baseline.load_seconds, "num_batches": len(run.batches),
                "warmup_requests": config.warmup_requests, **config.meta}
        return RunLog(records, meta)

    def close(self) -> None:
        pass
