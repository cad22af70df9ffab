"""TLS for the public gRPC and HTTP APIs, from PEM files: the gateway's server credentials
(optionally requiring client certificates) and the clients' channel credentials.

The worker API stays plaintext: it is internal to the cluster (a NetworkPolicy in the Helm
chart admits only gateways); a service mesh can add mutual TLS there.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from loraplex.server import env


def read_pem(path: str, what: str) -> bytes:
    """The bytes of a PEM file; ``ValueError`` naming ``what`` and the path otherwise."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what}: {path} is not a PEM file")
    return data


@dataclass(frozen=True)
class ServerTls:
    """The gateway's certificate chain and key, and the CA that client certificates must
    chain to (None: clients need none)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        """Read and check the files now: a key that does not match the certificate, or a file
        that is missing or not PEM, is a ``ValueError`` at start-up, not a failed handshake
        for every client later."""
        cert = read_pem(self.cert_file, "tls_cert_file")
        key = read_pem(self.key_file, "tls_key_file")
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                self.cert_file, self.key_file)
        except ssl.SSLError as exc:
            raise ValueError(f"tls_cert_file / tls_key_file: {self.cert_file} and "
                             f"{self.key_file} are not a certificate and its key "
                             f"({exc.reason or exc})") from None
        ca = None
        if self.client_ca_file:
            ca = read_pem(self.client_ca_file, "tls_client_ca_file")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=ca is not None)

    def ssl_context(self) -> ssl.SSLContext:
        """The same certificate (and client CA) for the HTTP API.

        Raises:
            ValueError: as ``credentials``.
        """
        self.credentials()  # the same checks and messages
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        if self.client_ca_file:
            ctx.load_verify_locations(self.client_ca_file)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


def server_tls(cert_file: str | None, key_file: str | None,
               client_ca_file: str | None = None) -> ServerTls | None:
    """``ServerTls`` from optional flags: both of cert and key, or neither (plaintext)."""
    if not cert_file and not key_file:
        if client_ca_file:
            raise ValueError("tls_client_ca_file: needs tls_cert_file and tls_key_file")
        return None
    if not cert_file or not key_file:
        raise ValueError("tls_cert_file and tls_key_file: give both or neither")
    return ServerTls(cert_file, key_file, client_ca_file or None)


def channel_credentials(ca_file: str | None = None, cert_file: str | None = None,
                        key_file: str | None = None) -> grpc.ChannelCredentials:
    """A client's TLS credentials: the server is checked against ``ca_file`` (default: the
    system's roots); ``cert_file`` and ``key_file`` present a client certificate."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("client_cert_file and client_key_file: give both or neither")
    ca = read_pem(ca_file, "tls_ca_file") if ca_file else None
    cert = read_pem(cert_file, "client_cert_file") if cert_file else None
    key = read_pem(key_file, "client_key_file") if key_file else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=cert)


def client_credentials(tls: bool | None = None, ca_file: str | None = None,
                       cert_file: str | None = None,
                       key_file: str | None = None) -> grpc.ChannelCredentials | None:
    """What a client connects with: None for plaintext, else TLS credentials.

    Each argument left as None reads the environment: ``LORAPLEX_TLS_CA_FILE``,
    ``LORAPLEX_CLIENT_CERT_FILE``, ``LORAPLEX_CLIENT_KEY_FILE``, and ``LORAPLEX_TLS``
    (``1``/``true``); TLS is on when asked for or when any of the files is given.
    """
    ca_file = ca_file if ca_file is not None else env.get("TLS_CA_FILE")
    cert_file = cert_file if cert_file is not None else env.get("CLIENT_CERT_FILE")
    key_file = key_file if key_file is not None else env.get("CLIENT_KEY_FILE")
    if tls is None:
        tls = (env.get("TLS") or "").lower() in ("1", "true", "yes", "on") or bool(
            ca_file or cert_file or key_file)
    if not tls:
        return None
    return channel_credentials(ca_file or None, cert_file or None, key_file or None)
