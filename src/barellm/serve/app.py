"""The OpenAI-compatible HTTP app (Starlette): validation, tokenization, and streaming the scheduler's events.

The event loop never runs the model. A generation request is validated and tokenized (in a worker
thread, as a long prompt takes a while), submitted to the Scheduler, and answered by a GenerationResponse
(responses.py), which relays the scheduler's events as one JSON body or as server-sent events while it
watches the connection: a client that goes away cancels its job at once, freeing the slot before the next
step.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from barellm import __version__
from barellm.api.openai import GenerationRequest
from barellm.errors import InvalidRequest
from barellm.generate.scheduler import DEFAULT_PREFILL_CHUNK, Scheduler
from barellm.serve import openapi_doc, schemas
from barellm.serve.errors import ApiError, bad
from barellm.serve.metrics import Metrics, endpoint_label
from barellm.serve.models import Candidate, Models, Server, leasing
from barellm.serve.relay import prepare, read_body, submit, submit_embeddings
from barellm.serve.responses import (
    _JSON,
    EmbeddingResponse,
    Formatter,
    GenerationResponse,
    InfillResponse,
    error_response,
)
from barellm.serve.schema_types import MAX_BODY_BYTES
from barellm.serve.security import MAX_HEADER_BYTES, Guard
from barellm.text.infill import end_rules

DEFAULT_STREAM_INTERVAL = 0.02   # seconds: a streamed response's text goes out at most 50 times a second


def _run_sync(fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
    from starlette.concurrency import run_in_threadpool

    return run_in_threadpool(fn, *args)


class ServerState:
    """What the handlers share: the model, the scheduler, the metrics and the served names."""

    def __init__(self, model: Any, *, model_id: str | None = None, aliases: Iterable[str] = (),
                 max_queue: int = 64, timeout: float | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 max_body: int = MAX_BODY_BYTES, stream_interval: float = DEFAULT_STREAM_INTERVAL,
                 metrics: Metrics | None = None) -> None:
        self.model = model
        self.stream_interval = max(0.0, stream_interval)
        self.tokenizer = model.tokenizer
        self.n_ctx: int = model.n_ctx
        self.n_vocab: int = model.config.n_vocab
        path = Path(getattr(model, "path", "model"))
        self.model_id = model_id or path.stem
        self.created = int(path.stat().st_mtime) if path.exists() else int(time.time())
        # Names a request may give for this model. OpenAI clients always send one; anything else is a
        # 404, as sending a request meant for another model here is most likely a mistake.
        self.names = {n.lower() for n in (self.model_id, path.name, path.stem, *aliases) if n}
        self.timeout = timeout if timeout and timeout > 0 else None
        self.max_body = max_body
        self.fingerprint = f"barellm-{__version__}-{getattr(model, 'engine_name', 'engine')}"
        self.metrics = metrics if metrics is not None else Metrics(model.engine.n_slots)
        self.scheduler = getattr(model, "scheduler", None)   # a Model's own: the one the Python API runs
        if self.scheduler is None:   # a stand-in that brings only an engine and a tokenizer
            self.scheduler = Scheduler(model.engine, model.tokenizer, n_ctx=self.n_ctx,
                                       speculator=getattr(model, "speculator", None))
        self.scheduler.configure(max_queue=max_queue, prefill_chunk=prefill_chunk, metrics=self.metrics)

    def check_model(self, name: str | None) -> None:
        if name is not None and name.lower() not in self.names:
            raise ApiError(404, f"The model {name!r} does not exist here; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")




# --- handlers ------------------------------------------------------------------------------------

def _state(request: Request) -> Server:
    return request.app.state.server


async def _model(request: Request, name: str | None) -> ServerState:
    """The ServerState of the model a request names, loaded and held for the request (models.leasing)."""
    return (await _state(request).lease(request, name)).state


def _model_field(raw: bytes) -> str | None:
    """The "model" of a request body, read ahead of the validation that needs the model's vocabulary."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):   # schemas.parse says what is wrong with it
        return None
    name = body.get("model") if isinstance(body, dict) else None
    return name if isinstance(name, str) else None


async def _generate(request: Request, state: ServerState, req: GenerationRequest) -> Response:
    """Makes the request's prompt (off the event loop) and hands it to the scheduler; its answer is relayed."""
    await _run_sync(prepare, state.model, req)
    job, events = submit(state, req)
    prompt_chars = len(req.prompt_text) if req.prompt_text is not None else 0
    return GenerationResponse(state, job, events, Formatter(state, req, prompt_chars), request.url.path)


async def chat_completions(request: Request) -> Response:
    req = schemas.chat_request(await read_body(request, _state(request).max_body))
    state = await _model(request, req.model)
    return await _generate(request, state, req)


