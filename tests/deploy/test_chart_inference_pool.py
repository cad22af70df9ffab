"""``inferencePool.enabled``: the worker pods become ``loraplex serve`` pods behind a Gateway
API Inference Extension InferencePool. Kubernetes ships no schema for the extension's kinds,
so their structure is checked here by hand (group/version, kind, the selector against the
worker pods' labels, the target port against the port ``serve`` listens on); the rest of
the release is validated strictly as in ``test_chart_render``."""

from __future__ import annotations

import os
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.chart import chart, find, kinds, merge, render
from tests.deploy.pods import resolve

pytest.importorskip("loraplex.server.commands",
                    reason="loraplex.server.commands (the gRPC service's commands) is missing")

from loraplex.server.cli import build_parser  # noqa: E402

POOL = {"inferencePool": {"enabled": True},
        "auth": {"enabled": True, "existingSecret": "loraplex-api-keys"}}
CRD_KINDS = {("inference.networking.k8s.io/v1", "InferencePool"),
             ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective")}
SECRETS = {"loraplex-api-keys": {"keys.txt": ""}}


def _worker_pod(manifests: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    workload = find(manifests, "StatefulSet", "-worker")
    return workload, workload["spec"]["template"]


def test_off_by_default_nothing_of_the_extension_renders() -> None:
    manifests = render({})
    assert not kinds(manifests) & {"InferencePool", "InferenceObjective"}
    run = resolve(manifests, find(manifests, "StatefulSet", "-worker"), "worker", SECRETS)
    assert run.argv[:4] == ["loraplex", "--log-level", "INFO", "worker"]


def test_the_pool_selects_the_serve_pods_on_their_http_port(
        monkeypatch: pytest.MonkeyPatch) -> None:
    manifests = render(POOL)
    pool = find(manifests, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["namespace"] == "serving"
    spec = pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}
    workload, pod = _worker_pod(manifests)
    selector = spec["selector"]["matchLabels"]
    labels = pod["metadata"]["labels"]
    assert selector and selector.items() <= labels.items()
    assert selector == workload["spec"]["selector"]["matchLabels"]  # exactly the worker pods
    for other, other_pod in ((m, m["spec"]["template"]) for m in manifests
                             if m["kind"] in ("StatefulSet", "Deployment") and m is not workload):
        assert not selector.items() <= other_pod["metadata"]["labels"].items(), other
    (target,) = spec["targetPorts"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert target == {"number": ports["http"]} == {"number": 8000}
    # ... the port `loraplex serve` itself takes from the rendered command and environment
    run = resolve(manifests, workload, "worker", SECRETS)
    for key in [k for k in os.environ if k.startswith("LORAPLEX_")]:
        monkeypatch.delenv(key)
    for key, value in run.env.items():
        monkeypatch.setenv(key, value)
    args = build_parser().parse_args(run.argv[1:])  # flags read their defaults from the env
    assert not getattr(args, "env_errors", None), args.env_errors
    serve = next(a for a in build_parser()._actions
                 if a.dest == "command").choices["serve"]  # type: ignore[attr-defined]
    flags = {f"LORAPLEX_{a.dest.upper()}" for a in serve._actions if a.option_strings}
    unread = {k for k in run.env if k.startswith("LORAPLEX_")} - flags - {"LORAPLEX_CACHE_DIR"}
    assert not unread, f"`loraplex serve` reads no {unread}"
    assert args.command == "serve" and args.http_port == ports["http"]
    assert args.port == ports["grpc"] and args.metrics_port == ports["metrics"]
    assert args.router_metrics is True  # the picker reads vllm:* from /metrics
    assert run.mounts[args.api_keys.rsplit("/", 1)[0]] == (
        "secret", {"secretName": "loraplex-api-keys", "defaultMode": 0o440}, True)
    epp = spec["endpointPickerRef"]
    assert epp == {"name": "lp-loraplex-pool-epp", "port": {"number": 9002},
                   "failureMode": "FailClose"}


def test_objectives_and_the_picker_config_reference_the_pool() -> None:
    values = merge(POOL, {"inferencePool": {"objectives": [
        {"name": "interactive", "priority": 10}, {"name": "batch", "priority": -1}]}})
    manifests = render(values)
    pool = find(manifests, "InferencePool")
    objectives = [m for m in manifests if m["kind"] == "InferenceObjective"]
    assert [(o["metadata"]["name"], o["spec"]["priority"]) for o in objectives] == [
        ("interactive", 10), ("batch", -1)]
    for o in objectives:
        assert o["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
        assert o["spec"]["poolRef"] == {"group": "inference.networking.k8s.io",
                                        "kind": "InferencePool",
                                        "name": pool["metadata"]["name"]}
    config = yaml.safe_load(find(manifests, "ConfigMap", "-epp-config")["data"][
        "epp-config.yaml"])
    assert (config["apiVersion"], config["kind"]) == (
        "inference.networking.x-k8s.io/v1alpha1", "EndpointPickerConfig")
    defined = {p["type"] for p in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    used = {p["pluginRef"] for p in profile["plugins"]}
    assert used <= defined and {"queue-scorer", "kv-cache-utilization-scorer",
                                "lora-affinity-scorer", "max-score-picker"} <= used


def test_no_loraplex_gateway_and_the_workers_take_its_traffic() -> None:
    manifests = render(merge(POOL, {"networkPolicy": {"gatewayFrom": [
        {"namespaceSelector": {"matchLabels": {"name": "inference-gateway"}}}]}}))
    names = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    assert not {n for n in names if n[1].endswith("-gateway")}, names
    policy = find(manifests, "NetworkPolicy", "-worker")
    (front, metrics) = policy["spec"]["ingress"]
    assert {p["port"] for p in front["ports"]} == {"grpc", "http"}
    assert front["from"] == [{"namespaceSelector": {"matchLabels": {"name":
                                                                    "inference-gateway"}}}]
    assert metrics["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    service = find(manifests, "Service", "-worker")
    assert {p["name"] for p in service["spec"]["ports"]} == {"grpc", "metrics", "http"}


@pytest.mark.parametrize("kube", ["1.29", "1.33"])
def test_the_rest_validates_strict(kube: str) -> None:
    chart().validate_schema(merge(chart().values, POOL))
    for manifest in render(POOL):
        if (manifest["apiVersion"], manifest["kind"]) in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(manifest, kube, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{manifest['kind']}/{manifest['metadata']['name']}: {exc.message}")
