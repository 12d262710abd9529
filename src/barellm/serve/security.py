"""What stands between the network and the handlers: the Host allow-list, header size, the API key, the
JSON content type, and (opted in) CORS.

Each check answers before any handler runs, in OpenAI's error shape ({"error": {"message", ...}}), or on
Ollama's routes (/api/*) in Ollama's ({"error": "message"}), as their handlers do:
- Two Host headers: 400 (RFC 9112 section 3.2: a server must refuse them; the first would win otherwise).
- Host not allowed: 421. A page on another site can make a browser send requests to a loopback server
  under a name it controls (DNS rebinding); such requests carry that name, not a loopback one.
- Headers over the limit: 431, so a client cannot make every request hold large header blocks.
- API key missing or wrong: 401. Compared in constant time; /health stays open for liveness probes,
  and so does the chat page at / (it asks for the key itself).
- A POST whose body is not declared application/json: 415, once the route is known to exist and to take a POST
  (an unknown path is a 404 and a wrong method a 405 whatever the body, from the router). Browsers send
  text/plain, form and multipart bodies cross-origin without asking (no preflight); requiring JSON means a
  foreign page cannot start a generation, as a JSON body from another origin needs a preflight that only
  --cors-origin lets through.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Iterable, Sequence
from typing import Any

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

MAX_HEADER_BYTES = 16 * 1024
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = ("/health", "/")   # no API key needed: liveness, and the chat page (which asks for the key)
OPEN_PREFIX = "/static/"        # the chat page's script and style


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind: str) -> list[str] | None:
    """The Host names a server bound to bind accepts by default: the loopback names when it listens on
    loopback only; None (any) otherwise, where only the operator knows the names clients use."""
    return list(LOOPBACK_NAMES) if is_loopback(bind) else None


def host_name(header: str) -> str:
    """The name part of a Host header: no port, IPv6 brackets dropped, lower case."""
    h = header.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        return h[1:end] if end > 0 else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


OLLAMA_PREFIX = "/api/"   # Ollama's routes: errors are {"error": "message"}


def error_body(path: str, message: str, code: str | None, type: str = "invalid_request_error") -> dict[str, Any]:
    """An error as the route at path answers it: Ollama's shape under /api/, OpenAI's elsewhere."""
    if path.startswith(OLLAMA_PREFIX):
        return {"error": message}
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


async def _error(send: Send, path: str, status: int, message: str, code: str, type: str = "invalid_request_error",
                 headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(path, message, code, type)).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware applying the checks above, in that order."""

    def __init__(self, app: ASGIApp, *, api_key: str | None = None, allowed_hosts: Iterable[str] | None = None,
                 max_header_bytes: int = MAX_HEADER_BYTES, routes: Sequence[BaseRoute] | None = None) -> None:
        self.app = app
        self.routes = routes   # the router's own list (None: every path counts as routed)
        self.api_key = api_key.encode() if api_key else None
        hosts = None if allowed_hosts is None else {host_name(h) for h in allowed_hosts}
        self.allowed_hosts = None if hosts is None or "*" in hosts else hosts
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        path: str = scope["path"]
        size = sum(len(k) + len(v) + 4 for k, v in headers)
        if size > self.max_header_bytes:
            await _error(send, path, 431, f"the request headers take {size} bytes; at most {self.max_header_bytes} "
                         "are accepted", "headers_too_large")
            return
        get = _getter(headers)
        hosts = sum(1 for k, _ in headers if k == b"host")
        if hosts > 1:
            await _error(send, path, 400, f"the request carries {hosts} Host headers; HTTP/1.1 allows exactly one",
                         "duplicate_host", headers=[(b"connection", b"close")])
            return
        if self.allowed_hosts is not None:
            host = host_name(get(b"host").decode("latin-1"))
            if host not in self.allowed_hosts:
                await _error(send, path, 421, f"this server does not answer to the host name {host[:100]!r}; start it "
                             "with --allowed-host NAME to accept it", "invalid_host")
                return
        method = scope["method"]
        if method == "OPTIONS":   # a CORS preflight carries no credentials; the CORS layer answers it
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIX):
            given = _bearer(get(b"authorization"))
            if not hmac.compare_digest(given, self.api_key):
                await _error(send, path, 401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'"
                             if not given else "the API key is not valid", "invalid_api_key",
                             headers=[(b"www-authenticate", b'Bearer realm="barellm"')])
                return
        if method == "POST" and self._routed(scope):
            mime = get(b"content-type").split(b";")[0].strip().lower()
            if mime != b"application/json":
                shown = mime.decode("latin-1")[:100] or "none"
                await _error(send, path, 415, f"the body must be JSON sent as Content-Type: application/json "
                             f"(got {shown})", "unsupported_media_type")
                return
        await self.app(scope, receive, send)


    def _routed(self, scope: Scope) -> bool:
        """Whether a route takes this method at this path (else the router answers 404 or 405)."""
        if self.routes is None:
            return True
        return any(r.matches(scope)[0] == Match.FULL for r in self.routes)


def _getter(headers: list[tuple[bytes, bytes]]) -> Any:
    def get(name: bytes) -> bytes:
        for k, v in headers:
            if k == name:
                return v
        return b""
    return get


def _bearer(value: bytes) -> bytes:
    scheme, _, token = value.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""
