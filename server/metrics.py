"""Prometheus metrics of the gateway and the workers, served as text on ``/metrics``.

Each server owns a ``CollectorRegistry`` (``loraplex serve`` shares one between its gateway and
worker), so several servers can live in one process. Request counters and latency histograms
are updated as requests go; the worker's engine gauges and counters are read from its latest
``EngineStats`` snapshot at scrape time.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from loraplex.server.engine.stats import EngineStats
from loraplex.server.startup import port_in_use

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)


class RequestMetrics:
    """Per-request series shared by the gateway and the worker (``prefix`` tells them apart).

    Series:
        ``<prefix>_requests_total{tenant,code}``: requests by final gRPC status.
        ``<prefix>_request_failures_total{code,cause}``: requests that did not end OK, by
        status and cause (see ``docs/operations.md`` for the causes).
        ``<prefix>_ttft_seconds``, ``<prefix>_itl_seconds``, ``<prefix>_e2e_seconds``.
    """

    def __init__(self, prefix: str, registry: CollectorRegistry) -> None:
        self.requests = Counter(f"{prefix}_requests", "Requests by tenant and final gRPC status",
                                ["tenant", "code"], registry=registry)
        self.failures = Counter(f"{prefix}_request_failures",
                                "Requests that did not end OK, by final gRPC status and cause",
                                ["code", "cause"], registry=registry)
        self.ttft = Histogram(f"{prefix}_ttft_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram(f"{prefix}_itl_seconds", "Inter-token latency",
                             buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram(f"{prefix}_e2e_seconds", "Request latency, first byte to last token",
                             buckets=LATENCY_BUCKETS, registry=registry)


class StreamTimer:
    """Times one request's stream: TTFT at the first token, then one ITL sample per token."""

    def __init__(self, metrics: RequestMetrics, start: float | None = None) -> None:
        self._m = metrics
        self.start = time.monotonic() if start is None else start
        self.first_token: float | None = None
        self._last = self.start

    def tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
            self._m.ttft.observe(now - self.start)
            num_tokens -= 1
        elif num_tokens:
            gap = (now - self._last) / num_tokens
            for _ in range(num_tokens):
                self._m.itl.observe(gap)
        self._last = now

    @property
    def ttft(self) -> float:
        return 0.0 if self.first_token is None else self.first_token - self.start

    def finish(self, tenant: str, code: str, cause: str = "") -> float:
        """Count the request under its final status (and, unless OK, its cause: the code's
        name in lower case when none is given); returns its end-to-end seconds."""
        elapsed = time.monotonic() - self.start
        if code == "OK":
            self._m.e2e.observe(elapsed)
        else:
            self._m.failures.labels(code=code, cause=cause or code.lower()).inc()
        self._m.requests.labels(tenant=tenant, code=code).inc()
        return elapsed


