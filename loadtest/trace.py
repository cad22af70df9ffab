"""Request traces: what arrives when, for which tenant and adapter, with which prompt.

A trace is generated from a ``TraceConfig`` and a seed, and saved as JSONL (a header line,
then one request per line) so a run can be repeated exactly: the runner, the in-process
engine replay and the transformers baseline all read the same file.

Every random aspect draws from its own stream (``SeedSequence.spawn``): changing the rate, the
number of adapters or a length distribution leaves the others' draws unchanged, so the points
of a sweep differ only in what the sweep varies (a rate sweep replays one arrival pattern,
scaled).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from loraplex.loadtest.distributions import LengthDist, Popularity, arrival_times

TRACE_FORMAT = "loraplex-trace"
TRACE_VERSION = 1
_STREAMS = ("arrivals", "adapters", "base", "tenants", "prompt_len", "output_len", "prompt",
            "prefix", "file")


def adapter_name(index: int, prefix: str = "lt") -> str:
    """The name of the ``index``-th adapter of a trace (``lt-0007``)."""
    return f"{prefix}-{index:04d}"


@dataclass(frozen=True)
class TraceConfig:
    """How to generate a trace. Validated at construction (``ValueError`` names the field).

    Attributes:
        num_requests: requests in the trace.
        rate: mean arrival rate in requests/s (``inf``: all at time 0).
        burstiness: Gamma shape of the inter-arrival gaps; 1 is Poisson, < 1 burstier.
        adapters: popularity spec (``zipf:1``, ``uniform``, ``identical``, ``distinct``,
            ``skewed:0.9``), see ``distributions.Popularity``.
        num_adapters: adapters to draw from (0: every request uses the base model).
        adapter_prefix: adapters are named ``<prefix>-0000``, ``<prefix>-0001``, ...
        base_fraction: fraction of requests for the base model (no adapter).
        prompt_len / output_len: length specs (``uniform:32:128``, ...); with shared prefixes,
            ``prompt_len`` is the length after the prefix.
        max_prompt_len / max_output_len: lengths are clipped to these.
        prompts_file: JSONL rows (``prompt`` text or token ids, or ``prompt_len``; optionally
            ``output_len``) or a text file of one prompt per line, drawn with replacement
            instead of ``prompt_len`` (and ``output_len`` where a row has one).
        tenants: (tenant, weight) pairs; each request's tenant is drawn by weight.
        prefix_len: tokens of a shared system prompt put before each prompt (0: none).
        num_prefixes: distinct shared prefixes, each request drawing one uniformly.
        vocab_size: random prompt token ids are drawn from ``[0, vocab_size)``.
        seed: the one seed of everything random.
    """

    num_requests: int = 100
    rate: float = 1.0
    burstiness: float = 1.0
    adapters: str = "zipf:1"
    num_adapters: int = 8
    adapter_prefix: str = "lt"
    base_fraction: float = 0.0
    prompt_len: str = "uniform:32:128"
    output_len: str = "uniform:16:64"
    max_prompt_len: int = 1024
    max_output_len: int = 512
    prompts_file: str | None = None
    tenants: tuple[tuple[str, float], ...] = (("default", 1.0),)
    prefix_len: int = 0
    num_prefixes: int = 1
    vocab_size: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenants", tuple((str(t), float(w)) for t, w in self.tenants))
        if self.num_requests < 1:
            raise ValueError(f"num_requests: must be >= 1, got {self.num_requests}")
        if not self.rate > 0:
            raise ValueError(f"rate: must be > 0 requests/s, got {self.rate}")
        if not self.burstiness > 0 or math.isinf(self.burstiness):
            raise ValueError(f"burstiness: must be finite and > 0, got {self.burstiness}")
        Popularity.parse(self.adapters)
        for name in ("prompt_len", "output_len"):
            try:
                LengthDist.parse(getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        if self.num_adapters < 0:
            raise ValueError(f"num_adapters: must be >= 0, got {self.num_adapters}")
        if not 0.0 <= self.base_fraction <= 1.0:
            raise ValueError(f"base_fraction: must be in [0, 1], got {self.base_fraction}")
        for name in ("max_prompt_len", "max_output_len", "num_prefixes", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len: must be >= 0, got {self.prefix_len}")
        if not self.tenants or any(not t or not w > 0 for t, w in self.tenants):
            raise ValueError("tenants: need at least one (name, weight > 0) pair")
        if len({t for t, _ in self.tenants}) != len(self.tenants):
            raise ValueError("tenants: names must be distinct")
        if self.prompts_file is not None and not Path(self.prompts_file).is_file():
            raise ValueError(f"prompts_file: {self.prompts_file} is not a file")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tenants"] = [list(t) for t in self.tenants]
        d["rate"] = None if math.isinf(self.rate) else self.rate
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TraceConfig:
        d = dict(d)
        d["tenants"] = tuple(tuple(t) for t in d.get("tenants", [("default", 1.0)]))
        d["rate"] = math.inf if d.get("rate") is None else d["rate"]
        return cls(**d)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_time: seconds after the start of the run.
        adapter: the adapter's name, ``""`` for the base model.
        prompt: token ids (the shared prefix included) or text.
        output_len: tokens to generate (``max_tokens``, EOS ignored).
        prefix_id: which of the trace's shared prefixes the prompt starts with.
    """

    request_id: str
    arrival_time: float
    tenant: str
    adapter: str
    prompt: tuple[int, ...] | str
    output_len: int
    prefix_id: int | None = None

    @property
    def prompt_len(self) -> int | None:
        """Prompt tokens (None for a text prompt: the server's tokenizer decides)."""
        return None if isinstance(self.prompt, str) else len(self.prompt)


