"""Requests as an attacker sends them, over real gRPC on loopback: invalid UTF-8 in string
fields, oversized fields, malformed names, and bad requests without a key. Each gets a clear
status naming the field, and nothing the server logs is a traceback."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from loraplex.server.api import ServiceError
from loraplex.v1 import adapters_pb2, generation_pb2, worker_pb2
from tests.e2e.harness import Cluster, write_keys

KEYS = {"acme-key-0123456789": ("acme", False), "ops-key-0123456789": ("ops", True)}
ACME, OPS = KEYS
BAD = b"\xff\xfe\xc3\x28"  # not UTF-8, as long as each 4-byte marker below
GENERATE = "/loraplex.v1.Generation/Generate"
GENERATE_STREAM = "/loraplex.v1.Generation/GenerateStream"


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    keys = write_keys(tmp_path_factory.mktemp("keys") / "keys.txt", KEYS)
    c = Cluster(model_dir, tmp_path_factory.mktemp("store"), keys=keys)
    yield c
    c.close()


def raw_call(address: str, method: str, data: bytes, key: str | None = ACME,
             streaming: bool = False) -> tuple[grpc.StatusCode, str]:
    """Send hand-built bytes as a request (no client-side serialization) and return the
    status."""
    metadata = [("authorization", f"Bearer {key}")] if key else []
    with grpc.insecure_channel(address) as channel:
        try:
            if streaming:
                list(channel.unary_stream(method)(data, metadata=metadata, timeout=30))
            else:
                channel.unary_unary(method)(data, metadata=metadata, timeout=30)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def corrupt(message: object, marker: str) -> bytes:
    data = message.SerializeToString()  # type: ignore[attr-defined]
    assert data.count(marker.encode()) == 1
    return data.replace(marker.encode(), BAD)


def generate_request(**fields: str) -> generation_pb2.GenerateRequest:
    m = generation_pb2.GenerateRequest(adapter=fields.get("adapter", ""),
                                       request_id=fields.get("request_id", ""),
                                       text=fields.get("text", "hello"))
    m.params.max_tokens = 2
    m.params.stop.extend(fields.get("stop", "zzzz").split(","))
    return m


@pytest.mark.parametrize("field,path", [("text", "text"), ("adapter", "adapter"),
                                        ("request_id", "request_id"), ("stop", "params.stop")])
@pytest.mark.parametrize("method", [GENERATE, GENERATE_STREAM])
def test_invalid_utf8_is_invalid_argument_naming_the_field(
        cluster: Cluster, caplog: pytest.LogCaptureFixture, field: str, path: str,
        method: str) -> None:
    marker = "QQQQ"
    data = corrupt(generate_request(**{field: marker}), marker)
    with caplog.at_level(logging.INFO):
        code, message = raw_call(cluster.address, method, data,
                                 streaming=method == GENERATE_STREAM)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, message)
    assert message == f"GenerateRequest.{path}: is not valid UTF-8"
    logged = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()
              or "DecodeError" in r.getMessage()]
    assert logged == []
    # The same request, well formed, is served.
    assert raw_call(cluster.address, method, generate_request().SerializeToString(),
                    streaming=method == GENERATE_STREAM)[0] == grpc.StatusCode.OK


def test_invalid_utf8_on_the_worker_and_the_adapters_service(cluster: Cluster) -> None:
    m = worker_pb2.WorkerGenerateRequest(request_id="r1", tenant="QQQQ", text="hi")
    code, message = raw_call(cluster.workers[0].address, "/loraplex.v1.Worker/Generate",
                             corrupt(m, "QQQQ"), key=None, streaming=True)
    assert (code, message) == (grpc.StatusCode.INVALID_ARGUMENT,
                               "WorkerGenerateRequest.tenant: is not valid UTF-8")
    listing = adapters_pb2.ListAdaptersRequest(name="QQQQ")
    code, message = raw_call(cluster.address, "/loraplex.v1.Adapters/List",
                             corrupt(listing, "QQQQ"))
    assert (code, message) == (grpc.StatusCode.INVALID_ARGUMENT,
                               "ListAdaptersRequest.name: is not valid UTF-8")
    # Not protobuf at all: still INVALID_ARGUMENT, naming the message type.
    code, message = raw_call(cluster.address, GENERATE, b"\x0a\xff\xff\xff\xff\xff")
    assert (code, message) == (grpc.StatusCode.INVALID_ARGUMENT,
                               "GenerateRequest: is not a valid protobuf message")


def test_invalid_utf8_in_an_upload_names_the_field(cluster: Cluster) -> None:
    part = adapters_pb2.UploadRequest(metadata=adapters_pb2.UploadMetadata(name="QQQQ"))
    with grpc.insecure_channel(cluster.address) as channel:
        upload = channel.stream_unary("/loraplex.v1.Adapters/Upload")
        with pytest.raises(grpc.RpcError) as info:
            upload(iter([corrupt(part, "QQQQ")]),
                   metadata=[("authorization", f"Bearer {ACME}")], timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "UploadRequest.metadata.name: is not valid UTF-8"


def test_authentication_comes_before_field_validation(cluster: Cluster) -> None:
    malformed = corrupt(generate_request(text="QQQQ"), "QQQQ")
    no_prompt = generation_pb2.GenerateRequest().SerializeToString()
    bad_params = generate_request()
    bad_params.params.temperature = -1.0
    cases = [(GENERATE, malformed), (GENERATE_STREAM, no_prompt),
             (GENERATE, bad_params.SerializeToString()),
             ("/loraplex.v1.Adapters/List",
              corrupt(adapters_pb2.ListAdaptersRequest(name="QQQQ"), "QQQQ"))]
    for method, data in cases:
        for key in (None, "not-a-key"):
            code, message = raw_call(cluster.address, method, data, key=key,
                                     streaming=method == GENERATE_STREAM)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (method, key, code, message)
    # With a key, the same requests are refused for what they are.
    for method, data in cases:
        code, _ = raw_call(cluster.address, method, data, streaming=method == GENERATE_STREAM)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, method
    # Refusals before the request reached the gateway's stream still count, by cause.
    failures = {(s.labels["code"], s.labels["cause"]): s.value
                for m in cluster.gateway.registry.collect()
                if m.name == "loraplex_gateway_request_failures"
                for s in m.samples if s.name.endswith("_total")}
    assert failures[("UNAUTHENTICATED", "auth")] >= 6  # the Generation cases, twice each
    assert failures[("INVALID_ARGUMENT", "invalid")] >= 3


def test_oversized_fields_are_not_echoed(cluster: Cluster) -> None:
    # Sent as raw bytes: the Python client would refuse this stop string itself.
    data = generate_request(stop="s" * 10_000).SerializeToString()
    for method in (GENERATE, GENERATE_STREAM):
        code, message = raw_call(cluster.address, method, data,
                                 streaming=method == GENERATE_STREAM)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, message[:200])
        assert message.startswith("stop: ")
        assert len(message) < 200 and "(10000 characters)" in message
    with cluster.client(ACME) as client:
        for adapter in ("a" * 10_000, "a" * 150 + "\n"):
            with pytest.raises(ServiceError) as info:
                client.generate("hello", adapter, max_tokens=2)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert len(info.value.message) < 200


def test_names_with_newlines_nuls_and_look_alikes_are_refused(
        cluster: Cluster, adapter_dirs: dict[str, Path]) -> None:
    with cluster.client(ACME) as acme, cluster.client(OPS) as ops:
        for name in ("evil\n", "evil\x00", "\u0430lpha", "alpha\uff11", "alpha\u200b"):
            with pytest.raises(ServiceError) as info:
                acme.upload_adapter(adapter_dirs["alpha"], name)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, repr(name)
            assert "must match" in info.value.message
        for tenant in ("b\n", "b\x00", "\u0430cme", "\uff41"):  # an admin creating a tenant
            with pytest.raises(ServiceError) as info:
                ops.upload_adapter(adapter_dirs["alpha"], "alpha", tenant=tenant)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, repr(tenant)
            assert "tenant" in info.value.message
        assert acme.list_adapters() == []
        record = acme.upload_adapter(adapter_dirs["alpha"], "alpha")
        for ref in ("alpha\n", "alpha@1\n", "alpha@\uff11", "alpha@\u0661", "alpha@1\x00"):
            with pytest.raises(ServiceError) as info:
                acme.generate("hello", ref, max_tokens=2)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, repr(ref)
            with pytest.raises(ServiceError) as info:
                acme.get_adapter(ref)
            assert info.value.code in (grpc.StatusCode.INVALID_ARGUMENT,
                                       grpc.StatusCode.NOT_FOUND), repr(ref)
        assert acme.generate("hello", "alpha@1", max_tokens=2).usage.completion_tokens == 2
        assert [v.digest for v in acme.list_adapters()] == [record.digest]
