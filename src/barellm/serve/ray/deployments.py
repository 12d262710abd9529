"""The two Ray Serve deployments, and the request router that lets the ingress pick a replica by name.

    HTTP -> Ray Serve proxy -> Router (ingress, one small process) -> Replica x N (the model + barellm's app)

A Replica loads the model and runs the ordinary Starlette app of `barellm serve` in-process: routes,
validation, scheduling and streaming are that app's, unchanged. Its `http` method takes one HTTP request
(the ASGI scope and the whole body) and yields the app's ASGI messages as they come, so a stream stays a
stream across processes.

The Router is the application's ingress. It reads the body, picks a replica (routing.PrefixRouter: the
one holding the prompt's prefix, else the least loaded), relays the replica's messages to the client,
and handles what only it can: a replica that dies before answering is replaced by another for that
request, a stream cut by a dying replica ends with an error event, a request that outlives its time
limit is ended, and /health and /metrics report every replica.

Ray's own request router (TargetedRouter) only carries out the Router's choice: a call that names a
replica goes to it while it lives; one that does not, or names a replica that is gone, goes to the less
loaded of two.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import random
import re
import socket
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from barellm.serve.ray import routing
from barellm.serve.ray.routing import PrefixRouter, Route, route_of

log = logging.getLogger("barellm.serve.ray")

REPLICA_HEADER = b"x-barellm-replica"
MAX_BODY_BYTES = 1 << 20   # what the app accepts; the Router reads one byte more so the app can refuse it
STREAM_GRACE_S = 30.0      # the Router's limit is the app's --timeout plus this
FANOUT_TIMEOUT_S = 10.0    # a replica that does not answer /health within this counts as unreachable
MAX_ATTEMPTS = 3           # replicas tried for one request before giving up

class TargetedRouter(RequestRouter):
    """Sends a call whose `route` keyword names a running replica to that replica; any other call to the
    less loaded of two random replicas (Ray's default policy)."""

    def initialize_state(self, **kwargs: Any) -> None:
        # Ray ships this class to the Router's process by value (a copy of this module's globals), so the
        # Router finds it through a module Ray imports there as usual
        routing.LIVE_REPLICAS[self.app_name] = self.replica_names

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        # Ray retries at once, without a pause, until a router says it has offered all it will: this one
        # always has, so a replica slow to answer its queue-length probe is not flooded with them
        pending_request.routing_context.should_backoff = True
        want = pending_request.kwargs.get("route")
        if want:
            for r in candidate_replicas:
                if r.replica_id.unique_id == want:
                    return [[r]]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]

    def replica_names(self) -> list[str]:
        return sorted(rid.unique_id for rid in list(self.curr_replicas))


# --- the replica -----------------------------------------------------------------------------------

