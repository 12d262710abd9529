"""A server safe to expose: API key, Host allow-list, JSON-only bodies, opt-in CORS and a header size cap,
each checked against the real app under uvicorn with its production settings (over a fake engine: these
are about HTTP, not the model)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from test_server import FakeEngine, FakeModel  # noqa: E402

from barellm.serve.app import create_app, server_config  # noqa: E402
from barellm.serve.security import default_allowed_hosts, host_name  # noqa: E402

KEY = "s3cret-key-for-tests"
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


@contextlib.contextmanager
def serving(**kw: Any) -> Iterator[tuple[str, Any]]:
    """The app over a fake model under uvicorn with the settings `barellm serve` uses; yields (url, app)."""
    app = create_app(FakeModel(FakeEngine(n_slots=1)), **kw)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(server_config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        srv.should_exit = True
        thread.join(60)
        sock.close()


def _generated(app: Any) -> int:
    return app.state.server.metrics.generated_tokens


def test_api_key() -> None:
    with serving(api_key=KEY) as (url, app):
        ok = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=30)
        assert ok.chat.completions.create(model="fake-model", **CHAT).usage.completion_tokens == 3
        for key in ("wrong-key", KEY[:-1], KEY + "x"):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
            with pytest.raises(openai.AuthenticationError) as e:
                client.models.list()
            assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        for path in ("/v1/models", "/metrics", "/openapi.json"):
            r = httpx.get(url + path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error", path
            assert r.headers["www-authenticate"].startswith("Bearer")
        before = _generated(app)
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Authorization": "Basic " + KEY})
        assert r.status_code == 401 and _generated(app) == before
        # liveness stays open
        assert httpx.get(f"{url}/health").status_code == 200
    with serving() as (url, _):   # no key configured: none needed
        assert httpx.get(f"{url}/v1/models").status_code == 200


def test_host_allow_list() -> None:
    assert default_allowed_hosts("127.0.0.1") == default_allowed_hosts("::1") == default_allowed_hosts("localhost")
    assert "localhost" in default_allowed_hosts("127.0.0.1")  # type: ignore[operator]
    assert default_allowed_hosts("0.0.0.0") is None
    assert [host_name(h) for h in ("LocalHost:8080", "[::1]:80", "::1", "a.example")] == \
        ["localhost", "::1", "::1", "a.example"]
    with serving(allowed_hosts=default_allowed_hosts("127.0.0.1")) as (url, app):
        port = url.rsplit(":", 1)[1]
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
            assert httpx.get(f"{url}/v1/models", headers={"Host": host}).status_code == 200, host
        before = _generated(app)
        for host in (f"evil.example:{port}", "attacker.test", "127.0.0.1.evil.example", ""):
            r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Host": host})
            assert r.status_code == 421, host
            assert r.json()["error"]["code"] == "invalid_host"
        assert _generated(app) == before
    with serving(allowed_hosts=["llm.internal"]) as (url, _):
        assert httpx.get(f"{url}/v1/models", headers={"Host": "llm.internal:8080"}).status_code == 200
        assert httpx.get(f"{url}/v1/models").status_code == 421


def test_post_bodies_must_be_json() -> None:
    """A foreign page can POST text/plain without a preflight: such a body must never run a generation."""
    import json

    body = json.dumps(CHAT)
    with serving() as (url, app):
        before = _generated(app)
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            headers = {"Content-Type": ctype} if ctype else {}
            r = httpx.post(f"{url}/v1/chat/completions", content=body, headers=headers)
            assert r.status_code == 415, ctype
            assert r.json()["error"]["code"] == "unsupported_media_type"
        assert _generated(app) == before
        r = httpx.post(f"{url}/v1/chat/completions", content=body,
                       headers={"Content-Type": "application/json; charset=utf-8"})
        assert r.status_code == 200 and _generated(app) == before + 3


def test_cors_is_opt_in() -> None:
    origin = "https://app.example"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type, authorization"}
    with serving() as (url, _):
        r = httpx.options(f"{url}/v1/chat/completions", headers=preflight)
        assert r.status_code >= 400 and not any(k.startswith("access-control-") for k in r.headers)
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Origin": origin})
        assert r.status_code == 200 and not any(k.startswith("access-control-") for k in r.headers)
    with serving(cors_origins=[origin], api_key=KEY) as (url, _):
        r = httpx.options(f"{url}/v1/chat/completions", headers=preflight)   # no key on a preflight
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == origin
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT,
                       headers={"Origin": origin, "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        # a refusal carries the header too, so the page can read why
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Origin": origin})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == origin
        # another origin gets no grant
        r = httpx.options(f"{url}/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_header_size_is_capped() -> None:
    with serving() as (url, _):
        assert httpx.get(f"{url}/v1/models", headers={"X-Pad": "a" * 8000}).status_code == 200
        for headers in ({"X-Pad": "a" * 100_000}, {f"X-Pad-{i}": "a" * 1000 for i in range(100)}):
            try:
                r = httpx.get(f"{url}/v1/models", headers=headers)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                # the HTTP parser gave up on the block before it was complete and closed the connection,
                # which the client sees as a protocol error or, while it is still sending, a reset: refused too
                continue
            assert r.status_code in (400, 431)
        assert httpx.get(f"{url}/health").status_code == 200
