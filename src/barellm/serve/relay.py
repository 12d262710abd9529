"""From a validated request to the scheduler and back, whichever API the request came through: reading the
body, submitting the job (the one path every generation takes), and relaying its events to the client while
watching the connection, so a client that goes away cancels its job at once.

The scheduler never waits for the event loop: it appends a job's events to the job's Outbox, which wakes
the loop once per batch of them. (The event loop shares the cores with the engine's threads: every wake-up
takes a slice of a core from a forward pass.)"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from barellm.api import openai as openai_api
from barellm.api.openai import GenerationRequest
from barellm.errors import InvalidRequest
from barellm.generate.request import check
from barellm.generate.scheduler import EmbedJob, Event, Job, QueueFull
from barellm.serve.errors import ApiError, bad

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for the legacy endpoint


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused past limit bytes (by its declared length first, then as it arrives)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    except ClientDisconnect:
        raise bad("the client went away while sending the body") from None
    return bytes(body)


class Outbox:
    """A job's events on their way from the scheduler thread to the event loop. The scheduler only appends
    (it never waits for the loop); the loop is woken at most once per batch of events, and takes every event
    that arrived meanwhile at once (batch()) or one by one (get())."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque[Event | None] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.wake_pending = False

    def push(self, ev: Event | None) -> None:
        """From the scheduler thread (None, from the loop itself: the client went away)."""
        self.items.append(ev)
        if not self.wake_pending:
            self.wake_pending = True
            self.loop.call_soon_threadsafe(self._wake)

    put_nowait = push

    def _wake(self) -> None:
        self.wake_pending = False
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def _ready(self) -> None:
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    async def get(self) -> Event | None:
        await self._ready()
        return self.items.popleft()

    async def batch(self) -> list[Event | None]:
        await self._ready()
        out: list[Event | None] = []
        try:
            while True:
                out.append(self.items.popleft())
        except IndexError:
            return out


def prepare(model: Any, req: GenerationRequest) -> None:
    """api/openai.py's prepare (the prompt's token ids and the compiled constraint, as Model.create_* makes them),
    its InvalidRequest a 400 naming the field (a constraint that needs the missing llguidance:
    "unsupported_parameter"). Runs off the event loop: a template, a long prompt and a large schema take a
    while."""
    from barellm.generate.structured import StructuredUnavailable

    try:
        openai_api.prepare(model, req)
    except StructuredUnavailable as e:
        raise ApiError(400, str(e), param=e.param, code="unsupported_parameter") from None
    except InvalidRequest as e:
        raise bad(str(e), e.param, e.code) from None


def submit(state: Any, req: GenerationRequest) -> tuple[Job, Outbox]:
    """Holds the request (its prompt made: prepare) to the model's limits with the check the Python API makes
    too (generate.request.check) and queues it: the one path every API's generation requests take to the
    scheduler. Returns the request, which is the job the scheduler runs, and the outbox its events arrive in."""
    events = Outbox(asyncio.get_running_loop())
    req.emit = events.push
    req.timeout = state.timeout
    req.stream_interval = getattr(state, "stream_interval", 0.0)
    # no max_tokens: the rest of the context, but OpenAI's legacy completions, which default to 16 (cut to fit)
    short = req.max_tokens is None and req.kind != "chat" and req.short_default
    if short:
        req.max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    try:
        check(req, n_ctx=state.n_ctx, n_vocab=state.n_vocab, n_slots=state.scheduler.n_slots,
              clamp_max_tokens=short or req.clamp_max_tokens,
              prompt_param="messages" if req.kind == "chat" else "prompt")
    except InvalidRequest as e:
        raise bad(str(e), e.param, e.code) from None
    _enqueue(state, req)
    return req, events


def _enqueue(state: Any, job: Job | EmbedJob) -> None:
    """Hands a job to the scheduler; a full queue is a 429 the client may retry."""
    try:
        state.scheduler.submit(job)
    except QueueFull as e:
        raise ApiError(429, f"the server is busy: {e}; retry later", type="rate_limit_error",
                       code="queue_full") from None


def submit_embeddings(state: Any, inputs: list[list[int]], pooling: str, normalize: bool = True
                      ) -> tuple[EmbedJob, Outbox]:
    """Queues an embedding job (one slot; the scheduler feeds it beside the generations)."""
    events = Outbox(asyncio.get_running_loop())
    job = EmbedJob(inputs=inputs, emit=events.push, pooling=pooling, normalize=normalize, timeout=state.timeout)
    _enqueue(state, job)
    return job, events


class RelayResponse(Response):
    """Relays a job's events (_respond, per API); cancels the job when the client disconnects or the
    response ends early. on_close, when set, runs once the relay has ended (models.leasing: the request's
    hold on its model ends there)."""

    on_close: Callable[[], None] | None = None

    def __init__(self, state: Any, job: Job | EmbedJob, events: Outbox, path: str) -> None:
        self.state = state
        self.job = job
        self.events = events
        self.path = path
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.state.scheduler.cancel(self.job)
                    self.events.push(None)
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            await self._respond(scope, receive, send)
        except (OSError, ClientDisconnect):
            pass   # the connection broke while writing: the finally below frees the slot
        finally:
            watcher.cancel()
            self.state.scheduler.cancel(self.job)   # no-op once the job is done
            if self.on_close is not None:
                self.on_close()

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError

    async def _each(self) -> AsyncIterator[Event]:
        """The job's events one at a time, until its last (or the client's going: None)."""
        while True:
            for ev in await self.events.batch():
                if ev is None:
                    return
                yield ev
