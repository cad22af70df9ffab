"""The chart renders, lints strict-clean and validates against the Kubernetes API schemas
(1.29 and 1.33, strict: unknown fields are errors) for every value set; the values schema and
the templates refuse what they should."""

from __future__ import annotations

import re
from typing import Any

import helm_python
import kubernetes_validate
import pytest

from tests.deploy.chart import CHART, CRD_KINDS, VALUE_SETS, chart, kinds, merge, render

KUBE_VERSIONS = ("1.29", "1.33")
WARNING = 2  # helm lint severities: 1 info, 2 warning, 3 error


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_strict_is_clean(name: str) -> None:
    for kube in KUBE_VERSIONS:
        report = helm_python.lint(str(CHART), VALUE_SETS[name], strict=True,
                                  kube_version=f"v{kube}.0")
        problems = [m for m in report["messages"] if m["severity"] >= WARNING]
        assert not problems and not report["errors"], (kube, problems, report["errors"])


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_every_manifest_validates_strict(name: str, kube: str) -> None:
    manifests = render(VALUE_SETS[name])
    assert manifests
    for manifest in manifests:
        if (manifest["apiVersion"], manifest["kind"]) in CRD_KINDS:
            continue  # no schema ships with Kubernetes; their shape is checked below
        try:
            kubernetes_validate.validate(manifest, kube, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.absolute_path)
            pytest.fail(f"{manifest['kind']}/{manifest['metadata']['name']} at {path}: "
                        f"{exc.message}")


def test_default_values_render_the_core_objects() -> None:
    found = kinds(render({}))
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "Secret", "ServiceAccount",
            "PodDisruptionBudget", "NetworkPolicy"} <= found
    assert not found & {"Ingress", "HorizontalPodAutoscaler", "ServiceMonitor", "GRPCRoute"}


def test_optional_objects_render_when_enabled() -> None:
    manifests = render(VALUE_SETS["everything-optional"])
    assert {"Ingress", "HorizontalPodAutoscaler", "ServiceMonitor", "GRPCRoute"} <= kinds(
        manifests)
    route = next(m for m in manifests if m["kind"] == "GRPCRoute")
    assert route["spec"]["parentRefs"] == [{"name": "public", "namespace": "gateways"}]
    services = {m["method"]["service"] for r in route["spec"]["rules"] for m in r["matches"]}
    assert services == {"loraplex.v1.Generation", "loraplex.v1.Adapters"}  # never Worker
    monitors = [m for m in manifests if m["kind"] == "ServiceMonitor"]
    assert len(monitors) == 2
    for monitor in monitors:
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        assert monitor["spec"]["endpoints"][0]["port"] == "metrics"


def test_every_value_is_in_the_schema() -> None:
    schema = chart().schema
    assert schema is not None

    def walk(values: Any, node: dict[str, Any], path: str) -> None:
        if not isinstance(values, dict) or "properties" not in node:
            return
        assert node.get("additionalProperties") is False, f"{path or '.'}: schema is open"
        for key, value in values.items():
            assert key in node["properties"], f"{path}.{key} is not in values.schema.json"
            walk(value, node["properties"][key], f"{path}.{key}")

    walk(chart().values, schema, "")


