"""Connection hygiene: how long a client may take to send a request, how many connections may be open, and
what a client that half-closes its side gets.

uvicorn's h11 protocol, with these rules added (`barellm serve` runs it; server_config in app.py):

- A connection's request headers must be complete within `header_timeout` seconds of its opening, or of
  the first byte of its next request; a connection that sends nothing at all is closed then. Partial
  headers are answered 408 and closed.
- A request body must be complete within `body_timeout` seconds of its headers, and after the first
  `BODY_GRACE` seconds arrive at `min_body_rate` bytes a second on average or faster; otherwise 408 and
  close. A body that stops short of its Content-Length is caught by the same rule.
- An idle keep-alive connection is closed `keep_alive` seconds after its last response (uvicorn's own).
- A response the client does not read (the socket's buffer full) for `send_timeout` seconds drops the
  connection, and the generation with it.
- Past `max_connections` open connections, a new one is answered 503 and closed at once.
- A client that shuts down its write side after a complete request (`nc -N`, `curl --no-buffer` with
  some proxies) still gets its answer, and its generation goes on. TCP cannot tell that from a client
  that closed its socket, until the server writes: while such a request waits for its first byte of
  response, a `102 Processing` interim response goes out every `PROBE_INTERVAL` seconds (HTTP/1.1 clients
  must skip 1xx responses they did not ask for); a client that is gone answers it with a reset, and the
  next write fails, which cancels the generation as any disconnect does.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

BODY_GRACE = 5.0        # seconds before the minimum body rate applies
PROBE_INTERVAL = 1.0    # seconds between 102 interim responses to a half-closed request
TICK = 0.5              # seconds between checks of a connection's deadlines


@dataclass(frozen=True)
class Limits:
    """The connection rules (seconds; 0 turns a timeout off)."""

    header_timeout: float = 10.0
    body_timeout: float = 60.0
    min_body_rate: float = 1024.0    # bytes a second
    keep_alive: float = 5.0
    send_timeout: float = 60.0
    max_connections: int = 512


def _refusal(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's H11Protocol with the rules of the module docstring; `limits` is set by protocol_class()."""

    limits = Limits()

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._waiting_since: float | None = None   # waiting for a request's headers since
        self._got_bytes = False                    # of the request whose headers are awaited
        self._body_since: float | None = None      # a request's body has been arriving since
        self._body_bytes = 0
        self._write_paused_since: float | None = None
        self._half_closed = False
        self._last_probe = 0.0
        self._ticker: asyncio.TimerHandle | None = None

    # --- connection -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            transport.write(_refusal(503, "Service Unavailable", f"the server has {self.limits.max_connections} "
                                     "connections open, its limit; retry later", "too_many_connections"))
            transport.close()
            return
        self._waiting_since = time.monotonic()
        self._tick()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        super().connection_lost(exc)

    def _tick(self) -> None:
        self._ticker = None
        if self.transport.is_closing():
            return
        self._check(time.monotonic())
        if not self.transport.is_closing():
            self._ticker = self.loop.call_later(TICK, self._tick)

    def _check(self, now: float) -> None:
        lim = self.limits
        if self._waiting_since is not None and lim.header_timeout and now - self._waiting_since > lim.header_timeout:
            if self._got_bytes:
                self._refuse(408, "Request Timeout", f"the request headers did not arrive within "
                             f"{lim.header_timeout:g} s", "request_timeout")
            else:
                self.transport.close()   # nothing was asked: nothing to answer
            return
        if self._body_since is not None:
            took = now - self._body_since
            if lim.body_timeout and took > lim.body_timeout:
                self._refuse(408, "Request Timeout", f"the request body did not arrive within "
                             f"{lim.body_timeout:g} s", "request_timeout")
                return
            if lim.min_body_rate and took > BODY_GRACE and self._body_bytes < lim.min_body_rate * took:
                self._refuse(408, "Request Timeout", f"the request body arrives at {self._body_bytes / took:.0f} "
                             f"bytes/s; at least {lim.min_body_rate:g} are needed", "request_timeout")
                return
        if self._write_paused_since is not None and lim.send_timeout and now - self._write_paused_since > \
                lim.send_timeout:
            self.transport.abort()   # the client reads nothing: its response cannot be finished
            return
        cycle = self.cycle
        if self._half_closed and cycle is not None and not cycle.response_started and not cycle.disconnected \
                and now - self._last_probe >= PROBE_INTERVAL and self.scope.get("http_version") == "1.1":
            self._last_probe = now
            self.transport.write(b"HTTP/1.1 102 Processing\r\n\r\n")

    def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
        """Answers `status` on the raw transport and closes it; the request in progress, if any, sees a
        disconnect."""
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self.transport.close()
            return
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.write(_refusal(status, reason, message, code))
        self.transport.close()

    # --- reading ----------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._waiting_since is not None and not self._got_bytes and data:
            self._got_bytes = True
            self._waiting_since = time.monotonic()   # header_timeout runs from the request's first byte
        if self._body_since is not None:
            self._body_bytes += len(data)
        super().data_received(data)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        cycle = self.cycle
        if cycle is not before and cycle is not None:   # a request's headers are in
            self._waiting_since = None
            self._got_bytes = False
            self._body_since = time.monotonic() if cycle.more_body else None
            self._body_bytes = 0
        if self._body_since is not None and cycle is not None and not cycle.more_body:
            self._body_since = None
        if self._body_since is not None and self.conn.their_state is h11.DONE:
            self._body_since = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._body_since = None
        if not self.transport.is_closing():
            self._waiting_since = time.monotonic()   # the keep-alive timer covers the idle part
            self._got_bytes = False

    def eof_received(self) -> bool | None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.more_body:
            # the whole request is in: answer it on the open half, then close
            self._half_closed = True
            self._last_probe = time.monotonic()
            cycle.keep_alive = False
            return True
        return None   # nothing in flight, or a body cut short: asyncio closes the connection

    # --- writing ----------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        self._write_paused_since = time.monotonic()
        super().pause_writing()

    def resume_writing(self) -> None:
        self._write_paused_since = None
        super().resume_writing()


def protocol_class(limits: Limits) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn runs for these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
