"""Render the Helm chart offline (helm-python-sdk embeds Helm v4) and look things up in it.

Shared by the chart tests: the value sets the chart is tested with, ``render`` (manifests as
dicts), and small lookups over the rendered objects.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "loraplex"
RELEASE = "lp"
NAMESPACE = "serving"

Manifest = dict[str, Any]

# Value sets every chart test runs over. Each is a deployment a user would make.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "external-redis": {
        "redis": {"enabled": False},
        "externalRedis": {"existingSecret": "loraplex-store", "secretKey": "url"},
    },
    "mig": {
        "worker": {
            "gpu": {"resourceName": "nvidia.com/mig-3g.71gb", "count": 1},
            "nodeSelector": {"nvidia.com/mig.config": "all-3g.71gb"},
        },
    },
    "autoscaling": {
        "gateway": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 8}},
    },
    "auth": {"auth": {"enabled": True, "existingSecret": "loraplex-api-keys"}},
    "everything-optional": {
        "auth": {"enabled": True, "existingSecret": "loraplex-api-keys"},
        "model": {
            "source": "initContainer",
            "path": "llama-3.1-8b",
            "configMap": "llama-3.1-8b-config",
            "initContainer": {
                "image": "registry.example.com/model-fetcher:1",
                "args": ["--to", "$(MODEL_DIR)"],
                "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                    "name": "hf-token", "key": "token"}}}],
            },
        },
        "gateway": {
            "ingress": {"enabled": True, "className": "nginx",
                        "tls": [{"secretName": "loraplex-tls",
                                 "hosts": ["loraplex.example.com"]}]},
            "grpcRoute": {"enabled": True, "hostnames": ["loraplex.example.com"],
                          "parentRefs": [{"name": "public", "namespace": "gateways"}]},
            "autoscaling": {"enabled": True},
        },
        "redis": {"auth": {"existingSecret": "loraplex-redis-password"}},
        "networkPolicy": {"gatewayFrom": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "ingress-nginx"}}}]},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "worker": {"runtimeClassName": "nvidia", "priorityClassName": "gpu-serving"},
    },
}

# The kinds the chart may render whose schemas are not part of Kubernetes itself.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"),
             ("gateway.networking.k8s.io/v1", "GRPCRoute")}


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` laid over ``base``, recursively (what ``helm --set`` does)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@functools.lru_cache(maxsize=1)
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(str(CHART))


@functools.lru_cache(maxsize=32)
def _render(values_json: str) -> tuple[tuple[str, str], ...]:
    rendered = chart().render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE)
    return tuple(sorted(rendered.items()))


def render_files(values: dict[str, Any]) -> dict[str, str]:
    """Template path -> rendered text (NOTES.txt included)."""
    return dict(_render(json.dumps(values, sort_keys=True)))


def render(values: dict[str, Any]) -> list[Manifest]:
    """Every object the chart renders with ``values``, as dicts (fresh copies)."""
    docs = []
    for path, text in render_files(values).items():
        if not path.endswith(".yaml"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def find(manifests: list[Manifest], kind: str, suffix: str = "") -> Manifest:
    """The one object of ``kind`` whose name ends with ``suffix``."""
    found = [m for m in manifests
             if m["kind"] == kind and m["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"{kind} *{suffix}: {[m['metadata']['name'] for m in found]}"
    return found[0]


def kinds(manifests: list[Manifest]) -> set[str]:
    return {m["kind"] for m in manifests}


def pod_spec(manifest: Manifest) -> dict[str, Any] | None:
    if manifest["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return manifest["spec"]["template"]["spec"]
    return None


def workloads(manifests: list[Manifest]) -> Iterator[tuple[Manifest, dict[str, Any]]]:
    for manifest in manifests:
        spec = pod_spec(manifest)
        if spec is not None:
            yield manifest, spec


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Init containers and containers of a pod spec."""
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def container(manifest: Manifest, name: str) -> dict[str, Any]:
    spec = pod_spec(manifest)
    assert spec is not None
    found = [c for c in spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"container {name} in {manifest['metadata']['name']}"
    return found[0]
