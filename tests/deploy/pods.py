"""What a container of the rendered chart would run: its command line and environment, resolved
as the kubelet resolves them (ConfigMaps and Secrets looked up, ``$(VAR)`` expanded), and its
volumes laid out as local directories. The topology test starts real processes from this."""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.deploy.chart import Manifest, pod_spec

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: known variables are replaced, ``$$`` is ``$``, and an
    unknown reference stays as it is."""
    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return _VAR.sub(sub, text)


def secret_data(manifests: list[Manifest]) -> dict[str, dict[str, str]]:
    """The Secrets the chart renders: name -> key -> decoded value."""
    return {m["metadata"]["name"]: {k: base64.b64decode(v).decode()
                                    for k, v in m.get("data", {}).items()}
            for m in manifests if m["kind"] == "Secret"}


def config_data(manifests: list[Manifest]) -> dict[str, dict[str, str]]:
    return {m["metadata"]["name"]: dict(m.get("data", {}))
            for m in manifests if m["kind"] == "ConfigMap"}


@dataclass
class ContainerRun:
    """A container resolved for a local run.

    Attributes:
        argv: command + args, expanded.
        env: the container's environment, resolved and expanded (no other variables).
        mounts: mountPath -> (volume kind, volume source, readOnly).
    """

    argv: list[str]
    env: dict[str, str]
    mounts: dict[str, tuple[str, Any, bool]] = field(default_factory=dict)


def resolve(manifests: list[Manifest], workload: Manifest, name: str,
            secrets: dict[str, dict[str, str]], pod_name: str = "pod-0") -> ContainerRun:
    """Resolve container ``name`` of ``workload``: ``secrets`` adds Secrets the chart only
    references (an existing Secret a user creates) to those it renders."""
    spec = pod_spec(workload)
    assert spec is not None
    c = next(c for c in [*spec.get("initContainers", []), *spec["containers"]]
             if c["name"] == name)
    all_secrets = {**secret_data(manifests), **secrets}
    configs = config_data(manifests)
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        if "configMapRef" in source:
            env.update(configs[source["configMapRef"]["name"]])
        else:
            env.update(all_secrets[source["secretRef"]["name"]])
    fields = {"metadata.name": pod_name, "metadata.namespace": workload["metadata"]["namespace"],
              "status.podIP": "127.0.0.1"}
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        ref = var["valueFrom"]
        if "secretKeyRef" in ref:
            env[var["name"]] = all_secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
        elif "configMapKeyRef" in ref:
            env[var["name"]] = configs[ref["configMapKeyRef"]["name"]][
                ref["configMapKeyRef"]["key"]]
        else:
            env[var["name"]] = fields[ref["fieldRef"]["fieldPath"]]
    argv = [expand(a, env) for a in [*c.get("command", []), *c.get("args", [])]]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for claim in workload["spec"].get("volumeClaimTemplates", []):
        volumes[claim["metadata"]["name"]] = {"persistentVolumeClaim": claim["spec"]}
    mounts = {}
    for m in c.get("volumeMounts", []):
        volume = volumes[m["name"]]
        kind = next(k for k in volume if k != "name")
        mounts[m["mountPath"]] = (kind, volume[kind], bool(m.get("readOnly")))
    return ContainerRun(argv, env, mounts)


def lay_out_volumes(run: ContainerRun, root: Path, manifests: list[Manifest],
                    secrets: dict[str, dict[str, str]]) -> dict[str, Path]:
    """Make each mount a local directory under ``root``: emptyDirs and claims empty, Secrets
    and ConfigMaps with their files (as the kubelet projects them). Returns mountPath ->
    directory."""
    all_secrets = {**secret_data(manifests), **secrets}
    configs = config_data(manifests)
    out = {}
    for i, (path, (kind, source, _)) in enumerate(sorted(run.mounts.items())):
        local = root / f"{i}-{kind}{path.replace('/', '_')}"
        local.mkdir(parents=True)
        files: dict[str, str] = {}
        if kind == "secret":
            files = all_secrets[source["secretName"]]
        elif kind == "configMap":
            files = configs[source["name"]]
        if "items" in source:
            files = {item["path"]: files[item["key"]] for item in source["items"]}
        for file_name, text in files.items():
            (local / file_name).write_text(text)
        out[path] = local
    return out


def relocate(text: str, dirs: dict[str, Path]) -> str:
    """Point every path under a mount at the mount's local directory (in one pass, so a
    local directory is never relocated again)."""
    if not dirs:
        return text
    paths = "|".join(re.escape(p) for p in sorted(dirs, key=len, reverse=True))
    pattern = r"(?<![\w./-])(" + paths + r""")(?=[/\s"';:&]|$)"""
    return re.sub(pattern, lambda m: str(dirs[m.group(1)]), text)
