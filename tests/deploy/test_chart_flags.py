"""The chart's values map one-to-one onto the flags of ``loraplex gateway`` and
``loraplex worker``: every LORAPLEX_* variable the chart sets is a flag of the command that
reads it, every flag is set by the chart or deliberately left to its default, and the real
argument parser turns the rendered environment into the configuration the values asked for."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

import pytest

from tests.deploy.chart import VALUE_SETS, chart, find, merge, render
from tests.deploy.pods import resolve

pytest.importorskip("loraplex.server.commands",
                    reason="loraplex.server.commands (the gRPC service's commands) is missing")

from loraplex.server.cli import build_parser, engine_config_from_args  # noqa: E402

# Variables of server/env.py that are not flags.
ENV_SETTINGS = {"LORAPLEX_CACHE_DIR", "LORAPLEX_DATA_DIR"}
# Flags the chart sets from its structure rather than from a `config`/`engine` value.
CHART_MANAGED = {
    "gateway": {"host", "port", "http_port", "metrics_port", "workers", "model", "store",
                "api_keys", "allow_unauthenticated", "max_rank"},
    "worker": {"host", "port", "metrics_port", "model", "store"},
}
# Flags the chart leaves to the server's default, and why.
NOT_MAPPED = {
    "gateway": {"api_key_hashes": "keys come from the Secret mounted as a file, which rotates "
                                  "without a restart (a variable would not)",
                **{flag: "client TLS terminates at the Ingress or Gateway API route "
                         "(gateway.ingress.tls): the kubelet's gRPC probes speak plaintext"
                   for flag in ("tls_cert_file", "tls_key_file", "tls_client_ca_file")}},
    "worker": {"worker_id": "the default hostname:port is the StatefulSet pod's stable name"},
}
VALUE_MAPS = {"gateway": (("gateway", "config"),),
              "worker": (("worker", "engine"), ("worker", "config"))}


def _flags(command: str) -> dict[str, argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions
            if a.option_strings and a.dest != "help"}


def _snake(key: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()


def _value_keys(command: str) -> set[str]:
    keys = set()
    for path in VALUE_MAPS[command]:
        node: Any = chart().values
        for part in path:
            node = node[part]
        keys.update(_snake(k) for k in node)
    return keys


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_every_flag_is_mapped_exactly_once(command: str) -> None:
    flags = set(_flags(command))
    values = _value_keys(command)
    managed, skipped = CHART_MANAGED[command], set(NOT_MAPPED[command])
    assert values <= flags, f"values that are no flag of `loraplex {command}`: {values - flags}"
    assert not values & managed and not values & skipped and not managed & skipped
    missing = flags - values - managed - skipped
    assert not missing, (f"flags of `loraplex {command}` with no chart value: {missing}; add "
                         f"them to values.yaml, values.schema.json and the README")
    assert not (managed | skipped) - flags, "the chart names flags that no longer exist"


def _resolved(values: dict[str, Any], command: str) -> tuple[list[str], dict[str, str]]:
    manifests = render(values)
    kind = "Deployment" if command == "gateway" else "StatefulSet"
    secrets = {name: {"url": "redis://:x@redis.example:6379/0", "redis-password": "x" * 32}
               for name in ("loraplex-store", "loraplex-redis-password")}
    run = resolve(manifests, find(manifests, kind, f"-{command}"), command, secrets)
    return run.argv, run.env


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_rendered_variables_are_flags_of_their_command(name: str, command: str) -> None:
    argv, env = _resolved(VALUE_SETS[name], command)
    assert argv[0] == "loraplex" and command in argv
    flags = {f"LORAPLEX_{dest.upper()}" for dest in _flags(command)}
    unknown = {k for k in env if k.startswith("LORAPLEX_")} - flags - ENV_SETTINGS
    assert not unknown, f"`loraplex {command}` reads no {unknown}"


def _parse(monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str]
           ) -> argparse.Namespace:
    for key in [k for k in os.environ if k.startswith("LORAPLEX_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = build_parser().parse_args(argv[1:])
    assert not getattr(args, "env_errors", None), args.env_errors
    return args


def test_worker_values_reach_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = {"dtype": "float16", "maxNumSeqs": 64, "maxNumBatchedTokens": 4096,
              "gpuMemoryUtilization": 0.9, "hostCacheBytes": 12 << 30, "maxRank": 128,
              "numPages": 50000, "maxModelLen": 8192, "longPrefillTokenThreshold": 512,
              "maxAdaptersPerStep": 32, "scheduling": "vtc", "vtcOutputWeight": 3.0,
              "tenantWeights": "acme=2,beta=0.5", "enablePrefixCaching": False, "seed": 7}
    worker = {"maxQueue": 99, "drainGrace": 100, "routerMetrics": False,
              "metricsAdapterNames": True}
    values = {"worker": {"engine": engine, "config": worker},
              "model": {"path": "llama-3.1-8b"}}
    argv, env = _resolved(values, "worker")
    args = _parse(monkeypatch, argv, env)
    assert (args.command, args.log_level, args.host, args.port) == ("worker", "INFO", "0.0.0.0",
                                                                     50061)
    assert args.metrics_port == 9400 and args.max_queue == 99 and args.drain_grace == 100
    assert args.router_metrics is False and args.metrics_adapter_names is True
    assert args.store.startswith("redis://:") and args.model == "/models/llama-3.1-8b"
    config = engine_config_from_args(args)
    assert (config.dtype, config.device, config.max_rank, config.num_pages) == (
        "float16", "cuda", 128, 50000)
    assert config.host_cache_bytes == 12 << 30 and config.max_model_len == 8192
    assert config.gpu_memory_utilization == 0.9 and config.seed == 7
    assert config.enable_prefix_caching is False
    s = config.scheduler
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.long_prefill_token_threshold) == (
        64, 4096, 512)
    assert (s.max_adapters_per_step, s.scheduling, s.vtc_output_weight) == (32, "vtc", 3.0)
    assert dict(s.tenant_weights) == {"acme": 2.0, "beta": 0.5}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_default_engine_values_make_a_valid_config(name: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    argv, env = _resolved(VALUE_SETS[name], "worker")
    engine_config_from_args(_parse(monkeypatch, argv, env))


def test_gateway_values_reach_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    config = {"loadFactor": 1.5, "statusInterval": 0.1, "dnsRefresh": 2, "drainGrace": 40,
              "maxPromptBytes": 4096, "maxPromptTokens": 2048, "maxTokensLimit": 1024,
              "maxUploadBytes": 1 << 28}
    values = merge(VALUE_SETS["auth"], {"gateway": {"config": config,
                                                    "terminationGracePeriodSeconds": 60},
                                        "worker": {"engine": {"maxRank": 32}}})
    argv, env = _resolved(values, "gateway")
    args = _parse(monkeypatch, argv, env)
    assert (args.load_factor, args.status_interval, args.dns_refresh, args.drain_grace) == (
        1.5, 0.1, 2.0, 40.0)
    assert (args.max_prompt_bytes, args.max_prompt_tokens, args.max_tokens_limit) == (
        4096, 2048, 1024)
    assert args.max_upload_bytes == 1 << 28 and args.max_rank == 32
    assert args.workers == "lp-loraplex-worker.serving.svc.cluster.local:50061"
    assert args.api_keys == "/etc/loraplex/api-keys/api-keys"
    assert args.allow_unauthenticated is False and args.api_key_hashes is None
    assert args.model == "/models"


def test_keyless_gateway_is_allowed_explicitly(monkeypatch: pytest.MonkeyPatch) -> None:
    argv, env = _resolved({}, "gateway")
    args = _parse(monkeypatch, argv, env)
    assert args.allow_unauthenticated is True and args.api_keys is None


@pytest.mark.parametrize("source", ["demo", "smollm2"])
def test_builtin_model_on_both_sides(monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    values = {"model": {"source": source}}
    for command in ("gateway", "worker"):
        argv, env = _resolved(values, command)
        assert _parse(monkeypatch, argv, env).model == source
