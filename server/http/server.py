"""The HTTP API's server: uvicorn on the gateway's own asyncio loop, on a socket bound here
(so port 0 reports the port it got, and a taken port fails at start, not in the background)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Generator
from typing import Any

import uvicorn

from loraplex.server.tls import ServerTls

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The gateway's commands own SIGTERM / SIGINT (drain first, then stop).
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, reuse_port=False)
    sock.set_inheritable(True)
    return sock


class HttpServer:
    """An ASGI app served by uvicorn in the running loop.

    Args:
        app: the ASGI application.
        host / port: where to listen (port 0: any free port).
        tls: serve HTTPS with this certificate (None: plain HTTP).
    """

    def __init__(self, app: Any, host: str, port: int, tls: ServerTls | None = None) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self._app = app
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    async def start(self) -> None:
        """Bind and serve; returns once the server accepts connections.

        Raises:
            OSError: the port cannot be bound. ValueError: bad TLS files.
        """
        context: ssl.SSLContext | None = self.tls.ssl_context() if self.tls else None
        sock = _bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app, lifespan="off", log_level="warning", access_log=False,
            timeout_graceful_shutdown=1,
            ssl_context_factory=(lambda _config, _default: context) if context else None)
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve([sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what failed
                raise OSError(f"http: the server on {self.url} stopped at start")
            await asyncio.sleep(0.01)
        logger.info("OpenAI HTTP API on %s", self.url)

    async def stop(self) -> None:
        """Stop accepting, give open requests a second, then close them."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), 5.0)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            await self._task
        self._server = None
        self._task = None
