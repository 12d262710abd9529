"""From a validated request to the scheduler and back, whichever API the request came through: reading the
body, submitting the job (the one path every generation takes), and relaying its events to the client while
watching the connection, so a client that goes away cancels its job at once.

The scheduler never waits for the event loop: it appends a job's events to the job's Outbox, which wakes
the loop once per batch of them. (The event loop shares the cores with the engine's threads: every wake-up
takes a slice of a core from a forward pass.)"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from barellm.errors import InvalidRequest
from barellm.serve.scheduler import EmbedJob, Event, Job, QueueFull
from barellm.serve.schemas import ApiError, GenerationRequest, bad

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


def chat_prompt(model: Any, req: GenerationRequest) -> list[int]:
    """The prompt of a chat request, its output constraint compiled (constrain): token ids through the model's
    template, with the request's tools when their calls are parsed; a 400 naming `messages` when the
    template refuses them. Both APIs' chat routes run it off the event loop."""
    constrain(model, req)
    try:
        if req.tool_names is not None:
            return model.chat_prompt(req.messages, tools=req.tools)
        return model.chat_prompt(req.messages)
    except InvalidRequest as e:
        raise bad(str(e), "messages") from None


def constrain(model: Any, req: GenerationRequest) -> None:
    """Compiles the request's output constraint into req.grammar (response_format, json_schema, grammar,
    regex, or tool_choice "required" / a named function) and decides whether tool calls are parsed out of
    the reply (req.tool_names). A 400 naming the field when it cannot be served. Runs off the event loop:
    compiling a large schema takes a while, and the first one builds the model's vocabulary for llguidance."""
    from barellm.structured import StructuredUnavailable
    from barellm.text.tools import resolve_choice

    param = req.constraint.param if req.constraint is not None else "tool_choice"
    try:
        c = req.constraint
        if c is not None:
            vocab = model.structured()
            if c.kind == "json_object":
                req.grammar = vocab.json_object(c.param)
            elif c.kind == "json_schema":
                req.grammar = vocab.json_schema(c.value, c.param)
            elif c.kind == "grammar":
                req.grammar = vocab.lark(c.value, c.param)
            else:
                req.grammar = vocab.regex(c.value, c.param)
        if req.kind == "chat":
            mode, name = resolve_choice(req.tools, req.tool_choice)
            if mode in ("required", "function"):
                param = "tool_choice"
                req.grammar = model.tool_grammar(req.tools, mode, name, req.parallel_tool_calls)
            if mode != "none" and req.tools:
                req.tool_names = [t["function"]["name"] for t in req.tools]
    except StructuredUnavailable as e:
        raise ApiError(400, str(e), param=param, code="unsupported_parameter") from None
    except InvalidRequest as e:
        raise bad(str(e), param) from None


def submit(state: Any, req: GenerationRequest, prompt_ids: list[int]) -> tuple[Job, Outbox]:
    """Checks the prompt against the context and queues the job: the one path every API's generation
    requests take to the scheduler. Returns the job and the outbox its events arrive in."""
    if not prompt_ids:
        raise bad("the prompt is empty (it encodes to no tokens)", "prompt" if req.kind == "completion" else "messages")
    room = state.n_ctx - len(prompt_ids)
    if room < 1:
        raise bad(f"the prompt has {len(prompt_ids)} tokens; this server's context holds {state.n_ctx}, "
                  "including the reply", "messages" if req.kind == "chat" else "prompt", "context_length_exceeded")
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = room if req.kind == "chat" or not req.short_default else min(room, COMPLETIONS_DEFAULT_MAX_TOKENS)
    elif max_tokens > room:
        if not req.clamp_max_tokens:
            raise bad(f"the prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}: together over the "
                      f"context of {state.n_ctx} tokens", "max_tokens", "context_length_exceeded")
        max_tokens = room
    n_slots = state.scheduler.n_slots
    if req.n > n_slots:
        raise bad(f"n = {req.n} needs {req.n} free slots at once; this server has {n_slots} (barellm serve --slots)",
                  "n")
    bias = req.params.logit_bias
    if bias and max(bias) >= state.n_vocab:
        raise bad(f"logit_bias names token {max(bias)}, outside the vocabulary (0..{state.n_vocab - 1})",
                  "logit_bias")
    events = Outbox(asyncio.get_running_loop())
    job = Job(prompt=prompt_ids, params=req.params, max_tokens=max_tokens, emit=events.push, stops=req.stops,
              top_logprobs=req.top_logprobs, timeout=state.timeout, cache_prompt=req.cache_prompt, n=req.n,
              stream=req.stream, stream_interval=getattr(state, "stream_interval", 0.0), grammar=req.grammar,
              min_indent=req.min_indent, draft=req.draft)
    _enqueue(state, job)
    return job, events


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
