"""The OpenAI-compatible HTTP app (Starlette): validation, tokenization, and streaming the scheduler's events.

The event loop never runs the model. A generation request is validated and tokenized (in a worker
thread, as a long prompt takes a while), submitted to the Scheduler, and answered by a GenerationResponse,
which relays the scheduler's events as one JSON body or as server-sent events while it watches the
connection: a client that goes away cancels its job at once, freeing the slot before the next step.
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
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from barellm import __version__, openai_format
from barellm.errors import InvalidRequest
from barellm.serve import openapi_doc, schemas
from barellm.serve.metrics import Metrics, endpoint_label
from barellm.serve.models import Candidate, Models, Server, leasing
from barellm.serve.relay import Outbox, RelayResponse, chat_prompt, constrain, read_body, submit, submit_embeddings
from barellm.serve.scheduler import DEFAULT_PREFILL_CHUNK, Event, Job, Scheduler, TokenLogprob
from barellm.serve.schemas import ApiError, GenerationRequest, bad
from barellm.serve.security import MAX_HEADER_BYTES, Guard
from barellm.text.infill import end_rules
from barellm.text.tools import ToolCallStream, parse_tool_calls

DEFAULT_STREAM_INTERVAL = 0.02   # seconds: a streamed response's text goes out at most 50 times a second


def _run_sync(fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
    from starlette.concurrency import run_in_threadpool

    return run_in_threadpool(fn, *args)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _utf8(text: str) -> bytes:
    # an error message may quote a client's string, and JSON lets those hold lone surrogates
    return text.encode("utf-8", errors="replace")


class _JSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return _utf8(_dumps(content))


class ServerState:
    """What the handlers share: the model, the scheduler, the metrics and the served names."""

    def __init__(self, model: Any, *, model_id: str | None = None, aliases: Iterable[str] = (),
                 max_queue: int = 64, timeout: float | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 max_body: int = schemas.MAX_BODY_BYTES, stream_interval: float = DEFAULT_STREAM_INTERVAL,
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
        self.scheduler = Scheduler(model.engine, model.tokenizer, n_ctx=self.n_ctx, max_queue=max_queue,
                                   prefill_chunk=prefill_chunk, metrics=self.metrics,
                                   speculator=getattr(model, "speculator", None))

    def check_model(self, name: str | None) -> None:
        if name is not None and name.lower() not in self.names:
            raise ApiError(404, f"The model {name!r} does not exist here; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")


# --- body and errors -----------------------------------------------------------------------------

def error_response(state: ServerState, path: str, err: ApiError, headers: dict[str, str] | None = None
                   ) -> Response:
    state.metrics.error(endpoint_label(path), err.type)
    return _JSON(err.body(), status_code=err.status, headers=headers)


# --- turning events into OpenAI's shapes ---------------------------------------------------------

class Formatter:
    """Builds the response objects and stream chunks of one request (their shapes: openai_format)."""

    def __init__(self, state: ServerState, req: GenerationRequest, prompt_chars: int) -> None:
        self.state = state
        self.req = req
        self.chat = req.kind == "chat"
        self.id = openai_format.new_id(self.chat)
        self.created = int(time.time())
        self.prompt_chars = prompt_chars    # legacy logprobs' text_offset counts from the start of the prompt
        self.offsets: dict[int, int] = {}   # per choice: text_offset of its next token
        self._frames: dict[int, tuple[bytes, bytes]] = {}   # per choice: a text event's bytes around the text
        # tool calls parsed out of a chat reply (streamed: per choice, as they complete)
        self.tool_names = req.tool_names if self.chat else None
        self._calls: dict[int, Any] = {}
        self._held_lps: dict[int, list[TokenLogprob]] = {}

    def logprobs(self, toks: list[TokenLogprob], index: int = 0) -> dict[str, Any] | None:
        if self.req.top_logprobs is None:
            return None
        token_bytes = self.state.tokenizer.token_bytes
        if self.chat:
            return openai_format.chat_logprobs(toks, token_bytes, self.req.tokens_as_ids)
        out, self.offsets[index] = openai_format.completion_logprobs(
            toks, token_bytes, self.offsets.get(index, self.prompt_chars), self.req.tokens_as_ids)
        return out

    def usage(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return openai_format.usage(prompt_tokens, completion_tokens, cached_tokens)

    def _ids(self) -> dict[str, Any]:
        return {"created": self.created, "fingerprint": self.state.fingerprint}

    def whole(self, choices: list[tuple[str, list[TokenLogprob], str]], usage: dict[str, Any]) -> dict[str, Any]:
        """The response object: (text, logprobs, finish reason) of each choice."""
        body = None
        for i, (text, toks, reason) in enumerate(choices):
            lps = self.logprobs(toks, i)
            if not self.chat:
                one = openai_format.text_completion(self.id, self.state.model_id, text, reason, usage, logprobs=lps,
                                                    **self._ids())
            else:
                content: str | None = text
                calls = None
                if self.tool_names is not None:
                    content, calls = parse_tool_calls(text, self.tool_names)
                    if calls and reason == "stop":
                        reason = "tool_calls"
                    elif not calls:
                        content = text
                one = openai_format.chat_completion(self.id, self.state.model_id, content, reason, usage,
                                                    logprobs=lps, tool_calls=calls, **self._ids())
            if body is None:
                body = one
            else:
                body["choices"].append({**one["choices"][0], "index": i})
        assert body is not None
        return body

    def chunk(self, text: str | None, logprobs: dict[str, Any] | None, finish_reason: str | None = None,
              role: bool = False, index: int = 0) -> dict[str, Any]:
        if self.chat:
            out = openai_format.chat_chunk(self.id, self.state.model_id, text=text, role=role,
                                           finish_reason=finish_reason, logprobs=logprobs,
                                           with_usage=self.req.include_usage, **self._ids())
        else:
            out = openai_format.text_chunk(self.id, self.state.model_id, text=text or "", finish_reason=finish_reason,
                                           logprobs=logprobs, with_usage=self.req.include_usage, **self._ids())
        if index:
            out["choices"][0]["index"] = index
        return out

    def _tool_events(self, stream: ToolCallStream, parts: list[tuple[str, Any]], toks: list[TokenLogprob],
                     index: int) -> bytes:
        """The events of content and whole tool calls split out of a chat reply; logprobs go with the first
        event after their text (held while a call is still open)."""
        held = self._held_lps.setdefault(index, [])
        held.extend(toks)
        out = bytearray()
        for kind, p in parts:
            lps = self.logprobs(held, index) if held else (None if self.req.top_logprobs is None else
                                                           self.logprobs([], index))
            held.clear()
            if kind == "content":
                out.extend(_sse(self.chunk(p, lps, index=index)))
            else:
                ch = self.chunk(None, lps, index=index)
                ch["choices"][0]["delta"] = {"tool_calls": openai_format.tool_call_deltas([p], stream.sent)}
                stream.sent += 1
                out.extend(_sse(ch))
        return bytes(out)

    def closing_events(self, index: int, reason: str) -> bytes:
        """A choice's last events: what its tool-call parsing still holds, and the chunk with its finish reason
        ("tool_calls" when it called any and stopped of its own accord)."""
        out = b""
        stream = self._calls.pop(index, None)
        if stream is not None:
            out = self._tool_events(stream, stream.finish(), [], index)
            if stream.calls and reason == "stop":
                reason = "tool_calls"
        return out + _sse(self.chunk(None, None, finish_reason=reason, index=index))

    def text_event(self, text: str, toks: list[TokenLogprob], index: int) -> bytes:
        """The server-sent event of a run of text. The chunk's bytes around the JSON of the text are the same
        for every chunk of a choice, so only the text is encoded per event."""
        if self.tool_names is not None:
            stream = self._calls.get(index)
            if stream is None:
                stream = self._calls[index] = ToolCallStream(self.tool_names)
            return self._tool_events(stream, stream.feed(text), toks, index)
        if self.req.top_logprobs is not None:
            return _sse(self.chunk(text, self.logprobs(toks, index), index=index))
        frame = self._frames.get(index)
        if frame is None:
            marker = "\u0000barellm-text\u0000"
            head, tail = _dumps(self.chunk(marker, None, index=index)).split(_dumps(marker))
            frame = self._frames[index] = (_utf8(f"data: {head}"), _utf8(f"{tail}\n\n"))
        return frame[0] + _utf8(_dumps(text)) + frame[1]

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return openai_format.usage_chunk(self.id, self.state.model_id, self.chat, usage, **self._ids())


def _sse(obj: Any) -> bytes:
    return _utf8(f"data: {_dumps(obj)}\n\n")


class GenerationResponse(RelayResponse):
    """Relays a job's events in OpenAI's shapes: one JSON body, or server-sent events. The events that
    arrived together go out together: one write, and a run of one choice's deltas as one chunk."""

    def __init__(self, state: ServerState, job: Job, events: Outbox, fmt: Formatter, path: str) -> None:
        super().__init__(state, job, events, path)
        self.fmt = fmt

    async def _error(self, scope: Scope, receive: Receive, send: Send, ev: Event) -> None:
        err = ApiError(ev.status, ev.message, type=ev.error_type, code=ev.error_type)
        await error_response(self.state, self.path, err)(scope, receive, send)

    def _chunk(self, out: bytearray, delta: tuple[int, list[str], list[TokenLogprob]] | None) -> None:
        if delta is not None:
            i, parts, lps = delta
            out.extend(self.fmt.text_event("".join(parts), lps, i))

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        fmt = self.fmt
        n = self.job.n
        start: Event | None = None
        texts: list[list[str]] = [[] for _ in range(n)]
        toks: list[list[TokenLogprob]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        completion_tokens = 0
        streaming = False
        clock = time.perf_counter
        while True:
            evs = await self.events.batch()
            t0 = clock()
            out = bytearray()
            run: tuple[int, list[str], list[TokenLogprob]] | None = None   # one choice's deltas, merged
            for ev in evs:
                if ev is None:
                    return
                if ev.kind == "error":
                    if not streaming:
                        await self._error(scope, receive, send, ev)
                        return
                    # the status line is gone already: OpenAI's clients read an error object in the stream
                    self._chunk(out, run)
                    self.state.metrics.error(endpoint_label(self.path), ev.error_type)
                    err = ApiError(ev.status, ev.message, type=ev.error_type, code=ev.error_type)
                    out.extend(_sse(err.body()))
                    await send({"type": "http.response.body", "body": bytes(out), "more_body": False})
                    return
                if ev.kind == "start":
                    start = ev
                    if fmt.req.stream:
                        await send({"type": "http.response.start", "status": 200, "headers": [
                            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]})
                        streaming = True
                        if fmt.chat:
                            for i in range(n):
                                out.extend(_sse(fmt.chunk(None, None, role=True, index=i)))
                elif ev.kind == "delta":
                    if not fmt.req.stream:
                        texts[ev.index].append(ev.text)
                        toks[ev.index].extend(ev.tokens)
                    elif run is not None and run[0] == ev.index:
                        run[1].append(ev.text)
                        run[2].extend(ev.tokens)
                    else:
                        self._chunk(out, run)
                        run = (ev.index, [ev.text], list(ev.tokens))
                elif ev.kind == "done":
                    reasons[ev.index] = ev.finish_reason
                    completion_tokens += ev.completion_tokens
                    if fmt.req.stream:
                        self._chunk(out, run)
                        run = None
                        out.extend(fmt.closing_events(ev.index, ev.finish_reason or "length"))
            self._chunk(out, run)
            finished = all(r is not None for r in reasons)
            if finished:
                assert start is not None
                usage = fmt.usage(start.prompt_tokens, start.cached_tokens, completion_tokens)
                if not fmt.req.stream:
                    body = fmt.whole([("".join(texts[i]), toks[i], reasons[i] or "length") for i in range(n)], usage)
                    self.state.metrics.wrote(clock() - t0)
                    await _JSON(body)(scope, receive, send)
                    return
                if fmt.req.include_usage:
                    out.extend(_sse(fmt.usage_chunk(usage)))
                out.extend(b"data: [DONE]\n\n")
            if out:
                await send({"type": "http.response.body", "body": bytes(out), "more_body": not finished})
            self.state.metrics.wrote(clock() - t0)
            if finished:
                return


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


async def _generate(request: Request, state: ServerState, req: GenerationRequest, prompt_ids: list[int],
                    prompt_chars: int) -> Response:
    job, events = submit(state, req, prompt_ids)
    return GenerationResponse(state, job, events, Formatter(state, req, prompt_chars), request.url.path)


async def chat_completions(request: Request) -> Response:
    req = schemas.chat_request(await read_body(request, _state(request).max_body))
    state = await _model(request, req.model)
    assert req.messages is not None
    ids = await _run_sync(chat_prompt, state.model, req)
    return await _generate(request, state, req, ids, 0)


def _completion_prompt(model: Any, req: GenerationRequest) -> list[int]:
    constrain(model, req)
    assert isinstance(req.prompt, str)
    try:
        if req.suffix:
            ids = model.infill_prompt(req.prompt, req.suffix, max_tokens=req.max_tokens, repo_level=False)
            stops, req.min_indent = end_rules(req.prompt, req.suffix)
            req.stops = req.stops + stops
            return ids
        return model.tokenize(req.prompt)
    except InvalidRequest as e:
        raise bad(str(e), "suffix" if req.suffix else "prompt") from None


def _infill_prompt(model: Any, body: schemas.InfillRequest, req: GenerationRequest) -> list[int]:
    constrain(model, req)
    try:
        ids = model.infill_prompt(body.input_prefix, body.input_suffix, prompt=body.prompt,
                                  extra=[c.model_dump() for c in body.input_extra], max_tokens=req.max_tokens,
                                  repo_level=True)
    except InvalidRequest as e:
        raise bad(str(e), "input_prefix") from None
    stops, indent = end_rules(body.input_prefix + body.prompt, body.input_suffix)
    req.stops = req.stops + stops
    req.min_indent = body.n_indent if body.n_indent is not None and body.n_indent > 0 else indent
    return ids


class InfillResponse(RelayResponse):
    """llama.cpp server's answer to /infill: one object, or server-sent events of {"content", "stop": false}
    ending with the whole object ("stop": true, the counts, timings, why it stopped)."""

    def __init__(self, state: ServerState, job: Job, events: Outbox, stream: bool, path: str) -> None:
        super().__init__(state, job, events, path)
        self.stream = stream

    def _final(self, text: str, start: Event, done: Event, t0: float, t_first: float, t_end: float
               ) -> dict[str, Any]:
        n_prompt = start.prompt_tokens - start.cached_tokens
        prompt_ms, predicted_ms = 1000 * (t_first - t0), 1000 * (t_end - t_first)
        n = done.completion_tokens
        return {"index": 0, "content": text, "tokens": [], "id_slot": -1, "stop": True, "model": self.state.model_id,
                "tokens_predicted": n, "tokens_evaluated": start.prompt_tokens, "tokens_cached": start.cached_tokens,
                "has_new_line": "\n" in text, "truncated": False, "stop_type": done.stop_type,
                "stopping_word": done.stop_word or "",
                "timings": {"prompt_n": n_prompt, "prompt_ms": prompt_ms,
                            "prompt_per_token_ms": prompt_ms / n_prompt if n_prompt else 0.0,
                            "prompt_per_second": 1000 * n_prompt / prompt_ms if prompt_ms > 0 else 0.0,
                            "predicted_n": n, "predicted_ms": predicted_ms,
                            "predicted_per_token_ms": predicted_ms / n if n else 0.0,
                            "predicted_per_second": 1000 * n / predicted_ms if predicted_ms > 0 else 0.0}}

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        clock = time.perf_counter
        t0 = clock()
        t_first: float | None = None
        start: Event | None = None
        parts: list[str] = []
        streaming = False
        while True:
            for ev in await self.events.batch():
                if ev is None:
                    return
                if ev.kind == "error":
                    err = ApiError(ev.status, ev.message, type=ev.error_type, code=ev.error_type)
                    if not streaming:
                        await error_response(self.state, self.path, err)(scope, receive, send)
                    else:
                        self.state.metrics.error(endpoint_label(self.path), ev.error_type)
                        await send({"type": "http.response.body", "body": _sse(err.body()), "more_body": False})
                    return
                if ev.kind == "start":
                    start = ev
                    t0 = clock()
                    if self.stream:
                        await send({"type": "http.response.start", "status": 200, "headers": [
                            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]})
                        streaming = True
                elif ev.kind == "delta":
                    if t_first is None:
                        t_first = clock()
                    if streaming:
                        if ev.text:
                            piece = {"index": 0, "content": ev.text, "tokens": ev.token_ids, "stop": False,
                                     "id_slot": -1}
                            await send({"type": "http.response.body", "body": _sse(piece), "more_body": True})
                    else:
                        parts.append(ev.text)
                elif ev.kind == "done":
                    assert start is not None
                    t_end = clock()
                    final = self._final("" if streaming else "".join(parts), start, ev, t0,
                                        t_end if t_first is None else t_first, t_end)
                    if streaming:
                        await send({"type": "http.response.body", "body": _sse(final), "more_body": False})
                    else:
                        await _JSON(final)(scope, receive, send)
                    return


async def infill(request: Request) -> Response:
    body, req = schemas.infill_request(await read_body(request, _state(request).max_body))
    state = await _model(request, req.model)
    ids = await _run_sync(_infill_prompt, state.model, body, req)
    stream, req.stream = req.stream, True   # the job streams either way: its first delta times the prefill
    job, events = submit(state, req, ids)
    return InfillResponse(state, job, events, stream, request.url.path)


async def completions(request: Request) -> Response:
    raw = await read_body(request, _state(request).max_body)
    name = _model_field(raw)
    if name is None:
        schemas.completion_request(raw, 1 << 31)   # a body that is no request fails before any model loads
    state = await _model(request, name)
    req = schemas.completion_request(raw, state.n_vocab)
    if isinstance(req.prompt, str):
        ids = await _run_sync(_completion_prompt, state.model, req)
        return await _generate(request, state, req, ids, len(req.prompt))
    assert req.prompt is not None
    if req.constraint is not None:
        await _run_sync(constrain, state.model, req)
    return await _generate(request, state, req, list(req.prompt), 0)


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
    if name is None:
        schemas.detokenize_request(raw, 1 << 31)
    state = await _model(request, name)
    ids = schemas.detokenize_request(raw, state.n_vocab)
    try:
        text = await _run_sync(state.model.detokenize, ids)
    except InvalidRequest as e:
        raise bad(str(e), "tokens") from None
    return _JSON({"content": text})


class EmbeddingResponse(RelayResponse):
    """OpenAI's embedding list, once the scheduler has made every vector."""

    def __init__(self, state: ServerState, job: Any, events: Outbox, path: str, base64: bool) -> None:
        super().__init__(state, job, events, path)
        self.base64 = base64

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        import base64

        while True:
            for ev in await self.events.batch():
                if ev is None:
                    return
                if ev.kind == "error":
                    err = ApiError(ev.status, ev.message, type=ev.error_type, code=ev.error_type)
                    await error_response(self.state, self.path, err)(scope, receive, send)
                    return
                if ev.kind == "embeddings":
                    vectors = ([base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in ev.data]
                               if self.base64 else ev.data.tolist())
                    body = openai_format.embeddings(self.state.model_id, vectors, ev.prompt_tokens)
                    await _JSON(body)(scope, receive, send)
                    return


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
    if request.url.path.startswith("/api/"):   # Ollama's routes answer in Ollama's shape
        _state(request).metrics.error(endpoint_label(request.url.path), "invalid_request_error")
        return _JSON({"error": msg}, status_code=exc.status_code, headers=dict(exc.headers or {}))
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
               max_body: int = schemas.MAX_BODY_BYTES, api_key: str | None = None,
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
                  max_body: int = schemas.MAX_BODY_BYTES, api_key: str | None = None,
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
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", leasing(tokenize), methods=["POST"]),
        Route("/detokenize", leasing(detokenize), methods=["POST"]),
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


def run(app: Starlette, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info",
        limits: Any = None) -> None:
    """Serves app with uvicorn until interrupted."""
    import uvicorn

    uvicorn.Server(server_config(app, host, port, log_level, limits)).run()
