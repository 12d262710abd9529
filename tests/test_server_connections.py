"""Slow, idle, half-closed and excess connections, with real sockets against the app under uvicorn with the
settings `barellm serve` uses (serve/connections.py), over a fake engine."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_server import FakeEngine, FakeModel  # noqa: E402

from barellm.serve.app import create_app, server_config  # noqa: E402
from barellm.serve.connections import Limits  # noqa: E402

FAST = Limits(header_timeout=2.0, body_timeout=30.0, min_body_rate=100.0, keep_alive=1.5, send_timeout=5.0,
              max_connections=8)


@contextlib.contextmanager
def serving(limits: Limits = FAST, **kw: Any) -> Iterator[tuple[int, Any]]:
    app = create_app(FakeModel(FakeEngine(n_slots=1, **kw)), timeout=60)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(server_config(app, port=port, log_level="warning", limits=limits))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield port, app
    finally:
        srv.should_exit = True
        thread.join(60)
        sock.close()


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    return s


def _read_all(s: socket.socket, limit: float = 20) -> bytes:
    """Everything the server sends until it closes the connection (fails past `limit` seconds)."""
    s.settimeout(limit)
    out = b""
    t0 = time.monotonic()
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk
        assert time.monotonic() - t0 < limit


def _closed_within(s: socket.socket, seconds: float) -> tuple[bytes, float]:
    t0 = time.monotonic()
    data = _read_all(s, seconds + 5)
    took = time.monotonic() - t0
    assert took < seconds + 3, f"the connection stayed open {took:.1f} s"
    return data, took


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


CHAT = json.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}).encode()


def test_connection_that_sends_nothing_is_closed() -> None:
    with serving() as (port, _):
        s = _connect(port)
        data, took = _closed_within(s, FAST.header_timeout)
        assert data == b"" and took >= FAST.header_timeout - 0.6


def test_slowloris_headers_get_408_and_close() -> None:
    with serving() as (port, _):
        socks = [_connect(port) for _ in range(5)]
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        time.sleep(0.5)
        for s in socks:
            s.sendall(b"X-a: b\r\n")   # a header line now and then, never the end
        for s in socks:
            data, _ = _closed_within(s, FAST.header_timeout)
            assert data.startswith(b"HTTP/1.1 408 "), data
            assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_body_at_one_byte_a_second_is_dropped() -> None:
    with serving() as (port, app):
        s = _connect(port)
        req = _post("/v1/chat/completions", CHAT)
        head, body = req.split(b"\r\n\r\n", 1)
        s.sendall(head + b"\r\n\r\n")
        t0 = time.monotonic()
        data = b""
        s.settimeout(1.2)
        for b in body:
            try:
                s.sendall(bytes([b]))
                data = s.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if data:
                break
            assert time.monotonic() - t0 < 20
        data += _read_all(s, 10)
        took = time.monotonic() - t0
        assert data.startswith(b"HTTP/1.1 408 "), data
        assert b"bytes/s" in data and 5 <= took < 12, took
        assert app.state.server.metrics.generated_tokens == 0


def test_body_shorter_than_its_content_length_is_dropped() -> None:
    with serving() as (port, _):
        s = _connect(port)
        s.sendall(_post("/v1/chat/completions", CHAT)[:-10])   # 10 bytes never come
        data, took = _closed_within(s, 7)
        assert data.startswith(b"HTTP/1.1 408 "), data


def test_idle_keep_alive_connection_is_closed() -> None:
    with serving() as (port, _):
        s = _connect(port)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        s.settimeout(10)
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        rest, took = _closed_within(s, FAST.keep_alive)
        assert rest == b""


def test_connections_past_the_cap_get_503() -> None:
    with serving() as (port, _):
        held = [_connect(port) for _ in range(FAST.max_connections)]
        time.sleep(0.3)
        extra = _connect(port)
        data = _read_all(extra, 10)
        assert data.startswith(b"HTTP/1.1 503 "), data
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
        for s in held:
            s.close()
        time.sleep(0.5)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200


def test_half_closed_request_is_answered_and_not_cancelled() -> None:
    with serving(delay=0.2) as (port, app):   # 5 tokens of 0.2 s: the reply comes a second after the close
        for stream in (False, True):
            body = json.loads(CHAT)
            body["stream"] = stream
            s = _connect(port)
            s.sendall(_post("/v1/chat/completions", json.dumps(body).encode()))
            s.shutdown(socket.SHUT_WR)   # as `nc -N` does
            data = _read_all(s, 30)
            head, _, rest = data.partition(b"HTTP/1.1 200 ")
            assert rest, data
            assert all(line.startswith(b"HTTP/1.1 102 ") for line in head.split(b"\r\n\r\n") if line), head
            if stream:
                assert b"data: [DONE]" in rest
            else:
                text = rest.split(b"\r\n\r\n", 1)[1]
                reply = json.loads(text)
                assert reply["usage"]["completion_tokens"] == 5
        assert app.state.server.metrics.finished.get("cancelled", 0) == 0


def test_closed_client_of_a_whole_response_is_still_cancelled() -> None:
    # a full close looks like a half-close to TCP until the server writes: the 102 probe finds it out
    with serving(delay=0.1) as (port, app):
        body = json.dumps({"messages": [{"role": "user", "content": "hello"}]}).encode()   # the whole context
        s = _connect(port)
        s.sendall(_post("/v1/chat/completions", body))
        time.sleep(0.3)
        s.close()
        t0 = time.monotonic()
        while app.state.server.metrics.finished.get("cancelled", 0) == 0:
            assert time.monotonic() - t0 < 8, "the generation went on after the client closed"
            time.sleep(0.1)


def test_two_host_headers_over_a_socket() -> None:
    with serving() as (port, _):
        s = _connect(port)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nHost: other.example\r\n\r\n")
        data = _read_all(s, 10)
        assert data.startswith(b"HTTP/1.1 400 "), data