def _infill_prompt(model: Any, body: schemas.InfillRequest, req: GenerationRequest) -> None:
    prepare(model, req)   # the constraint: the prompt is llama.cpp's /infill layout
    try:
        req.prompt = model.infill_prompt(body.input_prefix, body.input_suffix, prompt=body.prompt,
                                         extra=[c.model_dump() for c in body.input_extra], max_tokens=req.max_tokens,
                                         repo_level=True)
    except InvalidRequest as e:
        raise bad(str(e), "input_prefix") from None
    stops, indent = end_rules(body.input_prefix + body.prompt, body.input_suffix)
    req.stops = req.stops + stops
    req.min_indent = body.n_indent if body.n_indent is not None and body.n_indent > 0 else indent


async def infill(request: Request) -> Response:
    body, req = schemas.infill_request(await read_body(request, _state(request).max_body))
    state = await _model(request, req.model)
    await _run_sync(_infill_prompt, state.model, body, req)
    stream, req.stream = req.stream, True   # the job streams either way: its first delta times the prefill
    job, events = submit(state, req)
    return InfillResponse(state, job, events, stream, request.url.path)


async def completions(request: Request) -> Response:
    raw = await read_body(request, _state(request).max_body)
    name = _model_field(raw)
    if name is None:   # a body that is no request fails before any model loads (token ids: once it is known)
        schemas.parse(schemas.CompletionRequest, raw)
    state = await _model(request, name)
    return await _generate(request, state, schemas.completion_request(raw, state.n_vocab))


def _model_card(server: Server, cand: Candidate) -> dict[str, Any]:
    """/v1/models' entry of a model: loaded ones with their context and slots; "loaded" says which are."""
    m = server.models.loaded.get(cand.name)
    if m is None:
        return {"id": cand.name, "object": "model", "created": int(cand.modified), "owned_by": "barellm",
                "loaded": False}
    state = m.state
    return {"id": cand.name, "object": "model", "created": state.created, "owned_by": "barellm",
            "context_length": state.n_ctx, "n_vocab": state.n_vocab, "slots": state.scheduler.n_slots,
            "loaded": True}


async def list_models(request: Request) -> Response:
    server = _state(request)
    return _JSON({"object": "list", "data": [_model_card(server, c) for c in server.models.catalog(refresh=True)]})


async def get_model(request: Request) -> Response:
    server = _state(request)
    return _JSON(_model_card(server, server.models.resolve(request.path_params["model"])))


async def health(request: Request) -> Response:
    loaded = [m.state.scheduler for m in _state(request).models.loaded.values()]
    return _JSON({"status": "ok", "slots": sum(s.n_slots for s in loaded),
                  "slots_in_use": sum(s.slots_in_use for s in loaded),
                  "queue_depth": sum(s.queue_depth for s in loaded), "models_loaded": len(loaded)})


async def metrics(request: Request) -> Response:
    return PlainTextResponse(_state(request).metrics.render(), media_type="text/plain; version=0.0.4")


async def tokenize(request: Request) -> Response:
    req = schemas.tokenize_request(await read_body(request, _state(request).max_body))
    state = await _model(request, req.model)
    try:
        ids = await _run_sync(state.model.tokenize, req.content, req.add_special, req.parse_special)
    except InvalidRequest as e:
        raise bad(str(e), "content") from None
    if req.with_pieces:
        tok = state.tokenizer
        return _JSON({"tokens": [{"id": i, "piece": tok.token_bytes(i).decode("utf-8", errors="replace")}
                                 for i in ids]})
    return _JSON({"tokens": ids})


async def detokenize(request: Request) -> Response:
    raw = await read_body(request, _state(request).max_body)
    name = _model_field(raw)
    if name is None:   # as in completions: the shape now, the ids against the model's vocabulary below
        schemas.parse(schemas.DetokenizeRequest, raw)
    state = await _model(request, name)
    ids = schemas.detokenize_request(raw, state.n_vocab)
    try:
        text = await _run_sync(state.model.detokenize, ids)
    except InvalidRequest as e:
        raise bad(str(e), "tokens") from None
    return _JSON({"content": text})


async def embeddings(request: Request) -> Response:
    req = schemas.parse(schemas.EmbeddingRequest, await read_body(request, _state(request).max_body))
    state = await _model(request, req.model)
    dim = state.model.config.dim
    if req.dimensions is not None and req.dimensions != dim:
        raise ApiError(400, f"dimensions: this model's embeddings have {dim} dimensions; it cannot make others",
                       param="dimensions", code="unsupported_parameter")
    inputs = req.inputs(state.n_vocab)
    try:
        ids = await _run_sync(state.model.embed_ids, inputs)
    except InvalidRequest as e:
        raise bad(str(e), "input") from None
    job, events = submit_embeddings(state, ids, state.model.pooling)
    return EmbeddingResponse(state, job, events, request.url.path, req.encoding_format == "base64")


