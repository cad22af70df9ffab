"""The chart exposes the gateway's OpenAI HTTP API beside gRPC: container port, Service port,
NetworkPolicy and the ``--http-port`` variable; ``gateway.httpPort: -1`` turns all off."""

from __future__ import annotations

from tests.deploy.chart import container, find, render


def _gateway_policy_ports(manifests: list) -> set[str]:
    policy = find(manifests, "NetworkPolicy", "-gateway")
    return {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}


def test_http_port_is_exposed_beside_grpc() -> None:
    manifests = render({})
    ports = {p["name"]: p for p in find(manifests, "Service", "-gateway")["spec"]["ports"]}
    assert ports["http"]["port"] == 8000 and ports["http"]["targetPort"] == "http"
    assert ports["http"]["appProtocol"] == "http" and "grpc" in ports
    c = container(find(manifests, "Deployment", "-gateway"), "gateway")
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["http"] == 8000
    config = find(manifests, "ConfigMap", "-gateway")["data"]
    assert config["LORAPLEX_HTTP_PORT"] == "8000"
    assert {"grpc", "http"} <= _gateway_policy_ports(manifests)


def test_http_settings_and_turning_it_off() -> None:
    manifests = render({"gateway": {"httpPort": 8080, "config": {
        "servedModelName": "llama-3-8b", "httpTimeoutSeconds": 120}}})
    config = find(manifests, "ConfigMap", "-gateway")["data"]
    assert config["LORAPLEX_HTTP_PORT"] == "8080"
    assert config["LORAPLEX_SERVED_MODEL_NAME"] == "llama-3-8b"
    assert config["LORAPLEX_HTTP_TIMEOUT_SECONDS"] == "120"
    ports = {p["name"]: p["port"] for p in find(manifests, "Service", "-gateway")["spec"]["ports"]}
    assert ports["http"] == 8080

    off = render({"gateway": {"httpPort": -1}})
    assert find(off, "ConfigMap", "-gateway")["data"]["LORAPLEX_HTTP_PORT"] == "-1"
    assert "http" not in {p["name"] for p in find(off, "Service", "-gateway")["spec"]["ports"]}
    c = container(find(off, "Deployment", "-gateway"), "gateway")
    assert "http" not in {p["name"] for p in c["ports"]}
    assert "http" not in _gateway_policy_ports(off)
