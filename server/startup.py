"""Checks the server commands run before anything slow starts, so that a mistake is one clear
line and a non-zero exit (``cli.main`` prints a ``StartupError`` without a traceback) instead
of a traceback after the model has loaded, or a server that starts and refuses everyone."""

from __future__ import annotations

import errno
import socket


class StartupError(Exception):
    """A server cannot start; the message says why and names the flag that fixes it."""


def port_in_use(host: str, port: int, flag: str) -> StartupError:
    """The error for a port another process listens on."""
    return StartupError(f"{flag} {port}: {host}:{port} is already in use (another loraplex "
                        f"server?); give another port, or {flag} 0 for any free one")


def cannot_bind(host: str, port: int, flag: str) -> StartupError:
    """The error for a bind that failed after ``check_port_free`` passed (grpc says only
    "Failed to bind")."""
    return StartupError(f"{flag} {port}: cannot listen on {host}:{port} (in use by another "
                        f"process?); give another port, or {flag} 0 for any free one")


def check_port_free(host: str, port: int | None, flag: str) -> None:
    """Refuse a port another process already listens on (None and 0 always pass: none, or
    any free port). The server binds it for real later; this only makes the common mistake
    fail before the model is loaded.

    Raises:
        StartupError: naming the port and ``flag``.
    """
    if not port:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            # As the real servers do: a port left in TIME_WAIT by a stopped server is free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise port_in_use(host, port, flag) from None
                if exc.errno == errno.EACCES:
                    raise StartupError(f"{flag} {port}: not allowed to listen on it (ports "
                                       "below 1024 need privileges)") from None
                raise StartupError(f"{flag} {port}: cannot listen on {host}:{port} "
                                   f"({exc.strerror})") from None


def check_key_file(path: str | None) -> None:
    """Refuse an ``--api-keys`` file that cannot be read: a gateway started without its keys
    would refuse every call. (Once running, a file that goes missing revokes its keys until
    it is back: ``auth.KeyRing``.)

    Raises:
        StartupError: naming the file.
    """
    if path is None:
        return
    try:
        with open(path, encoding="utf-8") as f:
            f.read(1)
    except OSError as exc:
        raise StartupError(f"--api-keys {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise StartupError(f"--api-keys {path}: not a text file of key entries") from None
