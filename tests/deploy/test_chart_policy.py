"""Policy on the rendered objects, for every value set: GPUs, probes, the restricted pod
security level, disruption budgets, network policies, secrets, rollouts and draining."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from tests.deploy.chart import (
    VALUE_SETS,
    Manifest,
    container,
    containers,
    find,
    pod_spec,
    render,
    render_files,
    workloads,
)

SETS = sorted(VALUE_SETS)
# Volume types the "restricted" Pod Security Standard allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
CACHE_ENV = ("LORAPLEX_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "HF_HOME",
             "XDG_CACHE_HOME", "HOME")


def _values(name: str) -> dict[str, Any]:
    return VALUE_SETS[name]


def _config(manifests: list[Manifest], component: str) -> dict[str, str]:
    return find(manifests, "ConfigMap", f"-{component}")["data"]


def _pod_labels(manifest: Manifest) -> dict[str, str]:
    return manifest["spec"]["template"]["metadata"]["labels"]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# -- GPUs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SETS)
def test_workers_have_gpu_limits_and_the_gateway_none(name: str) -> None:
    manifests = render(_values(name))
    gpu = {"resourceName": "nvidia.com/gpu", "count": 1}
    gpu.update(_values(name).get("worker", {}).get("gpu", {}))
    worker = container(find(manifests, "StatefulSet", "-worker"), "worker")
    assert worker["resources"]["limits"][gpu["resourceName"]] == gpu["count"] >= 1
    if gpu["resourceName"] != "nvidia.com/gpu":  # a MIG profile instead of a whole GPU
        assert "nvidia.com/gpu" not in worker["resources"]["limits"]
    assert "memory" in worker["resources"]["limits"]
    gateway = container(find(manifests, "Deployment", "-gateway"), "gateway")
    assert not any("nvidia.com" in r for r in gateway["resources"].get("limits", {}))
    assert not any("nvidia.com" in r for r in gateway["resources"].get("requests", {}))


def test_mig_profile_and_gpu_scheduling() -> None:
    manifests = render(VALUE_SETS["mig"])
    spec = pod_spec(find(manifests, "StatefulSet", "-worker"))
    assert spec is not None
    assert spec["nodeSelector"] == {"nvidia.com/mig.config": "all-3g.71gb"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"]
    worker = container(find(manifests, "StatefulSet", "-worker"), "worker")
    assert worker["resources"]["limits"]["nvidia.com/mig-3g.71gb"] == 1


def test_tensor_parallel_size_sets_the_gpu_limit() -> None:
    manifests = render({"worker": {"engine": {"tensorParallelSize": 4}}})
    worker = container(find(manifests, "StatefulSet", "-worker"), "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert _config(manifests, "worker")["LORAPLEX_TENSOR_PARALLEL_SIZE"] == "4"


# -- probes ---------------------------------------------------------------------------------------
def _port(c: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


@pytest.mark.parametrize("name", SETS)
def test_three_probes_with_a_long_startup(name: str) -> None:
    manifests = render(_values(name))
    for kind, component, min_startup_seconds in (("StatefulSet", "worker", 15 * 60),
                                                 ("Deployment", "gateway", 60)):
        c = container(find(manifests, kind, f"-{component}"), component)
        grpc, metrics = _port(c, "grpc"), _port(c, "metrics")
        startup, ready, live = c["startupProbe"], c["readinessProbe"], c["livenessProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= min_startup_seconds
        # Readiness: standard gRPC health of the whole server (loaded, not draining).
        assert ready["grpc"] == {"port": grpc, "service": ""}
        # Liveness: the server's event loop answers (loraplex.liveness stays SERVING through
        # drain and worker outages); never the health that drain or worker state flips.
        assert live["grpc"] == {"port": grpc, "service": "loraplex.liveness"}
        assert metrics != grpc
        assert live["failureThreshold"] * live["periodSeconds"] >= 30
    worker = container(find(manifests, "StatefulSet", "-worker"), "worker")
    # The worker opens its port only once the model is loaded: startup waits for SERVING.
    assert worker["startupProbe"]["grpc"] == {"port": _port(worker, "grpc"), "service": ""}
    gateway = container(find(manifests, "Deployment", "-gateway"), "gateway")
    # The gateway's health waits for a worker; its startup must not (workers load slowly).
    assert gateway["startupProbe"]["grpc"]["service"] == "loraplex.liveness"


# -- pod security ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SETS)
def test_restricted_security_context_everywhere(name: str) -> None:
    for manifest, spec in workloads(render(_values(name))):
        where = manifest["metadata"]["name"]
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True, where
        assert pod.get("runAsUser", 1) != 0, where
        assert pod.get("seccompProfile") == {"type": "RuntimeDefault"}, where
        assert spec.get("automountServiceAccountToken") is False, where
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(flag), (where, flag)
        for volume in spec.get("volumes", []):
            kind = next(k for k in volume if k != "name")
            assert kind in RESTRICTED_VOLUMES, (where, volume)
        for c in containers(spec):
            sc = c.get("securityContext", {})
            at = f"{where}/{c['name']}"
            assert sc.get("allowPrivilegeEscalation") is False, at
            assert sc.get("readOnlyRootFilesystem") is True, at
            assert sc.get("capabilities") == {"drop": ["ALL"]}, at
            assert not sc.get("privileged"), at
            assert sc.get("runAsUser", 1) != 0, at
            assert sc.get("seccompProfile", {"type": "RuntimeDefault"}) == {
                "type": "RuntimeDefault"}, at


@pytest.mark.parametrize("name", SETS)
def test_caches_live_on_emptydirs(name: str) -> None:
    """With a read-only root filesystem every directory a process writes must be a mounted
    emptyDir: each cache variable points under one, and /tmp is one."""
    for manifest, spec in workloads(render(_values(name))):
        empty = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        for c in spec["containers"]:
            writable = [m["mountPath"] for m in c.get("volumeMounts", [])
                        if m["name"] in empty and not m.get("readOnly")]
            at = f"{manifest['metadata']['name']}/{c['name']}"
            assert "/tmp" in writable, at
            for var in c.get("env", []):
                if var["name"] in CACHE_ENV:
                    assert any(var["value"] == w or var["value"].startswith(w + "/")
                               for w in writable), (at, var)
    worker = render(_values(name))
    spec = pod_spec(find(worker, "StatefulSet", "-worker"))
    assert spec is not None
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"


# -- disruption budgets and network policies ------------------------------------------------------
@pytest.mark.parametrize("name", SETS)
def test_disruption_budgets_cover_gateway_and_workers(name: str) -> None:
    manifests = render(_values(name))
    budgets = [m for m in manifests if m["kind"] == "PodDisruptionBudget"]
    for kind, component in (("Deployment", "gateway"), ("StatefulSet", "worker")):
        labels = _pod_labels(find(manifests, kind, f"-{component}"))
        matching = [b for b in budgets if _selects(b["spec"]["selector"]["matchLabels"], labels)]
        assert len(matching) == 1, component
        assert matching[0]["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("name", SETS)
def test_network_policies(name: str) -> None:
    manifests = render(_values(name))
    policies = [m for m in manifests if m["kind"] == "NetworkPolicy"]
    gateway = _pod_labels(find(manifests, "Deployment", "-gateway"))
    worker_set = find(manifests, "StatefulSet", "-worker")
    worker = _pod_labels(worker_set)

    def policy_for(labels: dict[str, str]) -> Manifest:
        found = [p for p in policies if _selects(p["spec"]["podSelector"]["matchLabels"], labels)]
        assert len(found) == 1
        assert found[0]["spec"]["policyTypes"] == ["Ingress"]
        return found[0]

    def rule(policy: Manifest, port: str) -> dict[str, Any]:
        found = [r for r in policy["spec"]["ingress"]
                 if [p["port"] for p in r["ports"]] == [port]]
        assert len(found) == 1, port
        return found[0]

    # Only the gateway reaches the workers' gRPC port.
    peers = rule(policy_for(worker), "grpc")["from"]
    assert len(peers) == 1 and set(peers[0]) == {"podSelector"}
    assert peers[0]["podSelector"]["matchLabels"] == {
        k: gateway[k] for k in peers[0]["podSelector"]["matchLabels"]}
    assert not _selects(peers[0]["podSelector"]["matchLabels"], worker)
    # Only gateway and workers reach Redis.
    if any(m["kind"] == "StatefulSet" and m["metadata"]["name"].endswith("-redis")
           for m in manifests):
        redis = _pod_labels(find(manifests, "StatefulSet", "-redis"))
        peers = rule(policy_for(redis), "redis")["from"]
        allowed = [p["podSelector"]["matchLabels"] for p in peers]
        assert all(set(p) == {"podSelector"} for p in peers)
        assert any(_selects(s, gateway) for s in allowed)
        assert any(_selects(s, worker) for s in allowed)
        assert len(allowed) == 2
    # Every named port a policy opens exists on the pods it selects.
    for policy in policies:
        target = next(m for m, _ in workloads(manifests)
                      if _selects(policy["spec"]["podSelector"]["matchLabels"], _pod_labels(m)))
        spec = pod_spec(target)
        assert spec is not None
        names = {p["name"] for c in spec["containers"] for p in c.get("ports", [])}
        for r in policy["spec"]["ingress"]:
            assert {p["port"] for p in r["ports"]} <= names


# -- secrets --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SETS)
def test_secrets_are_referenced_never_inlined(name: str) -> None:
    manifests = render(_values(name))
    secret_values = [base64.b64decode(v).decode() for m in manifests if m["kind"] == "Secret"
                     for v in m.get("data", {}).values()]
    others = json.dumps([m for m in manifests if m["kind"] != "Secret"])
    for value in secret_values:
        assert len(value) >= 32 and value not in others
    for manifest, spec in workloads(manifests):
        for c in containers(spec):
            for var in c.get("env", []):
                at = f"{manifest['metadata']['name']}/{c['name']}/{var['name']}"
                if any(w in var["name"] for w in ("PASSWORD", "TOKEN", "SECRET", "AUTH")):
                    assert "secretKeyRef" in var.get("valueFrom", {}), at
                if var["name"] == "LORAPLEX_STORE":
                    ok = ("secretKeyRef" in var.get("valueFrom", {})
                          or var["value"].startswith("redis://:$(REDIS_PASSWORD)@"))
                    assert ok, at
                assert "LORAPLEX_API_KEY" not in var["name"], at
    for cm in (m for m in manifests if m["kind"] == "ConfigMap"):
        for key, value in cm["data"].items():
            assert "redis://" not in value and "PASSWORD" not in key, (key, value)
            assert key not in ("LORAPLEX_API_KEY_HASHES", "LORAPLEX_STORE"), key


def test_api_keys_come_from_a_mounted_secret_that_can_rotate() -> None:
    manifests = render(VALUE_SETS["auth"])
    deploy = find(manifests, "Deployment", "-gateway")
    spec = pod_spec(deploy)
    assert spec is not None
    volume = next(v for v in spec["volumes"] if "secret" in v)
    assert volume["secret"]["secretName"] == "loraplex-api-keys"
    mount = next(m for m in container(deploy, "gateway")["volumeMounts"]
                 if m["name"] == volume["name"])
    # No subPath: Kubernetes updates a Secret volume in place only without one.
    assert mount["readOnly"] and "subPath" not in mount
    key_file = _config(manifests, "gateway")["LORAPLEX_API_KEYS"]
    assert key_file == f"{mount['mountPath']}/api-keys"
    assert "LORAPLEX_ALLOW_UNAUTHENTICATED" not in _config(manifests, "gateway")
    assert not any(m["kind"] == "Secret" and "api" in m["metadata"]["name"] for m in manifests)


def test_without_auth_the_gateway_is_explicitly_keyless() -> None:
    manifests = render({})
    assert _config(manifests, "gateway")["LORAPLEX_ALLOW_UNAUTHENTICATED"] == "true"
    notes = render_files({})["loraplex/templates/NOTES.txt"]
    assert "WARNING: auth.enabled is false" in notes


def test_external_redis_url_comes_from_its_secret() -> None:
    manifests = render(VALUE_SETS["external-redis"])
    assert not any(m["metadata"]["name"].endswith("-redis") for m in manifests)
    for kind, component in (("Deployment", "gateway"), ("StatefulSet", "worker")):
        env = {v["name"]: v for v in container(find(manifests, kind, f"-{component}"),
                                               component)["env"]}
        assert env["LORAPLEX_STORE"]["valueFrom"]["secretKeyRef"] == {
            "name": "loraplex-store", "key": "url"}
        assert "REDIS_PASSWORD" not in env


def test_redis_is_durable_and_authenticated() -> None:
    manifests = render({})
    conf = find(manifests, "ConfigMap", "-redis")["data"]["redis.conf"]
    lines = {line.split()[0]: line.split(None, 1)[1] for line in conf.splitlines()
             if line and not line.startswith("#")}
    assert lines["appendonly"] == "yes" and lines["appendfsync"] == "everysec"
    assert lines["maxmemory-policy"] == "noeviction"
    assert lines["include"] == "/run/redis/auth.conf"
    redis = find(manifests, "StatefulSet", "-redis")
    claim = redis["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "data"
    mount = next(m for m in container(redis, "redis")["volumeMounts"] if m["name"] == "data")
    assert mount["mountPath"] == "/data"
    secret = find(manifests, "Secret", "-redis")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


# -- rollouts and draining ------------------------------------------------------------------------
def _sleep_seconds(c: dict[str, Any]) -> int:
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return int(command[1])


@pytest.mark.parametrize("name", SETS)
def test_rollouts_never_lose_capacity_and_drain(name: str) -> None:
    manifests = render(_values(name))
    deploy = find(manifests, "Deployment", "-gateway")
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxSurge"] >= 1
    sts = find(manifests, "StatefulSet", "-worker")
    assert sts["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    for manifest, component in ((deploy, "gateway"), (sts, "worker")):
        spec = pod_spec(manifest)
        assert spec is not None
        c = container(manifest, component)
        drain = float(_config(manifests, component)["LORAPLEX_DRAIN_GRACE"])
        assert spec["terminationGracePeriodSeconds"] >= _sleep_seconds(c) + drain


@pytest.mark.parametrize("name", SETS)
def test_gateway_finds_workers_through_the_headless_service(name: str) -> None:
    manifests = render(_values(name))
    target = _config(manifests, "gateway")["LORAPLEX_WORKERS"]
    host, port = target.rsplit(":", 1)
    service_name = host.split(".")[0]
    service = next(m for m in manifests
                   if m["kind"] == "Service" and m["metadata"]["name"] == service_name)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False
    sts = find(manifests, "StatefulSet", "-worker")
    assert sts["spec"]["serviceName"] == service_name
    assert _selects(service["spec"]["selector"], _pod_labels(sts))
    assert int(port) == _port(container(sts, "worker"), "grpc")
    assert int(_config(manifests, "worker")["LORAPLEX_PORT"]) == int(port)


def test_config_changes_roll_the_pods() -> None:
    before = find(render({}), "StatefulSet", "-worker")
    after = find(render({"worker": {"engine": {"maxNumSeqs": 64}}}), "StatefulSet", "-worker")
    key = "checksum/config"
    assert (before["spec"]["template"]["metadata"]["annotations"][key]
            != after["spec"]["template"]["metadata"]["annotations"][key])


def test_images_are_separate_and_pinnable() -> None:
    digest = "sha256:" + "ab" * 32
    manifests = render({"worker": {"image": {"digest": digest}}})
    worker = container(find(manifests, "StatefulSet", "-worker"), "worker")
    gateway = container(find(manifests, "Deployment", "-gateway"), "gateway")
    assert worker["image"].endswith("@" + digest)
    assert worker["image"].split("@")[0] != gateway["image"].split(":")[0]
    assert "worker" in worker["image"] and "gateway" in gateway["image"]
