"""How `barellm serve` stops on Ctrl-C (SIGINT) or SIGTERM: gracefully, within a grace period.

1. The listening socket closes (new connections are refused) and idle connections are closed; the
   requests in flight, queued ones included, go on.
2. Those that finish within the grace period (`--shutdown-timeout`) are answered in full.
3. Past it, every model's scheduler stops, and each request still running ends as docs/server.md says: a
   whole answer with 503 `server_error`, a stream with a `data: {"error": ...}` event (an Ollama stream:
   an `{"error": ...}` line) and then its end. The handlers send those themselves, so none is cut short.
4. The models are unloaded and the process exits with status 0.

A second Ctrl-C skips the wait: step 3 at once. uvicorn's own shutdown would instead cancel the
handlers' tasks after its timeout, which answers a plain-text 500, cuts a stream mid-chunk and logs a
CancelledError traceback; and it raises the signal again once it is done, which ends the process as
killed by SIGINT (status 130) rather than stopped as asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

logger = logging.getLogger("uvicorn.error")

DEFAULT_SHUTDOWN_TIMEOUT = 10.0   # seconds the requests in flight get to finish after Ctrl-C
# seconds the handlers get to send the errors that end their requests once the schedulers stopped: they
# only write what is queued for them, so this is a bound on something quick, not a second grace period
_FLUSH_SECONDS = 5.0


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the shutdown above. end_requests stops the schedulers (called from a worker
    thread: a scheduler's stop waits for its current step); grace is the grace period in seconds."""

    def __init__(self, config: uvicorn.Config, end_requests: Callable[[], None],
                 grace: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        super().__init__(config)
        self.end_requests = end_requests
        self.grace = max(0.0, grace)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's version raises the captured signal again on the way out; a stop asked for is a clean exit
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True   # the second Ctrl-C (or SIGTERM): end what runs now
        else:
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()   # closes an idle connection; a busy one closes after its response
        running = len(self.server_state.tasks)
        if running and not self.force_exit:
            logger.info("Shutting down: %d request(s) in flight get up to %g s to finish (Ctrl-C again ends "
                        "them now)", running, self.grace)
            await self._wait_for_requests(time.monotonic() + self.grace, interruptible=True)
        if self.server_state.tasks:
            logger.info("Shutting down: ending %d request(s) still running with 503 / an error event",
                        len(self.server_state.tasks))
            await asyncio.to_thread(self.end_requests)
            await self._wait_for_requests(time.monotonic() + _FLUSH_SECONDS, interruptible=False)
        for t in self.server_state.tasks:   # a handler stuck elsewhere (a model still loading): the last resort
            t.cancel(msg="the server is shutting down")
        for connection in list(self.server_state.connections):
            connection.shutdown()
        for server in self.servers:
            await server.wait_closed()
        await self.lifespan.shutdown()   # unloads the models

    async def _wait_for_requests(self, deadline: float, *, interruptible: bool) -> None:
        while self.server_state.tasks and time.monotonic() < deadline:
            if interruptible and self.force_exit:
                return
            await asyncio.sleep(0.05)