async def openapi(request: Request) -> Response:
    return _JSON(request.app.state.openapi)


# --- errors and metrics around every request -----------------------------------------------------

async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(_state(request), request.url.path, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = {404: f"no such endpoint: {request.method} {request.url.path}",
           405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return error_response(_state(request), request.url.path, ApiError(exc.status_code, msg, code=code),
                          headers=dict(exc.headers or {}))


async def _internal_error(request: Request, exc: Exception) -> Response:
    # a bug: the client gets OpenAI's shape, the log gets the traceback (Starlette re-raises it)
    err = ApiError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")
    return error_response(_state(request), request.url.path, err)


class _CountRequests:
    """Counts every answered request by endpoint and status (404s and 405s included)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [0]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            status[0] = status[0] or 500
            raise
        finally:
            if status[0]:
                self.metrics.request(endpoint_label(scope.get("path", "")), status[0])


class _ReplicaHeader:
    """Names the process that answered in every response (X-Barellm-Replica), so a client behind several
    replicas can tell which one served it, and sees the same header from a single server."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app = app
        self.header = (b"x-barellm-replica", name.encode("latin-1", errors="replace"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_wrapper)


def process_name() -> str:
    """The X-Barellm-Replica of a single server: host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"


def create_app(model: Any, *, model_id: str | None = None, aliases: Iterable[str] = (), max_queue: int = 64,
               timeout: float | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
               max_body: int = MAX_BODY_BYTES, api_key: str | None = None,
               allowed_hosts: Iterable[str] | None = None, cors_origins: Iterable[str] = (),
               stream_interval: float = DEFAULT_STREAM_INTERVAL, replica: str | None = None) -> Starlette:
    """The app for a loaded model (barellm.load(..., slots=N): one slot per concurrent sequence), which it
    serves alone, never unloaded (create_server serves many, loaded on demand).

    stream_interval: seconds between a streamed response's events (the text that arrives meanwhile is sent
    together; 0 sends every token as it comes).

    api_key: requests must send 'Authorization: Bearer KEY' (but /health and the chat page at /);
    allowed_hosts: the Host header names accepted (None: any; security.default_allowed_hosts(bind) gives
    the command's default); cors_origins: browser origins allowed to call the API ("*": any; none: no CORS
    headers at all); replica: the name every response carries in X-Barellm-Replica (default: host and
    process id). The scheduler thread starts and stops with the app's lifespan.
    """
    metrics = Metrics(model.engine.n_slots)
    state = ServerState(model, model_id=model_id, aliases=aliases, max_queue=max_queue, timeout=timeout,
                        prefill_chunk=prefill_chunk, max_body=max_body, stream_interval=stream_interval,
                        metrics=metrics)
    path = Path(getattr(model, "path", "model"))
    size = path.stat().st_size if path.is_file() else 0
    cand = Candidate(state.model_id, path, frozenset(state.names), size, float(state.created), fixed=True)
    models = Models(lambda: [cand], None, lambda _s: None, max_loaded=None, keep_alive=None, default=cand.name)
    models.adopt(cand, state)
    server = Server(models, metrics, max_body=max_body, stream_interval=state.stream_interval, timeout=state.timeout)

    @asynccontextmanager
    async def lifespan(app: Starlette):  # type: ignore[no-untyped-def]
        hand_over = getattr(model, "serving", None)  # a Model's own calls would race the scheduler for slot 0
        if hand_over is not None:
            hand_over(True)
        state.scheduler.start()
        try:
            yield
        finally:
            await _run_sync(state.scheduler.stop)
            if hand_over is not None:
                hand_over(False)

    return _assemble(server, lifespan, api_key=api_key, allowed_hosts=allowed_hosts, cors_origins=cors_origins,
                     replica=replica)


def model_state(model: Any, name: str, metrics: Metrics, *, max_queue: int = 64, timeout: float | None = None,
                prefill_chunk: int = DEFAULT_PREFILL_CHUNK, stream_interval: float = DEFAULT_STREAM_INTERVAL,
                aliases: Iterable[str] = ()) -> ServerState:
    """A loaded model's ServerState, its scheduler started and the engine handed over to it (what a
    server's Models loads; stop_state undoes it)."""
    state = ServerState(model, model_id=name, aliases=aliases, max_queue=max_queue, timeout=timeout,
                        prefill_chunk=prefill_chunk, stream_interval=stream_interval, metrics=metrics)
    hand_over = getattr(model, "serving", None)
    if hand_over is not None:
        hand_over(True)
    state.scheduler.start()
    return state


def stop_state(state: ServerState) -> None:
    """Stops a model's scheduler and gives its engine back; the model is freed once nothing refers to it."""
    import gc

    state.scheduler.stop()
    hand_over = getattr(state.model, "serving", None)
    if hand_over is not None:
        hand_over(False)
    del state
    gc.collect()


def create_server(models: Models, metrics: Metrics, *, timeout: float | None = None,
                  max_body: int = MAX_BODY_BYTES, api_key: str | None = None,
                  allowed_hosts: Iterable[str] | None = None, cors_origins: Iterable[str] = (),
                  stream_interval: float = DEFAULT_STREAM_INTERVAL, replica: str | None = None) -> Starlette:
    """The app for many models (`barellm serve`): models loads and unloads them (serve.models); every
    loaded one is unloaded when the app stops. The other settings as create_app's."""
    server = Server(models, metrics, max_body=max_body, stream_interval=max(0.0, stream_interval),
                    timeout=timeout if timeout and timeout > 0 else None)

    def slots(loaded: list[Any]) -> None:
        metrics.n_slots = sum(m.state.scheduler.n_slots for m in loaded)

    models._on_change = slots
    slots(list(models.loaded.values()))

    @asynccontextmanager
    async def lifespan(app: Starlette):  # type: ignore[no-untyped-def]
        try:
            yield
        finally:
            await models.close()

    return _assemble(server, lifespan, api_key=api_key, allowed_hosts=allowed_hosts, cors_origins=cors_origins,
                     replica=replica)


def _assemble(server: Server, lifespan: Any, *, api_key: str | None, allowed_hosts: Iterable[str] | None,
              cors_origins: Iterable[str], replica: str | None) -> Starlette:
    from barellm.serve import ollama, webui  # their handlers build on this module's

    routes = [
        Route("/v1/chat/completions", leasing(chat_completions), methods=["POST"]),
        Route("/v1/completions", leasing(completions), methods=["POST"]),
        Route("/v1/embeddings", leasing(embeddings), methods=["POST"]),
        Route("/infill", leasing(infill), methods=["POST"]),
        Route("/tokenize", leasing(tokenize), methods=["POST"]),
        Route("/detokenize", leasing(detokenize), methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        *ollama.routes(),
        *webui.routes(),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error})
    app.state.server = server
    app.state.openapi = openapi_doc.openapi(__version__, ollama.MODELS, ollama.PATHS)
    # outermost last: every answer is counted, CORS headers go on the guard's refusals too
    app.add_middleware(Guard, api_key=api_key, allowed_hosts=allowed_hosts, routes=app.router.routes)
    origins = list(cors_origins)
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["authorization", "content-type"], max_age=600)
    app.add_middleware(_CountRequests, metrics=server.metrics)
    app.add_middleware(_ReplicaHeader, name=replica or process_name())
    return app


def server_config(app: Starlette, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info",
                  limits: Any = None) -> Any:
    """uvicorn's settings for app: no Server header, a cap on a request's header block while it arrives (the
    Guard checks the complete headers too), and connections.py's rules for slow, idle and excess
    connections (limits: a connections.Limits; None: its defaults)."""
    import uvicorn

    from barellm.serve.connections import Limits, protocol_class

    limits = limits if limits is not None else Limits()
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5,
                          server_header=False, h11_max_incomplete_event_size=2 * MAX_HEADER_BYTES,
                          http=protocol_class(limits), timeout_keep_alive=limits.keep_alive or 1 << 30)


def end_requests(server: Server) -> None:
    """Stops every loaded model's scheduler: each job still queued or running gets its 503 error event,
    which its handler relays (the end of a graceful shutdown, serve/shutdown.py)."""
    for m in list(server.models.loaded.values()):
        m.state.scheduler.stop()


def run(app: Starlette, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info",
        limits: Any = None, shutdown_timeout: float | None = None) -> None:
    """Serves app with uvicorn until Ctrl-C or SIGTERM, then shuts down gracefully (serve/shutdown.py):
    the requests in flight get shutdown_timeout seconds to finish."""
    from barellm.serve.shutdown import DEFAULT_SHUTDOWN_TIMEOUT, GracefulServer

    grace = DEFAULT_SHUTDOWN_TIMEOUT if shutdown_timeout is None else shutdown_timeout
    server: Server = app.state.server
    GracefulServer(server_config(app, host, port, log_level, limits), lambda: end_requests(server), grace).run()