BAD_VALUES: dict[str, dict[str, Any]] = {
    "unknown top-level key": {"replicas": 3},
    "unknown engine flag": {"worker": {"engine": {"maxBatchSize": 8}}},
    "misspelt nested key": {"gateway": {"autoscalling": {"enabled": True}}},
    "bad dtype": {"worker": {"engine": {"dtype": "fp8"}}},
    "bad kernels": {"worker": {"engine": {"kernels": "cuda"}}},
    "bad device": {"worker": {"engine": {"device": "tpu"}}},
    "gpu utilization above 1": {"worker": {"engine": {"gpuMemoryUtilization": 1.5}}},
    "rank above 1024": {"worker": {"engine": {"maxRank": 4096}}},
    "negative pages": {"worker": {"engine": {"numPages": -1}}},
    "pages as text": {"worker": {"engine": {"numPages": "many"}}},
    "bad gpu resource name": {"worker": {"gpu": {"resourceName": "gpu"}}},
    "port out of range": {"gateway": {"port": 70000}},
    "status interval above 250 ms": {"gateway": {"config": {"statusInterval": 1.0}}},
    "load factor below 1": {"gateway": {"config": {"loadFactor": 0.5}}},
    "root uid": {"podSecurity": {"runAsUser": 0}},
    "unknown model source": {"model": {"source": "s3"}},
    "absolute model path": {"model": {"path": "/etc"}},
    "model path escaping its volume": {"model": {"path": "a/../../etc"}},
    "bad appendfsync": {"redis": {"appendfsync": "sometimes"}},
    "bad log level": {"logLevel": "verbose"},
    "secret name with a slash": {"auth": {"existingSecret": "a/b"}},
    "password as a value": {"redis": {"auth": {"password": "hunter2"}}},
    "api key as a value": {"auth": {"apiKeys": "0123"}},
    "bad image digest": {"worker": {"image": {"digest": "latest"}}},
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_schema_rejects(case: str) -> None:
    values = BAD_VALUES[case]
    with pytest.raises(helm_python.HelmValuesError):
        chart().validate_schema(merge(chart().values, values))
    with pytest.raises(helm_python.HelmError):
        render(values)


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "auth without its secret": ({"auth": {"enabled": True}}, "auth.existingSecret"),
    "no store": ({"redis": {"enabled": False}}, "externalRedis.existingSecret"),
    "two stores": ({"externalRedis": {"existingSecret": "x"}}, "not both"),
    "grace shorter than the drain": (
        {"worker": {"terminationGracePeriodSeconds": 30}}, "terminationGracePeriodSeconds"),
    "gateway grace shorter than the drain": (
        {"gateway": {"config": {"drainGrace": 120}}}, "terminationGracePeriodSeconds"),
    "autoscaling on CPU": (
        {"gateway": {"autoscaling": {"enabled": True, "metrics": [{"type": "Resource",
         "resource": {"name": "cpu", "target": {"type": "Utilization",
                                                "averageUtilization": 60}}}]}}}, "not CPU"),
    "initContainer model without config for the gateway": (
        {"model": {"source": "initContainer", "initContainer": {"image": "fetch:1"}}},
        "model.configMap"),
    "initContainer model without an image": (
        {"model": {"source": "initContainer", "configMap": "cfg"}},
        "model.initContainer.image"),
    "pvc model without a claim": ({"model": {"pvc": {"claimName": ""}}}, "claimName"),
    "tensor parallelism over MIG slices": (
        {"worker": {"engine": {"tensorParallelSize": 2},
                    "gpu": {"resourceName": "nvidia.com/mig-3g.71gb"}}}, "whole GPUs"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_templates_refuse(case: str) -> None:
    values, message = REFUSED[case]
    with pytest.raises(helm_python.HelmError, match=message):
        render(values)


def test_readme_documents_every_value() -> None:
    rows = re.findall(r"(?m)^\| `([A-Za-z0-9_.]+)` \|", (CHART / "README.md").read_text())
    documented = set(rows)

    def paths(values: Any, prefix: str) -> list[str]:
        if isinstance(values, dict) and values:
            return [p for k, v in values.items() for p in paths(v, f"{prefix}{k}.")]
        return [prefix.rstrip(".")]

    for path in paths(chart().values, ""):
        parts = path.split(".")
        ancestors = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        assert ancestors & documented, f"{path} is not in the chart README's values table"
    for row in documented:
        node: Any = chart().values
        for part in row.split("."):
            assert isinstance(node, dict) and part in node, f"README documents unknown {row}"
            node = node[part]