class _Lifespan:
    """Runs an ASGI app's lifespan protocol (startup, shutdown) outside a web server."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.task: asyncio.Future[Any] | None = None

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self.task = asyncio.ensure_future(self.app(scope, self.inbox.get, self.outbox.put))
        await self.inbox.put({"type": "lifespan.startup"})
        msg = await self.outbox.get()
        if msg["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app did not start: {msg.get('message', msg['type'])}")

    async def shutdown(self) -> None:
        if self.task is None or self.task.done():
            return
        await self.inbox.put({"type": "lifespan.shutdown"})
        try:
            await asyncio.wait_for(self.outbox.get(), 60)
        except asyncio.TimeoutError:
            self.task.cancel()


class Replica:
    """One copy of the model behind barellm's own app. options: the `barellm serve` options (a dict)."""

    def __init__(self, options: dict[str, Any]) -> None:
        import argparse

        from barellm.serve import build_app

        self.name = serve.get_replica_context().replica_id.unique_id
        self.app = build_app(argparse.Namespace(**options), replica=self.name)
        self.scheduler = self.app.state.server.scheduler
        self.lifespan = _Lifespan(self.app)
        self._started: asyncio.Future[None] | None = None

    async def _ensure_started(self) -> None:
        if self._started is None:
            self._started = asyncio.ensure_future(self.lifespan.startup())
        await asyncio.shield(self._started)

    async def http(self, scope: dict[str, Any], body: bytes, route: str | None = None
                   ) -> AsyncIterator[list[dict[str, Any]]]:
        """Runs one HTTP request through the app; yields its http.response.* messages, in lists: what the
        app sent while the previous list was in transit goes as one, body chunks joined (each item costs
        the router about as much as a generated token costs a replica, so a busy router gets fewer, larger
        ones). Cancelling the generator (the client went away) tells the app the client disconnected,
        which frees the slot."""
        await self._ensure_started()
        out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await out.put(message)

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: out.put_nowait(None))
        try:
            while True:
                batch = [await out.get()]
                while not out.empty():
                    batch.append(out.get_nowait())
                messages = _join_bodies([m for m in batch if m is not None])
                if messages:
                    yield messages
                if batch[-1] is None:
                    break
        finally:
            if not task.done():
                gone.set()
                try:
                    await asyncio.wait_for(asyncio.shield(task), 5)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    task.cancel()
            elif not task.cancelled() and task.exception() is not None:
                # the app has answered 500 already (its error handler); the log gets the traceback
                log.error("request failed in the app", exc_info=task.exception())

    async def describe(self, route: str | None = None) -> dict[str, Any]:
        """Who this replica is: its name, process and machine."""
        return {"replica": self.name, "pid": os.getpid(), "host": socket.gethostname(),
                "node": _node_ip(), "threads": self.app.state.server.model.threads}

    def check_health(self) -> None:
        """Ray calls this periodically; an error makes Ray replace this replica."""
        if self._started is not None and self._started.done() and self.scheduler._thread is None:
            raise RuntimeError("the scheduler thread is not running")
        thread = self.scheduler._thread
        if thread is not None and not thread.is_alive():
            raise RuntimeError("the scheduler thread died")

    async def __del__(self) -> None:
        await self.lifespan.shutdown()


def _join_bodies(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive http.response.body messages as one."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["type"] == "http.response.body" and out and out[-1]["type"] == "http.response.body":
            out[-1] = {"type": "http.response.body", "body": out[-1].get("body", b"") + m.get("body", b""),
                       "more_body": m.get("more_body", False)}
        else:
            out.append(m)
    return out


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:   # only informative
        return ""


# --- the ingress -----------------------------------------------------------------------------------

class _Gone(Exception):
    """The client disconnected."""


class _Timeout(Exception):
    """The request outlived its time limit."""


def _header(message: dict[str, Any], name: bytes) -> str | None:
    for k, v in message.get("headers", []):
        if bytes(k).lower() == name:
            return bytes(v).decode("latin-1")
    return None


def _error_body(status: int, message: str, type_: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}},
                      ensure_ascii=False).encode("utf-8")