class GatewayMetrics(RequestMetrics):
    """The gateway's series: requests, latencies, router decisions, retries, workers."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__("loraplex_gateway", registry)
        self.router_decisions = Counter(
            "loraplex_router_decisions", "Routing decisions: resident (adapter in the worker's "
            "pool), host_cached (in its host cache), affinity (the digest's first-choice "
            "worker), spill (moved off a loaded first choice), least_loaded (base model)",
            ["decision"], registry=registry)
        self.retries = Counter("loraplex_gateway_retries",
                               "Requests re-sent to another worker before their first token",
                               ["reason"], registry=registry)
        self.inflight = Gauge("loraplex_gateway_inflight", "Requests in flight to each worker",
                              ["worker"], registry=registry)
        self.worker_up = Gauge("loraplex_gateway_worker_up",
                               "1 when the worker answers Status and is serving", ["worker"],
                               registry=registry)
        self.workers_lost = Counter(
            "loraplex_gateway_workers_lost", "Workers taken out of routing, by reason: "
            "transport (a call to it failed below gRPC), not_serving (it said so: Status, or a "
            "refusal of all work), unreachable (its Status poll failed), removed (gone from "
            "DNS)", ["reason"], registry=registry)
        self.quota_refusals = Counter(
            "loraplex_gateway_quota_refusals", "Requests refused RESOURCE_EXHAUSTED by their "
            "tenant's quota, by limit (max_concurrency, tokens_per_minute)",
            ["tenant", "limit"], registry=registry)
        self.uploads = Counter("loraplex_gateway_adapter_uploads",
                               "Adapter uploads by tenant and final gRPC status",
                               ["tenant", "code"], registry=registry)
        self.adapter_warms = Counter(
            "loraplex_gateway_adapter_warms", "Adapters prefetched into a worker's host cache "
            "(each upload, each put the adapter store announces, and recently routed adapters "
            "whose worker changed), by result: started, cached (resident, cached or loading "
            "there already), refused (the call failed), repeat (an announced put this gateway "
            "had just warmed there: no call)", ["result"], registry=registry)


class WorkerMetrics(RequestMetrics):
    """The worker's series: requests and latencies, plus the engine's state read at scrape
    time from ``snapshot()`` (the latest ``EngineStats`` and the queue depth)."""

    def __init__(self, registry: CollectorRegistry,
                 snapshot: Callable[[], tuple[EngineStats, int] | None]) -> None:
        super().__init__("loraplex_worker", registry)
        self.queue_time = Histogram("loraplex_worker_queue_seconds",
                                    "Time from admission to first scheduled",
                                    buckets=LATENCY_BUCKETS, registry=registry)
        registry.register(_EngineCollector(snapshot))


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], tuple[EngineStats, int] | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snap = self._snapshot()
        if snap is None:
            return
        s, queue_depth = snap
        yield GaugeMetricFamily("loraplex_worker_queue_depth", "Requests admitted, not running",
                                value=queue_depth)
        yield GaugeMetricFamily("loraplex_worker_running", "Requests running",
                                value=s.num_running)
        pages = GaugeMetricFamily("loraplex_worker_pages", "Pages of the unified pool by kind",
                                  labels=["kind"])
        for kind, n in (("free", s.pages.num_free), ("kv", s.pages.num_kv),
                        ("adapter", s.pages.num_adapter), ("prefix", s.pages.num_prefix)):
            pages.add_metric([kind], n)
        yield pages
        yield GaugeMetricFamily("loraplex_worker_adapters_resident",
                                "Adapters with pages in the pool", value=len(s.resident_adapters))
        yield GaugeMetricFamily("loraplex_worker_adapters_host",
                                "Adapters in the host cache", value=len(s.host_adapters))
        counters = (
            ("loraplex_worker_preemptions", "Requests preempted (recomputed later)",
             s.num_preemptions),
            ("loraplex_worker_steps", "Engine steps run", s.num_steps),
            ("loraplex_worker_adapter_loads",
             "Adapter loads from the adapter store into the host cache", s.adapter_loads),
            ("loraplex_worker_adapter_load_seconds",
             "Seconds the loader threads spent loading adapters into the host cache",
             s.adapter_load_seconds),
            ("loraplex_worker_adapter_copies_in",
             "Adapter copies from the host cache into pool pages, made by engine steps",
             s.adapter_copies_in),
            ("loraplex_worker_adapter_copy_in_seconds",
             "Seconds engine steps spent copying adapters into pages (CUDA: issuing the copies)",
             s.adapter_copy_in_seconds),
            ("loraplex_worker_adapter_load_failures", "Adapter loads that failed",
             s.adapter_load_failures),
            ("loraplex_worker_adapter_warm_loads",
             "Host-cache loads started ahead of any request (the gateway's Prefetch of an upload)",
             s.adapter_warm_loads),
            ("loraplex_worker_adapter_warm_dropped",
             "Warm loads dropped because the host cache had no room without evicting",
             s.adapter_warm_dropped),
            ("loraplex_worker_adapter_evictions", "Adapters evicted from the pool",
             s.adapter_evictions),
            ("loraplex_worker_page_evictions", "Pages evicted by the pager",
             s.pages.num_evictions),
            ("loraplex_worker_grammar_compiles", "Structured-output grammars compiled",
             s.grammar_compiles),
            ("loraplex_worker_grammar_compile_failures",
             "Grammars that failed to compile or took too long", s.grammar_compile_failures),
            ("loraplex_worker_grammar_cache_hits", "Grammars served by the compile cache",
             s.grammar_cache_hits),
            ("loraplex_worker_jump_forward_tokens",
             "Output tokens appended by jump-forward (no model step each)",
             s.jump_forward_tokens),
            ("loraplex_worker_jump_forward_retokenized",
             "String jump-forward boundaries re-cut with the last sampled token",
             s.jump_forward_retokenized),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        lookups = CounterMetricFamily("loraplex_worker_adapter_lookups",
                                      "Adapter lookups by tier (host, device) and result",
                                      labels=["tier", "result"])
        lookups.add_metric(["host", "hit"], s.host_hits)
        lookups.add_metric(["host", "miss"], s.host_misses)
        lookups.add_metric(["device", "hit"], s.device_hits)
        lookups.add_metric(["device", "miss"], s.device_misses)
        yield lookups
        ratio = GaugeMetricFamily("loraplex_worker_adapter_hit_ratio",
                                  "Adapter hit rate since start by tier", labels=["tier"])
        for tier, hits, misses in (("host", s.host_hits, s.host_misses),
                                   ("device", s.device_hits, s.device_misses)):
            ratio.add_metric([tier], hits / (hits + misses) if hits + misses else 0.0)
        yield ratio
        yield from _prefix_metrics(s)
        yield from _step_time_metrics(s)
        yield from _spec_metrics(s)


def _spec_metrics(s: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Speculative decoding: draft tokens verified and accepted, verifications (a request's
    draft checked in one step), the tokens they appended, and draft tokens the cost gate
    dropped; the acceptance rate and the tokens per verification since start."""
    p = s.spec
    for name, doc, value in (
            ("loraplex_worker_spec_proposed_tokens", "Draft tokens verified",
             p.num_proposed_tokens),
            ("loraplex_worker_spec_accepted_tokens", "Draft tokens accepted",
             p.num_accepted_tokens),
            ("loraplex_worker_spec_verifications", "Drafts verified (one request, one step)",
             p.num_verifications),
            ("loraplex_worker_spec_emitted_tokens",
             "Tokens appended by verifications (accepted drafts plus one each)",
             p.num_emitted_tokens),
            ("loraplex_worker_spec_gated_tokens",
             "Draft tokens proposed but not verified (they did not pay in their step)",
             p.num_gated_tokens)):
        yield CounterMetricFamily(name, doc, value=value)
    yield GaugeMetricFamily("loraplex_worker_spec_acceptance_ratio",
                            "Accepted over verified draft tokens since start",
                            value=p.acceptance_rate)
    yield GaugeMetricFamily("loraplex_worker_spec_tokens_per_verification",
                            "Tokens appended per verified draft since start",
                            value=p.tokens_per_verification)


