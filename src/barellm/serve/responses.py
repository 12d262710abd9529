"""The answers of the generation and embedding routes: a job's events relayed (serve/relay.py) as one JSON body or
as server-sent events, in OpenAI's shapes (api/openai.py's ResponseBuilder, framed here) or llama.cpp server's
for /infill; and the error answer every route gives.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from barellm.api import openai as openai_api
from barellm.api.openai import GenerationRequest, ResponseBuilder
from barellm.generate.scheduler import Event, Job, TokenLogprob
from barellm.serve.errors import ApiError
from barellm.serve.metrics import endpoint_label
from barellm.serve.relay import Outbox, RelayResponse
from barellm.serve.security import OLLAMA_PREFIX


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))

def _utf8(text: str) -> bytes:
    # an error message may quote a client's string, and JSON lets those hold lone surrogates
    return text.encode("utf-8", errors="replace")

class _JSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return _utf8(_dumps(content))

def error_response(state: Any, path: str, err: ApiError, headers: dict[str, str] | None = None
                   ) -> Response:
    """err as the route at path answers it: Ollama's shape ({"error": "message"}) under /api/, else OpenAI's."""
    state.metrics.error(endpoint_label(path), err.type)
    body = {"error": err.message} if path.startswith(OLLAMA_PREFIX) else err.body()
    return _JSON(body, status_code=err.status, headers=headers)

class Formatter(ResponseBuilder):
    """The answer's objects of one request (ResponseBuilder, as Model.create_* builds them), with the server's
    fingerprint, framed as server-sent events."""

    def __init__(self, state: Any, req: GenerationRequest, prompt_chars: int) -> None:
        super().__init__(req, state.model_id, state.tokenizer.token_bytes, prompt_chars=prompt_chars,
                         fingerprint=state.fingerprint)
        self._frames: dict[int, tuple[bytes, bytes]] = {}   # per choice: a text event's bytes around the text

    def closing_events(self, index: int, reason: str) -> bytes:
        return b"".join(_sse(c) for c in self.closing(index, reason))

    def text_event(self, text: str, toks: list[TokenLogprob], index: int) -> bytes:
        """The server-sent events of a run of text. A plain text chunk's bytes around the JSON of the text are the
        same for every chunk of a choice, so only the text is encoded per event."""
        if self.tool_names is not None or self.reasoning is not None or self.req.top_logprobs is not None:
            return b"".join(_sse(c) for c in self.text(index, text, toks))
        frame = self._frames.get(index)
        if frame is None:
            marker = "\u0000barellm-text\u0000"
            head, tail = _dumps(self.chunk(marker, None, index=index)).split(_dumps(marker))
            frame = self._frames[index] = (_utf8(f"data: {head}"), _utf8(f"{tail}\n\n"))
        return frame[0] + _utf8(_dumps(text)) + frame[1]

def _sse(obj: Any) -> bytes:
    return _utf8(f"data: {_dumps(obj)}\n\n")

async def _start_events(send: Send) -> None:
    """The status line and headers of a stream of server-sent events (no proxy is to buffer it)."""
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no")]})

def _api_error(ev: Event) -> ApiError:
    """A job's error event as the error OpenAI's clients read."""
    return ApiError(ev.status, ev.message, type=ev.error_type, code=ev.error_type)

class GenerationResponse(RelayResponse):
    """Relays a job's events in OpenAI's shapes: one JSON body, or server-sent events. The events that
    arrived together go out together: one write, and a run of one choice's deltas as one chunk."""

    def __init__(self, state: Any, job: Job, events: Outbox, fmt: Formatter, path: str) -> None:
        super().__init__(state, job, events, path)
        self.fmt = fmt

    async def _error(self, scope: Scope, receive: Receive, send: Send, ev: Event) -> None:
        await error_response(self.state, self.path, _api_error(ev))(scope, receive, send)

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
        generated: list[list[int]] = [[] for _ in range(n)]   # each choice's token ids (its reasoning tokens)
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
                    out.extend(_sse(_api_error(ev).body()))
                    await send({"type": "http.response.body", "body": bytes(out), "more_body": False})
                    return
                if ev.kind == "start":
                    start = ev
                    if fmt.req.stream:
                        await _start_events(send)
                        streaming = True
                        for chunk in fmt.opening(n):
                            out.extend(_sse(chunk))
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
                    generated[ev.index] = ev.token_ids
                    completion_tokens += ev.completion_tokens
                    if fmt.req.stream:
                        self._chunk(out, run)
                        run = None
                        out.extend(fmt.closing_events(ev.index, ev.finish_reason or "length"))
            self._chunk(out, run)
            finished = all(r is not None for r in reasons)
            if finished:
                assert start is not None
                usage = fmt.usage(start.prompt_tokens, start.cached_tokens, completion_tokens, generated)
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

class InfillResponse(RelayResponse):
    """llama.cpp server's answer to /infill: one object, or server-sent events of {"content", "stop": false}
    ending with the whole object ("stop": true, the counts, timings, why it stopped)."""

    def __init__(self, state: Any, job: Job, events: Outbox, stream: bool, path: str) -> None:
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
        async for ev in self._each():
            if ev.kind == "error":
                err = _api_error(ev)
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
                    await _start_events(send)
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

class EmbeddingResponse(RelayResponse):
    """OpenAI's embedding list, once the scheduler has made every vector."""

    def __init__(self, state: Any, job: Any, events: Outbox, path: str, base64: bool) -> None:
        super().__init__(state, job, events, path)
        self.base64 = base64

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        import base64

        async for ev in self._each():
            if ev.kind == "error":
                await error_response(self.state, self.path, _api_error(ev))(scope, receive, send)
                return
            if ev.kind == "embeddings":
                vectors = ([base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in ev.data]
                           if self.base64 else ev.data.tolist())
                body = openai_api.embeddings(self.state.model_id, vectors, ev.prompt_tokens)
                await _JSON(body)(scope, receive, send)
                return
