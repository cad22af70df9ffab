"""The worker's engine thread: ``engine.step()`` in a loop, outputs handed to the asyncio loop.

One thread owns ``step()``; the asyncio loop (the gRPC server's) submits and aborts requests
(the engine's thread-safe ``add_request`` / ``abort``) and receives each step's outputs in one
``call_soon_threadsafe`` callback that puts them on the requests' queues. Nothing on the
asyncio side ever blocks on the engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from loraplex.server.api import ChatMessages, WorkerRequest
from loraplex.server.engine.engine import STALLED_WAIT_SECONDS, Engine
from loraplex.server.engine.request import Request, RequestOutput
from loraplex.server.engine.stats import EngineStats

logger = logging.getLogger(__name__)

STATS_INTERVAL_SECONDS = 0.05
IDLE_WAIT_SECONDS = 0.25


class EngineLoop:
    """Drives one engine from its own thread for the requests of one asyncio loop.

    ``submit``, ``release`` and the output queues belong to the asyncio loop's thread;
    ``stats`` is refreshed by the engine thread (at most every 50 ms while busy, and whenever
    it goes idle) and may be read from anywhere.
    """

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        """Args:
            engine: the engine this thread drives.
            loop: the asyncio loop its requests' streams live on.
            on_fatal: called on ``loop`` with the reason once the engine thread has ended by
                an exception (after every request's stream was failed): the worker turns
                NOT_SERVING and its process exits.
        """
        self.engine = engine
        self._on_fatal = on_fatal
        self._loop = loop
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self.stats: EngineStats = engine.stats()
        self._stats_time = 0.0
        self.error: str | None = None  # set when step() itself failed: the worker is broken
        # Load this (the asyncio) thread's tokenizer now, not on the first request.
        if engine.tokenizer is not None:
            engine.tokenizer.for_this_thread()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread after the current step (requests still queued are dropped)."""
        self._stopping.set()
        self._wake.set()
        self._thread.join()

    def submit(self, request: WorkerRequest) -> tuple[Request, asyncio.Queue[RequestOutput]]:
        """Hand a request to the engine (asyncio thread). Its outputs arrive on the queue.

        Raises:
            ValueError: the engine refused it (the message names the field), for example a
                prompt that does not fit the context.
        """
        prompt = request.prompt
        if not isinstance(prompt, (str, ChatMessages)):
            prompt = list(prompt)
        req = self.engine.add_request(request.request_id, prompt, request.params,
                                      adapter_digest=request.adapter_digest,
                                      tenant=request.tenant)
        # Registered after add_request: outputs are dispatched on this thread, so none can be
        # delivered before this line runs.
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._wake.set()
        return req, queue

    def abort(self, request_id: str) -> None:
        """Abort a request (any thread); its pages return within one step."""
        self.engine.abort(request_id)
        self._wake.set()

    def release(self, request_id: str) -> None:
        """Forget a request's queue (asyncio thread), once its handler has ended."""
        self._queues.pop(request_id, None)

    # -- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # step() keeps failures with their requests: an engine bug
            logger.exception("engine thread failed; the worker stops serving")
            self.error = f"engine failure: {exc!r}"
            self._post(self._fail_all, self.error)

    def _serve(self) -> None:
        if self.engine.tokenizer is not None:  # the engine thread's own (detokenization)
            self.engine.tokenizer.for_this_thread()
        while not self._stopping.is_set():
            self._wake.clear()
            if not self.engine.has_unfinished():
                self._refresh_stats(force=True)
                self._wake.wait(IDLE_WAIT_SECONDS)
                continue
            outputs = self.engine.step()
            if outputs:
                self._post(self._dispatch, outputs)
            elif not self.engine.last_step_ran:  # everything waits: no spinning (engine.py)
                self._wake.wait(STALLED_WAIT_SECONDS)
            self._refresh_stats()

    def _post(self, fn: Callable[..., None], *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is gone
            self._stopping.set()

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._stats_time >= STATS_INTERVAL_SECONDS:
            self.stats = self.engine.stats()
            self._stats_time = now

    # -- the asyncio thread -----------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail_all(self, error: str) -> None:
        # Every request submitted here has a queue (in flight or still queued in the engine):
        # each ends as aborted (UNAVAILABLE: another worker may serve it) with the reason.
        for request_id, queue in self._queues.items():
            queue.put_nowait(RequestOutput(request_id, [], "", True, finish_reason="abort",
                                           error=f"{error}; the worker stops serving"))
        if self._on_fatal is not None:
            self._on_fatal(error)