@dataclass(frozen=True)
class Trace:
    """A sequence of requests in arrival order, with how it was made."""

    requests: tuple[TraceRequest, ...]
    config: TraceConfig | None = None
    prefixes: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration(self) -> float:
        """The last arrival time."""
        return self.requests[-1].arrival_time if self.requests else 0.0

    def tenants(self) -> list[str]:
        return sorted({r.tenant for r in self.requests})

    def adapters_by_tenant(self) -> dict[str, list[str]]:
        """Adapter names each tenant uses (each must exist in that tenant's namespace)."""
        out: dict[str, set[str]] = {}
        for r in self.requests:
            if r.adapter:
                out.setdefault(r.tenant, set()).add(r.adapter)
        return {t: sorted(names) for t, names in sorted(out.items())}

    def head(self, n: int) -> Trace:
        """The first ``n`` requests."""
        return replace(self, requests=self.requests[:n])

    def scaled(self, rate: float) -> Trace:
        """The same trace with arrival times scaled to mean ``rate`` requests/s (needs the
        generating config's rate)."""
        if self.config is None or math.isinf(self.config.rate):
            raise ValueError("scaled: the trace has no finite generating rate")
        if math.isinf(rate):
            factor = 0.0
        else:
            factor = self.config.rate / rate
        reqs = tuple(replace(r, arrival_time=r.arrival_time * factor) for r in self.requests)
        return replace(self, requests=reqs, config=replace(self.config, rate=rate))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace as JSONL: a header, then one request per line."""
        header = {"format": TRACE_FORMAT, "version": TRACE_VERSION,
                  "config": self.config.to_dict() if self.config else None,
                  "prefixes": [list(p) for p in self.prefixes],
                  "num_requests": len(self.requests)}
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(header) + "\n")
            for r in self.requests:
                f.write(json.dumps(self._line(r)) + "\n")

    def _line(self, r: TraceRequest) -> dict:
        prompt: list[int] | str
        if isinstance(r.prompt, str):
            prompt = r.prompt
        else:
            skip = len(self.prefixes[r.prefix_id]) if r.prefix_id is not None else 0
            prompt = list(r.prompt[skip:])
        line = {"id": r.request_id, "t": r.arrival_time, "tenant": r.tenant,
                "adapter": r.adapter, "output_len": r.output_len, "prompt": prompt}
        if r.prefix_id is not None:
            line["prefix"] = r.prefix_id
        return line

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        """Read a trace written by ``save``.

        Raises:
            ValueError: not a trace file, or a malformed line (the line number is named).
        """
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        if not lines:
            raise ValueError(f"{path}: empty trace")
        header = json.loads(lines[0])
        if header.get("format") != TRACE_FORMAT or header.get("version") != TRACE_VERSION:
            raise ValueError(f"{path}: not a {TRACE_FORMAT} v{TRACE_VERSION} file")
        prefixes = tuple(tuple(p) for p in header.get("prefixes", []))
        requests = []
        for i, text in enumerate(lines[1:], start=2):
            try:
                d = json.loads(text)
                prefix_id = d.get("prefix")
                prompt = d["prompt"]
                if not isinstance(prompt, str):
                    prompt = (prefixes[prefix_id] if prefix_id is not None else ()) + tuple(
                        int(t) for t in prompt)
                requests.append(TraceRequest(str(d["id"]), float(d["t"]), str(d["tenant"]),
                                             str(d["adapter"]), prompt, int(d["output_len"]),
                                             prefix_id))
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                raise ValueError(f"{path}:{i}: malformed request ({exc})") from None
        config = TraceConfig.from_dict(header["config"]) if header.get("config") else None
        return cls(tuple(requests), config, prefixes)


def _read_prompts_file(path: str) -> list[dict]:
    rows: list[dict] = []
    with open(path, encoding="utf-8") as f:
        if not path.endswith((".jsonl", ".json")):
            return [{"prompt": line.rstrip("\n")} for line in f if line.strip()]
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not ({"prompt", "prompt_len"} & row.keys()):
                raise ValueError(f"{path}:{i}: each row needs 'prompt' or 'prompt_len'")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def generate_trace(config: TraceConfig) -> Trace:
    """The trace ``config`` describes; the same config (seed included) gives the same trace."""
    n = config.num_requests
    rngs = dict(zip(_STREAMS, (np.random.default_rng(s) for s in
                               np.random.SeedSequence(config.seed).spawn(len(_STREAMS)))))
    times = arrival_times(rngs["arrivals"], n, config.rate, config.burstiness)

    adapters = [""] * n
    if config.num_adapters > 0:
        popularity = Popularity.parse(config.adapters)
        idx = popularity.sample(rngs["adapters"], n, config.num_adapters)
        is_base = rngs["base"].random(n) < config.base_fraction
        adapters = ["" if b else adapter_name(int(k), config.adapter_prefix)
                    for k, b in zip(idx, is_base)]

    names = [t for t, _ in config.tenants]
    weights = np.array([w for _, w in config.tenants])
    tenant_idx = rngs["tenants"].choice(len(names), size=n, p=weights / weights.sum())

    prompt_lens = LengthDist.parse(config.prompt_len).sample(
        rngs["prompt_len"], n, config.max_prompt_len)
    output_lens = LengthDist.parse(config.output_len).sample(
        rngs["output_len"], n, config.max_output_len)
    prompts: list[tuple[int, ...] | str] = []
    if config.prompts_file is not None:
        rows = _read_prompts_file(config.prompts_file)
        for i, row_idx in enumerate(rngs["file"].integers(0, len(rows), size=n)):
            row = rows[int(row_idx)]
            if "output_len" in row:
                output_lens[i] = min(int(row["output_len"]), config.max_output_len)
            if "prompt" in row:
                p = row["prompt"]
                prompts.append(p if isinstance(p, str) else tuple(int(t) for t in p))
            else:
                prompt_lens[i] = min(int(row["prompt_len"]), config.max_prompt_len)
                prompts.append(())
    else:
        prompts = [()] * n
    token_rng = rngs["prompt"]
    prompts = [p if p else tuple(token_rng.integers(0, config.vocab_size, size=int(k)).tolist())
               for p, k in zip(prompts, prompt_lens)]

    prefixes: tuple[tuple[int, ...], ...] = ()
    prefix_ids: list[int | None] = [None] * n
    if config.prefix_len > 0:
        prefix_rng = rngs["prefix"]
        prefixes = tuple(tuple(prefix_rng.integers(0, config.vocab_size,
                                                   size=config.prefix_len).tolist())
                         for _ in range(config.num_prefixes))
        chosen = [int(k) for k in prefix_rng.integers(0, config.num_prefixes, size=n)]
        prefix_ids = [None if isinstance(p, str) else k for p, k in zip(prompts, chosen)]
        prompts = [p if isinstance(p, str) else prefixes[k] + p
                   for p, k in zip(prompts, chosen)]

    requests = tuple(
        TraceRequest(f"r{i:06d}", float(times[i]), names[int(tenant_idx[i])], adapters[i],
                     prompts[i], int(output_lens[i]), prefix_ids[i])
        for i in range(n))
    return Trace(requests, config, prefixes)


def merge_traces(traces: Sequence[Trace], labels: Iterable[str] | None = None) -> Trace:
    """One trace of several, in arrival order (e.g. a steady tenant and a bursty one).

    Request ids become ``<label>-<id>`` (labels default to ``t0``, ``t1``, ...) and prefix ids
    are renumbered; the result keeps no generating config.
    """
    labels = list(labels) if labels is not None else [f"t{i}" for i in range(len(traces))]
    if len(labels) != len(traces) or len(set(labels)) != len(labels):
        raise ValueError("labels: need one distinct label per trace")
    prefixes: list[tuple[int, ...]] = []
    merged: list[TraceRequest] = []
    for label, trace in zip(labels, traces):
        offset = len(prefixes)
        prefixes.extend(trace.prefixes)
        for r in trace.requests:
            pid = None if r.prefix_id is None else r.prefix_id + offset
            merged.append(replace(r, request_id=f"{label}-{r.request_id}", prefix_id=pid))
    merged.sort(key=lambda r: r.arrival_time)
    return Trace(tuple(merged), None, tuple(prefixes))
