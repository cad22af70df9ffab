"""TLS on the public API: a gateway serving a CA-signed certificate over real gRPC on loopback,
clients that check it (and fail against another CA or in plaintext), mutual TLS, and the clear
errors for bad certificate files. Certificates come from the openssl CLI."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from loraplex.server.cli import main as cli_main
from loraplex.server.client import AsyncClient, Client, ServiceError
from loraplex.server.tls import ServerTls, server_tls
from tests.e2e.harness import Cluster

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="openssl CLI not installed")

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _ca(directory: Path, name: str) -> tuple[Path, Path]:
    key, cert = directory / f"{name}.key", directory / f"{name}.crt"
    _openssl("req", "-x509", *EC, "-days", "2", "-subj", f"/CN={name}", "-addext",
             "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=keyCertSign,cRLSign",
             "-keyout", str(key), "-out", str(cert))
    return cert, key


def _leaf(directory: Path, name: str, ca: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    key, csr, cert = (directory / f"{name}.key", directory / f"{name}.csr",
                      directory / f"{name}.crt")
    ext = directory / f"{name}.ext"
    ext.write_text(extensions + "\n")
    _openssl("req", "-new", *EC, "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(csr))
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert))
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tls")
    ca = _ca(d, "test-ca")
    other_ca = _ca(d, "other-ca")
    server = _leaf(d, "server", ca, "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                                    "extendedKeyUsage=serverAuth")
    client = _leaf(d, "client", ca, "extendedKeyUsage=clientAuth")
    return {"ca": ca[0], "other_ca": other_ca[0], "server_cert": server[0],
            "server_key": server[1], "client_cert": client[0], "client_key": client[1],
            "other_key": other_ca[1]}


@pytest.fixture(scope="module")
def tls_cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                certs: dict[str, Path]) -> Iterator[Cluster]:
    tls = {"tls_cert_file": str(certs["server_cert"]), "tls_key_file": str(certs["server_key"])}
    cluster = Cluster(model_dir, tmp_path_factory.mktemp("store"), gateway=tls)
    yield cluster
    cluster.close()


def test_tls_client_checks_the_server_and_generates(tls_cluster: Cluster,
                                                    certs: dict[str, Path]) -> None:
    address = tls_cluster.address
    with Client(address, api_key="", timeout=30, tls_ca_file=str(certs["ca"])) as client:
        assert client.health() == "SERVING"
        tls_text = client.generate("Hello", max_tokens=5, seed=1).text
    assert tls_text
    # a plaintext client and a client trusting another CA never get an answer
    with Client(address, api_key="", timeout=5, tls=False) as plain:
        with pytest.raises(ServiceError) as info:
            plain.generate("Hello", max_tokens=5)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    with Client(address, api_key="", timeout=5, tls_ca_file=str(certs["other_ca"])) as wrong:
        with pytest.raises(ServiceError) as info:
            wrong.generate("Hello", max_tokens=5)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_tls_async_client_and_environment(tls_cluster: Cluster, certs: dict[str, Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_TLS_CA_FILE", str(certs["ca"]))  # TLS from the environment

    async def call() -> str:
        async with AsyncClient(tls_cluster.address, api_key="", timeout=30) as client:
            return (await client.generate("Hello", max_tokens=5, seed=1)).text

    text = tls_cluster.loop.run(call())
    with Client(tls_cluster.address, api_key="", timeout=30) as client:
        assert client.generate("Hello", max_tokens=5, seed=1).text == text


def test_tls_cli_push_and_generate(tls_cluster: Cluster, certs: dict[str, Path],
                                   adapter_dirs: dict[str, Path],
                                   capsys: pytest.CaptureFixture[str]) -> None:
    server = ["--server", tls_cluster.address]
    ca = ["--tls-ca-file", str(certs["ca"])]
    assert cli_main(["adapters", "push", *server, *ca, "--name", "over-tls",
                     str(adapter_dirs["alpha"])]) == 0
    assert "pushed default/over-tls@1 sha256:" in capsys.readouterr().out
    assert cli_main(["generate", *server, *ca, "--adapter", "over-tls", "--max-tokens", "4",
                     "Hello"]) == 0
    assert "completion tokens" in capsys.readouterr().err
    assert cli_main(["adapters", "push", *server, "--name", "plain",
                     str(adapter_dirs["alpha"])]) == 1  # plaintext against TLS: refused
    assert "UNAVAILABLE" in capsys.readouterr().err
    assert cli_main(["generate", *server, "--tls-ca-file", str(certs["server_key"]) + ".absent",
                     "Hello"]) == 1
    assert "tls_ca_file: cannot read" in capsys.readouterr().err


def test_mutual_tls_requires_a_client_certificate(model_dir: Path, tmp_path: Path,
                                                  certs: dict[str, Path]) -> None:
    tls = {"tls_cert_file": str(certs["server_cert"]), "tls_key_file": str(certs["server_key"]),
           "tls_client_ca_file": str(certs["ca"])}
    cluster = Cluster(model_dir, tmp_path / "store", gateway=tls)
    try:
        with Client(cluster.address, api_key="", timeout=5,
                    tls_ca_file=str(certs["ca"])) as anonymous:
            with pytest.raises(ServiceError) as info:
                anonymous.generate("Hello", max_tokens=3)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
        with Client(cluster.address, api_key="", timeout=30, tls_ca_file=str(certs["ca"]),
                    client_cert_file=str(certs["client_cert"]),
                    client_key_file=str(certs["client_key"])) as client:
            assert client.generate("Hello", max_tokens=3).usage.completion_tokens == 3
    finally:
        cluster.close()


def test_bad_tls_files_are_named(certs: dict[str, Path], tmp_path: Path) -> None:
    cert, key = str(certs["server_cert"]), str(certs["server_key"])
    with pytest.raises(ValueError, match="are not a certificate and its key"):
        ServerTls(cert, str(certs["other_key"])).credentials()  # another key
    with pytest.raises(ValueError, match=r"tls_key_file: cannot read .*absent"):
        ServerTls(cert, str(tmp_path / "absent")).credentials()
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match="tls_cert_file: .*garbage.pem is not a PEM file"):
        ServerTls(str(garbage), key).credentials()
    with pytest.raises(ValueError, match="give both or neither"):
        server_tls(cert, None)
    with pytest.raises(ValueError, match="tls_client_ca_file: needs"):
        server_tls(None, None, str(certs["ca"]))
    assert server_tls(None, None) is None
    with pytest.raises(ValueError, match="client_cert_file and client_key_file"):
        Client("localhost:1", client_cert_file=cert)


def test_serve_refuses_bad_tls_files_before_starting(tmp_path: Path, certs: dict[str, Path],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["serve", "--port", "0", "--tls-cert-file", str(certs["server_cert"]),
                   "--tls-key-file", str(certs["other_key"]), "--store",
                   f"fs:{tmp_path / 'store'}"])
    assert rc == 2
    assert "are not a certificate and its key" in capsys.readouterr().err


def test_http_api_serves_https_with_the_same_certificate(model_dir: Path, tmp_path: Path,
                                                         certs: dict[str, Path]) -> None:
    import ssl

    import httpx2
    import openai

    tls = {"tls_cert_file": str(certs["server_cert"]), "tls_key_file": str(certs["server_key"]),
           "tls_client_ca_file": str(certs["ca"])}
    cluster = Cluster(model_dir, tmp_path / "store", gateway={**tls, "http_port": 0})
    try:
        assert cluster.http_url is not None and cluster.http_url.startswith("https://")
        trusting = ssl.create_default_context(cafile=str(certs["ca"]))
        with pytest.raises(httpx2.TransportError):  # mutual TLS: no client certificate
            httpx2.get(f"{cluster.http_url}/health", verify=trusting, timeout=5)
        with pytest.raises(httpx2.TransportError):  # plaintext to a TLS port
            httpx2.get(cluster.http_url.replace("https://", "http://") + "/health", timeout=5)
        trusting.load_cert_chain(str(certs["client_cert"]), str(certs["client_key"]))
        client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused",
                               max_retries=0,
                               http_client=httpx2.Client(verify=trusting, timeout=30))
        reply = client.completions.create(model="base", prompt="Hello", max_tokens=3,
                                          extra_body={"ignore_eos": True})
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        other = ssl.create_default_context(cafile=str(certs["other_ca"]))
        with pytest.raises(httpx2.TransportError):  # the server is checked too
            httpx2.get(f"{cluster.http_url}/health", verify=other, timeout=5)
    finally:
        cluster.close()