def _portable_scope(scope: dict[str, Any]) -> dict[str, Any]:
    """What of the ASGI scope travels to a replica: everything the app reads (the Host header and the
    client address included, so the app's own checks see the original request)."""
    keep = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "root_path",
            "query_string", "client", "server")
    out = {k: scope[k] for k in keep if k in scope}
    out["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
    if out.get("client") is not None:
        out["client"] = tuple(out["client"])
    if out.get("server") is not None:
        out["server"] = tuple(out["server"])
    return out


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus texts of several replicas as one: every sample gains a replica label; each family's
    HELP and TYPE appear once."""
    families: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = defaultdict(list)
    for replica, text in texts.items():
        family = ""
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                families.setdefault(family, [])
                if line not in families[family]:
                    families[family].append(line)
                continue
            m = _SAMPLE.match(line)
            if not m:
                continue
            name, labels, value = m.groups()
            label = f'replica="{replica}"' + (f",{labels}" if labels else "")
            samples[family].append(f"{name}{{{label}}} {value}")
    lines: list[str] = []
    for family, head in families.items():
        lines.extend(head)
        lines.extend(samples[family])
    return "\n".join(lines) + "\n" if lines else ""


class _Reply:
    """A whole response collected from a replica (for /health and /metrics)."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.replica: str | None = None

    def add(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
            self.replica = _header(message, REPLICA_HEADER)
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")


def _call(method: Any, *args: Any, **kwargs: Any) -> Any:
    """method.remote(...) as a request of its own. Ray tags every call made while serving a request with that
    request's id, and its request router keeps pending calls by that id, so of several concurrent calls
    made for one request (the /health fan-out) only one would ever be answered."""
    return contextvars.Context().run(lambda: method.remote(*args, **kwargs))


class Router:
    """The ingress: forwards every request to a replica of its choice and reports on all of them."""

    def __init__(self, replicas: DeploymentHandle, settings: dict[str, Any]) -> None:
        self.handle = replicas.options(stream=True)
        self.unary = replicas
        timeout = float(settings.get("timeout") or 0)
        self.limit = timeout + STREAM_GRACE_S if timeout > 0 else None
        slots = int(settings.get("slots", 4))
        self.routing = PrefixRouter(min_prefix_chars=int(settings.get("min_prefix_chars", 128)),
                                    slack=max(1, slots // 2), remembered=slots)
        self.app_name = serve.get_replica_context().app_name
        self.name = "router-" + serve.get_replica_context().replica_id.unique_id
        self.started = time.time()
        self.routed: dict[tuple[str, str], int] = defaultdict(int)      # (replica, reason) -> requests
        self.failures: dict[str, int] = defaultdict(int)                # stage -> replica failures seen
        self.retries = 0

    # --- replicas -------------------------------------------------------------------------------

    def _replica_names(self) -> list[str] | None:
        names = routing.LIVE_REPLICAS.get(self.app_name)
        return names() if names is not None else None

    async def _known_replicas(self) -> list[str]:
        names = self._replica_names()
        if names is None:
            # Ray builds its request router on the first call: make one
            await asyncio.wait_for(_call(self.unary.describe), FANOUT_TIMEOUT_S)
            names = self._replica_names() or []
        return names

    # --- ASGI -----------------------------------------------------------------------------------

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1003})
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body") or len(body) > MAX_BODY_BYTES:
                break
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if scope.get("method") == "GET" and path == "/health":
            await self._health(scope, send)
        elif scope.get("method") == "GET" and path == "/metrics":
            await self._metrics(scope, send)
        else:
            route = route_of(path, bytes(body)) if scope.get("method") == "POST" else Route()
            await self._forward(_portable_scope(scope), bytes(body), route, receive, send)

    async def _send_error(self, send: Any, status: int, message: str, type_: str, code: str) -> None:
        body = _error_body(status, message, type_, code)
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (REPLICA_HEADER, self.name.encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _forward(self, scope: dict[str, Any], body: bytes, route: Route, receive: Any, send: Any) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limit if self.limit is not None else None
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        tried: set[str | None] = set()
        error = "no replica is running"
        try:
            for attempt in range(MAX_ATTEMPTS):
                names = self._replica_names()
                if names is not None:
                    self.routing.update(names)
                choice = self.routing.choose(route, exclude=tried)
                if attempt and choice.replica is None and names:
                    break   # every running replica has failed this request
                target = choice.replica
                gen = _call(self.handle.http, scope, body, route=target)
                self.routing.begin(target)
                started = sse = False
                served = target
                try:
                    async for message in _relay(gen, deadline, gone):
                        if message["type"] == "http.response.start":
                            served = _header(message, REPLICA_HEADER) or target
                            if message["status"] == 429 and len(tried) + 1 < len(self.routing.replicas):
                                tried.add(served)   # that replica's queue is full: try another one
                                gen.cancel()
                                error = "every replica's queue is full"
                                break
                            started = True
                            sse = (_header(message, b"content-type") or "").startswith("text/event-stream")
                            if served is not None:
                                self.routed[(served, choice.reason if served == target else "platform")] += 1
                                if message["status"] == 200:
                                    self.routing.remember(served, route.keys)
                        await send(message)
                    else:
                        return
                    self.retries += 1
                    continue
                except _Gone:
                    gen.cancel()
                    return
                except _Timeout:
                    gen.cancel()
                    msg = f"the request outlived its time limit of {self.limit:g} s"
                    await self._end(send, started, sse, 504, msg, "timeout_error", "timeout")
                    return
                except (RayError, RayServeException) as e:
                    gen.cancel()
                    self.failures["before_response" if not started else "during_response"] += 1
                    error = f"replica {served} failed: {type(e).__name__}"
                    log.warning("%s (%s)", error, "retrying elsewhere" if not started else "response cut")
                    if started:
                        msg = f"the replica serving this request stopped ({type(e).__name__}); retry the request"
                        await self._end(send, True, sse, 502, msg, "server_error", "replica_failed")
                        return
                    tried.add(served)
                    if served is not None:
                        self.routing.forget(served)   # Ray drops it too; the next update re-adds a live one
                    self.retries += 1
                finally:
                    self.routing.end(target)
            await self._send_error(send, 503, f"no replica could serve the request: {error}", "server_error",
                                   "no_replica")
        finally:
            gone.cancel()

    async def _end(self, send: Any, started: bool, sse: bool, status: int, message: str, type_: str,
                   code: str) -> None:
        if not started:
            await self._send_error(send, status, message, type_, code)
            return
        if sse:   # the status line is gone already: OpenAI's clients read an error object in the stream
            body = _error_body(status, message, type_, code)
            await send({"type": "http.response.body", "body": b"data: " + body + b"\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # --- /health and /metrics -------------------------------------------------------------------

    async def _ask(self, replica: str, scope: dict[str, Any]) -> _Reply:
        reply = _Reply()

        async def collect() -> None:
            async for messages in _call(self.handle.http, scope, b"", route=replica):
                for message in messages:
                    reply.add(message)

        await asyncio.wait_for(collect(), FANOUT_TIMEOUT_S)
        return reply

    async def _fanout(self, scope: dict[str, Any]) -> tuple[list[str], list[_Reply | BaseException]]:
        names = await self._known_replicas()
        portable = _portable_scope(scope)
        replies = await asyncio.gather(*(self._ask(n, portable) for n in names), return_exceptions=True)
        return names, list(replies)

    async def _health(self, scope: dict[str, Any], send: Any) -> None:
        try:
            names, replies = await self._fanout(scope)
            infos = await asyncio.gather(*(asyncio.wait_for(_call(self.unary.describe, route=n), FANOUT_TIMEOUT_S)
                                           for n in names), return_exceptions=True)
        except (RayError, RayServeException, asyncio.TimeoutError) as e:
            await self._send_error(send, 503, f"no replica answered: {type(e).__name__}", "server_error",
                                   "no_replica")
            return
        entries = []
        totals = {"slots": 0, "slots_in_use": 0, "queue_depth": 0}
        for name, reply, info in zip(names, replies, infos, strict=True):
            entry: dict[str, Any] = {"replica": name}
            if isinstance(info, dict) and info.get("replica") == name:
                entry.update({k: info[k] for k in ("pid", "host", "node", "threads")})
            if isinstance(reply, _Reply) and reply.replica == name and reply.status == 200:
                h = json.loads(reply.body)
                entry.update(h)
                for k in totals:
                    totals[k] += int(h.get(k, 0))
            elif isinstance(reply, _Reply) and reply.status not in (0, 200, 503):
                # the app refused the request itself (authentication, Host): answer as it did
                await _send_reply(send, reply)
                return
            else:
                why = type(reply).__name__ if isinstance(reply, BaseException) else f"status {reply.status}"
                entry.update({"status": "unreachable", "error": why})
            entries.append(entry)
        ok = sum(1 for e in entries if e.get("status") == "ok")
        body = {"status": "ok" if ok else "unavailable", "replicas_ok": ok, **totals, "replicas": entries}
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 200 if ok else 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
            (REPLICA_HEADER, self.name.encode())]})
        await send({"type": "http.response.body", "body": data, "more_body": False})

    async def _metrics(self, scope: dict[str, Any], send: Any) -> None:
        try:
            names, replies = await self._fanout(scope)
        except (RayError, RayServeException, asyncio.TimeoutError):
            names, replies = [], []
        texts: dict[str, str] = {}
        for name, reply in zip(names, replies, strict=True):
            if isinstance(reply, _Reply) and reply.status == 200 and reply.replica == name:
                texts[name] = reply.body.decode("utf-8", errors="replace")
            elif isinstance(reply, _Reply) and reply.status not in (0, 200, 503):
                await _send_reply(send, reply)
                return
        data = (merge_metrics(texts) + self._own_metrics(names, texts)).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
            (b"content-length", str(len(data)).encode()), (REPLICA_HEADER, self.name.encode())]})
        await send({"type": "http.response.body", "body": data, "more_body": False})

    def _own_metrics(self, names: list[str], answered: dict[str, str]) -> str:
        lines = [
            "# HELP barellm_replicas Replicas running, and of those the ones that answered this scrape.",
            "# TYPE barellm_replicas gauge",
            f'barellm_replicas{{state="running"}} {len(names)}',
            f'barellm_replicas{{state="answered"}} {len(answered)}',
            "# HELP barellm_router_requests_total Requests the router sent, by replica and why it was chosen.",
            "# TYPE barellm_router_requests_total counter",
            *(f'barellm_router_requests_total{{replica="{r}",reason="{why}"}} {n}'
              for (r, why), n in sorted(self.routed.items())),
            "# HELP barellm_router_replica_failures_total Replicas that failed while serving a request, by "
            "whether the response had started.",
            "# TYPE barellm_router_replica_failures_total counter",
            *(f'barellm_router_replica_failures_total{{stage="{s}"}} {n}' for s, n in sorted(self.failures.items())),
            "# HELP barellm_router_retries_total Requests sent again to another replica.",
            "# TYPE barellm_router_retries_total counter",
            f"barellm_router_retries_total {self.retries}",
        ]
        return "\n".join(lines) + "\n"