def _step_time_metrics(s: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Engine steps measured against the step cost model's predictions (``target_itl_ms``):
    their rates' ratio tells how well the model fits; ``steps_over_target`` how often the
    target was missed."""
    t = s.step_times
    yield CounterMetricFamily("loraplex_worker_step_seconds",
                              "Engine step time, scheduling to outputs, summed", value=t.seconds)
    yield CounterMetricFamily("loraplex_worker_step_predicted_seconds",
                              "The step cost model's predictions of the same steps, summed",
                              value=t.predicted_seconds)
    yield CounterMetricFamily("loraplex_worker_steps_over_target",
                              "Steps measured over target_itl_ms", value=t.num_over_target)
    last = GaugeMetricFamily("loraplex_worker_step_last_seconds",
                             "The latest step's time, measured and predicted", labels=["kind"])
    last.add_metric(["measured"], t.last_seconds)
    last.add_metric(["predicted"], t.last_predicted_seconds)
    yield last
    yield GaugeMetricFamily("loraplex_worker_step_cost_error_seconds",
                            "Mean |predicted - measured| step time over the model's window",
                            value=t.mean_abs_error_s)


def _prefix_metrics(s: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Prefix-cache use by tenant: prompt tokens looked up, tokens served from cached pages,
    and their ratio since start (a request counts once, at its first admission)."""
    queried = CounterMetricFamily("loraplex_worker_prefix_queried_tokens",
                                  "Prompt tokens looked up in the prefix cache, by tenant",
                                  labels=["tenant"])
    hits = CounterMetricFamily("loraplex_worker_prefix_hit_tokens",
                               "Prompt tokens served from cached pages, by tenant",
                               labels=["tenant"])
    ratio = GaugeMetricFamily("loraplex_worker_prefix_hit_ratio",
                              "Prefix-cache hit rate (hit / queried tokens) since start, by "
                              "tenant", labels=["tenant"])
    for tenant, num_queried in sorted(s.prefix_queried_tokens.items()):
        num_hit = s.prefix_hit_tokens.get(tenant, 0)
        queried.add_metric([tenant], num_queried)
        hits.add_metric([tenant], num_hit)
        ratio.add_metric([tenant], num_hit / num_queried if num_queried else 0.0)
    yield queried
    yield hits
    yield ratio


class MetricsServer:
    """``/metrics`` over HTTP on its own thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        """Raises ``StartupError`` naming ``--metrics-port`` when the port is taken."""
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise port_in_use(host, port, "--metrics-port") from None
        self.host = host
        self.port = int(self._httpd.server_port)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