async def _send_reply(send: Any, reply: _Reply) -> None:
    await send({"type": "http.response.start", "status": reply.status, "headers": reply.headers})
    await send({"type": "http.response.body", "body": reply.body, "more_body": False})


async def _wait_disconnect(receive: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _relay(gen: Any, deadline: float | None, gone: asyncio.Future[None]) -> AsyncIterator[dict[str, Any]]:
    """The replica's messages, until the client goes away (_Gone) or the deadline passes (_Timeout)."""
    loop = asyncio.get_running_loop()
    it = gen.__aiter__()
    while True:
        nxt = asyncio.ensure_future(it.__anext__())
        remaining = None if deadline is None else max(0.0, deadline - loop.time())
        done, _ = await asyncio.wait({nxt, gone}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        if nxt not in done:
            nxt.cancel()
            nxt.add_done_callback(_ignore_result)
            raise _Gone() if gone in done else _Timeout()
        try:
            messages = nxt.result()
        except StopAsyncIteration:
            return
        for message in messages:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                return   # the response is complete; the generator's own end may come later


def _ignore_result(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _ingress_app() -> Any:
    """The ASGI app Ray Serve runs in the Router's process: it hands each request to the Router object.
    A Starlette app around it, as Ray Serve adds its own exception handlers to an ingress app."""
    from starlette.applications import Starlette
    from starlette.routing import Mount

    async def forward(scope: dict[str, Any], receive: Any, send: Any) -> None:
        router = serve.get_replica_context().servable_object
        await router.asgi(scope, receive, send)

    return Starlette(routes=[Mount("", app=forward)])


ReplicaDeployment = serve.deployment(name="barellm-replica")(Replica)
RouterDeployment = serve.deployment(name="barellm-router")(serve.ingress(_ingress_app)(Router))
