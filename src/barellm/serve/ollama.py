"""Ollama-compatible routes, so tools that speak Ollama's API use this server unchanged.

/api/chat and /api/generate become the same GenerationRequest the OpenAI routes make and go down the
same path to the scheduler (app.submit); only the answer's shape differs: newline-delimited JSON objects
(or one object with "stream": false), errors as {"error": "..."}.

Options map onto barellm's sampling parameters by name (temperature, top_k, top_p, min_p, seed, stop,
repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty; num_predict is max_tokens, -1 and -2
the rest of the context). The rules for the others:
- num_ctx: the context is fixed when the server starts; a request asking for at most that much is served
  (the setting is ignored), one asking for more is refused, rather than silently cut short.
- options that tune how Ollama's runtime loads and runs a model (num_batch, num_gpu, num_thread, use_mmap,
  ...) are ignored: they do not change what is generated.
- sampling methods barellm does not implement (mirostat, typical_p, tfs_z) are refused unless off.
- draft (barellm's own): false turns speculative decoding off for the request, as /v1's "draft" field does.
- anything else is an unknown option: a 400 naming it, as on the OpenAI routes.

`format` ("json" or a JSON schema) constrains the answer as response_format does on /v1; /api/chat's
`tools` are rendered and parsed as on /v1 (tool_choice "auto": Ollama has no other), its answer's
message.tool_calls in Ollama's shape ({"function": {"name", "arguments": {...}}}), and `tool` messages carry
the results back. `think` asks a reasoning model's template for its thinking (or not, or a level) on both
routes, and the reply is split as on /v1 into the thinking (message.thinking; /api/generate's `thinking`) and
the answer; a raw /api/generate prompt has no template, so its reply is split only when think asks for it.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from barellm import __version__
from barellm.api.openai import GenerationRequest, ResponseBuilder
from barellm.errors import InvalidRequest
from barellm.generate.scheduler import Event
from barellm.serve import lifecycle, schema_types, schemas
from barellm.serve.errors import ApiError, bad
from barellm.serve.lifecycle import _details, _details_of_file, _digest, _leased, _tag
from barellm.serve.models import leasing
from barellm.serve.relay import RelayResponse, prepare, read_body, submit
from barellm.serve.schema_types import (
    MAX_STOP_CHARS,
    MAX_STOPS,
    Duration,
    Int,
    Penalty,
    Prob,
    _Body,
    _either_of,
    _off,
)

# The Ollama release whose API these routes follow; tools read /api/version to decide what to send.
OLLAMA_API_VERSION = "0.6.0"


class OllamaOptions(_Body):
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_k: Annotated[Int, Field(ge=0, le=1 << 31)] | None = None
    top_p: Prob | None = None
    min_p: Prob | None = None
    num_predict: Annotated[Int, Field(ge=-2, le=1 << 31)] | None = Field(
        None, description="tokens to generate at most; -1 or -2: the rest of the context")
    seed: Annotated[Int, Field(ge=-schema_types.INT64, le=(1 << 64) - 1)] | None = None
    stop: Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOPS)] | None = None
    repeat_penalty: Annotated[float, Field(ge=1e-6, le=10)] | None = None
    repeat_last_n: Annotated[Int, Field(ge=-1, le=1 << 31)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    num_ctx: Annotated[Int, Field(ge=1)] | None = Field(
        None, description="served if at most the server's context (then ignored), else refused")
    draft: bool | None = Field(None, description="extension: false turns speculative decoding off for this request "
                                                 "(where the server drafts: barellm serve --draft); the output is "
                                                 "the same either way")
    # how Ollama's runtime loads and runs a model: ignored
    num_keep: Int | None = None
    num_batch: Int | None = None
    num_gpu: Int | None = None
    main_gpu: Int | None = None
    num_thread: Int | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    penalize_newline: bool | None = None
    # sampling methods barellm does not implement: accepted when off
    mirostat: Annotated[Int | None, _off("mirostat", (0,), "send 0")] = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    typical_p: Annotated[float | None, _off("typical_p", (1.0,), "send 1.0")] = None
    tfs_z: Annotated[float | None, _off("tfs_z", (1.0,), "send 1.0")] = None


# barellm's generation options and the Ollama options they are (Model.defaults holds the former)
_OPTION_NAMES = {"max_tokens": "num_predict", "stop": "stop", "temperature": "temperature", "top_k": "top_k",
                 "top_p": "top_p", "min_p": "min_p", "repeat_penalty": "repeat_penalty",
                 "repeat_last_n": "repeat_last_n", "seed": "seed", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty"}


def with_model_params(o: OllamaOptions, state: Any) -> OllamaOptions:
    """A request's options with the model's own defaults (an Ollama model's params layer: stop strings,
    temperature, ...) where the request leaves them out, as Ollama applies a Modelfile's PARAMETERs."""
    stated = getattr(getattr(state, "model", None), "defaults", None) or {}
    fill = {theirs: stated[ours] for ours, theirs in _OPTION_NAMES.items()
            if ours in stated and getattr(o, theirs, None) is None}
    if not fill:
        return o
    try:
        return OllamaOptions.model_validate({**fill, **o.model_dump(exclude_none=True)})
    except ValueError:   # a params layer with values no request could send: the request's own options alone
        return o


class _OllamaGenerate(_Body):
    model: str = Field(min_length=1)
    stream: bool = True
    options: OllamaOptions | None = None
    format: Annotated[Literal["json", ""] | dict[str, Any] | None, Field(
        description='"json" (any JSON object) or a JSON schema the answer follows')] = None
    keep_alive: float | Duration | None = Field(
        None, description='how long the model stays loaded after this request: seconds or a duration ("5m"); '
                          '0 unloads it at once, a negative value keeps it loaded (default: the server\'s, 5m)')
    think: bool | Literal["low", "medium", "high"] | None = Field(
        None, description="a reasoning model's thinking: true or unset, returned in thinking (/api/chat: "
                          "message.thinking); false, asked off (Qwen3's enable_thinking) and left out; a level, "
                          "gpt-oss's reasoning effort")
    logprobs: Annotated[bool | None, _off("logprobs", (False,), "not on the Ollama routes; /v1 has them")] = None
    top_logprobs: Annotated[Int | None, _off("top_logprobs", (), "not on the Ollama routes; /v1 has them")] = None

    def generation(self, state: Any, kind: str) -> GenerationRequest:
        o = with_model_params(self.options or OllamaOptions(), state)
        if o.num_ctx is not None and o.num_ctx > state.n_ctx:
            raise bad(f"num_ctx {o.num_ctx} is more than this server's context of {state.n_ctx} tokens "
                      "(set when it starts: barellm serve -c N)", "options.num_ctx")
        sampling = schemas._Sampling(
            temperature=o.temperature, top_k=o.top_k, top_p=o.top_p, min_p=o.min_p, seed=o.seed, stop=o.stop,
            repeat_penalty=o.repeat_penalty, repeat_last_n=o.repeat_last_n, presence_penalty=o.presence_penalty,
            frequency_penalty=o.frequency_penalty, stream=self.stream, draft=True if o.draft is None else o.draft)
        req = sampling.generation(kind)
        req.model = self.model
        req.max_tokens = o.num_predict if o.num_predict is not None and o.num_predict >= 0 else None
        if req.max_tokens == 0:
            req.max_tokens = None   # Ollama reads 0 as no limit set
        req.short_default = False   # Ollama generates until the end of the turn or of the context
        req.clamp_max_tokens = True
        if self.format == "json":
            req.constraint = schemas.Constraint("json_object", None, "format")
        elif isinstance(self.format, dict):
            req.constraint = schemas.Constraint("json_schema", self.format, "format")
        return req

    def reasoning(self, req: GenerationRequest) -> None:
        """think as the template variables that ask for it (text/reasoning.template_kwargs)."""
        from barellm.text.reasoning import template_kwargs

        effort = self.think if isinstance(self.think, str) else None
        req.template_kwargs = template_kwargs({"enable_thinking": False} if self.think is False else None, effort)


class OllamaFunctionCall(_Body):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: Int | None = None


class OllamaToolCall(_Body):
    function: OllamaFunctionCall
    id: str | None = None
    type: Literal["function"] | None = None


class OllamaMessage(_Body):
    # what as_dict() requires beyond the fields' types, stated in the document: tool calls on an assistant's
    # message only
    model_config = ConfigDict(json_schema_extra=_either_of(schemas._role_is("assistant"), schemas._NO_CALLS))

    role: Literal["system", "user", "assistant", "tool"] = Field(description="tool: a tool's result")
    content: str = ""
    images: Annotated[list[Any] | None, _off("images", ([],), "this model reads text only")] = None
    tool_calls: list[OllamaToolCall] | None = Field(None, description="an assistant's earlier tool calls")
    tool_name: str | None = Field(None, description="the function a tool message answers")
    thinking: str | None = Field(None, description="an assistant's earlier reasoning: rendered where the model's "
                                                   "template renders it")

    def as_dict(self, i: int) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.thinking and self.role == "assistant":
            out["thinking"] = self.thinking
        if self.tool_calls:
            if self.role != "assistant":
                raise bad(f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                          f"messages[{i}].tool_calls")
            out["tool_calls"] = [{"id": c.id or f"call_{i}_{j}", "type": "function", "function": {
                "name": c.function.name, "arguments": json.dumps(c.function.arguments, ensure_ascii=False)}}
                for j, c in enumerate(self.tool_calls)]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_name or ""
        return out


class OllamaChatRequest(_OllamaGenerate):
    messages: list[OllamaMessage] = Field(default_factory=list, max_length=schema_types.MAX_MESSAGES)
    tools: Annotated[list[schemas.Tool], Field(max_length=128)] | None = Field(
        None, description="functions the model may call (OpenAI's tool objects)")


class OllamaGenerateRequest(_OllamaGenerate):
    prompt: str = ""
    system: str | None = None
    raw: bool = Field(False, description="true: the prompt as it is, no chat template (a reasoning model's "
                                         "thinking is split off only when think is true or a level)")
    context: list[Annotated[Int, Field(ge=0)]] | None = Field(
        None, description="token ids an earlier response returned: the conversation so far")
    suffix: Annotated[str | None, _off("suffix", ("",), "no fill-in-the-middle")] = None
    template: Annotated[str | None, _off("template", ("",), "the model's chat template is used")] = None
    images: Annotated[list[Any] | None, _off("images", ([],), "this model reads text only")] = None


class OllamaShowRequest(_Body):
    model_config = lifecycle.NAMED

    model: str | None = None
    name: str | None = None   # older clients
    verbose: bool | None = None


MODELS = [OllamaChatRequest, OllamaGenerateRequest, OllamaShowRequest]
_NDJSON = "with stream true (the default): one JSON object per line, the last with done: true"
PATHS: dict[str, Any] = {
    "/api/chat": {"post": {"summary": "Ollama: chat", "operationId": "ollamaChat", "tags": ["ollama"],
                           "requestBody": {"required": True, "content": {"application/json": {
                               "schema": {"$ref": "#/components/schemas/OllamaChatRequest"}}}},
                           "responses": {"200": {"description": _NDJSON}}}},
    "/api/generate": {"post": {"summary": "Ollama: completion", "operationId": "ollamaGenerate", "tags": ["ollama"],
                               "requestBody": {"required": True, "content": {"application/json": {
                                   "schema": {"$ref": "#/components/schemas/OllamaGenerateRequest"}}}},
                               "responses": {"200": {"description": _NDJSON}}}},
    "/api/show": {"post": {"summary": "Ollama: the model's details", "operationId": "ollamaShow", "tags": ["ollama"],
                           "requestBody": {"required": True, "content": {"application/json": {
                               "schema": {"$ref": "#/components/schemas/OllamaShowRequest"}}}},
                           "responses": {"200": {"description": "details, template, model_info"}}}},
    "/api/tags": {"get": {"summary": "Ollama: the served model", "operationId": "ollamaTags", "tags": ["ollama"],
                          "responses": {"200": {"description": "{models: [...]}"}}}},
    "/api/version": {"get": {"summary": "Ollama: the API version followed", "operationId": "ollamaVersion",
                             "tags": ["ollama"], "responses": {"200": {"description": "{version}"}}}},
}

MODELS += lifecycle.MODELS   # pull, delete, copy, embed, ps: serve/lifecycle.py
PATHS.update(lifecycle.PATHS)

# --- helpers ---------------------------------------------------------------------------------------

def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _line(obj: Any) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8", errors="replace")


def _error(status: int, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status)


def _state(request: Request) -> Any:
    return request.app.state.server


def _modified(created: float) -> str:
    return datetime.fromtimestamp(created, timezone.utc).isoformat().replace("+00:00", "Z")


# --- the generation answer -------------------------------------------------------------------------

class OllamaResponse(RelayResponse):
    """Relays a job's events as Ollama's objects: one per line while streaming, or one in all."""

    def __init__(self, state: Any, job: Any, events: Any, req: GenerationRequest, path: str, stream: bool,
                 model_name: str, load_seconds: float = 0.0, think: bool | str | None = None) -> None:
        super().__init__(state, job, events, path)
        self.req = req
        self.stream = stream
        self.load_ns = int(load_seconds * 1e9)
        self.chat = req.kind == "chat"
        self.model_name = model_name
        self.prompt_ids = list(req.prompt)
        self.t0 = time.perf_counter_ns()
        # the tool calls and the reasoning of a chat reply are parsed as on /v1 (the same builder), then given
        # Ollama's shape (message.thinking: a reasoning model's, unless think is false)
        self.calls = ResponseBuilder(req, model_name, state.tokenizer.token_bytes) \
            if req.tool_names is not None or req.reasoning is not None else None
        self.thinking = think is not False

    def _piece(self, text: str, calls: list[dict[str, Any]] | None = None, thinking: str | None = None
               ) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model_name, "created_at": _now()}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
            if thinking and self.thinking:
                out["message"]["thinking"] = thinking
            if calls:
                out["message"]["tool_calls"] = [_ollama_call(c) for c in calls]
        else:
            out["response"] = text
            if thinking and self.thinking:
                out["thinking"] = thinking
        out["done"] = False
        return out

    def _pieces(self, text: str, final: bool = False) -> list[bytes]:
        """The lines of a run of text: as it is, or split into content and tool calls."""
        if self.calls is None:
            return [_line(self._piece(text))] if text else []
        parts = self.calls.split(0, text, final)
        if not self.thinking:
            parts = [(kind, p) for kind, p in parts if kind != "reasoning"]
        return [_line(self._piece(p) if kind == "content" else
                      self._piece("", thinking=p) if kind == "reasoning" else self._piece("", [p]))
                for kind, p in parts]

    def _final(self, text: str, done: Event, t_start: int, t_first: int | None, ids: list[int]) -> dict[str, Any]:
        calls, thinking = None, None
        if self.calls is not None and text:
            content, calls, _ = self.calls.calls(text, "stop")
            thinking = self.calls.reasoning_of(-1)
            text = content or ""
        out = self._piece(text, calls, thinking)
        now = time.perf_counter_ns()
        first = t_first if t_first is not None else now
        out.update(done=True, done_reason=done.finish_reason, total_duration=now - self.t0 + self.load_ns,
                   load_duration=self.load_ns,
                   prompt_eval_count=done.prompt_tokens, prompt_eval_duration=first - t_start,
                   eval_count=done.completion_tokens, eval_duration=now - first)
        if not self.chat:
            out["context"] = self.prompt_ids + ids
        return out

    async def _error(self, scope: Scope, receive: Receive, send: Send, ev: Event) -> None:
        self.state.metrics.error("other", ev.error_type)
        await _error(ev.status, ev.message)(scope, receive, send)

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        ev = await self.events.get()
        if ev is None:
            return
        if ev.kind == "error":
            await self._error(scope, receive, send, ev)
            return
        t_start = time.perf_counter_ns()
        t_first: int | None = None
        parts: list[str] = []
        ids: list[int] = []
        if self.stream:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})
        while True:
            ev = await self.events.get()
            if ev is None:
                return
            if ev.kind == "delta":
                t_first = t_first if t_first is not None else time.perf_counter_ns()
                ids += ev.token_ids
                if self.stream:
                    lines = self._pieces(ev.text)
                    if lines:
                        await send({"type": "http.response.body", "body": b"".join(lines), "more_body": True})
                else:
                    parts.append(ev.text)
            elif ev.kind == "done":
                final = self._final("".join(parts), ev, t_start, t_first, ids)
                if self.stream:
                    rest = b"".join(self._pieces("", final=True))
                    await send({"type": "http.response.body", "body": rest + _line(final), "more_body": False})
                else:
                    await JSONResponse(final)(scope, receive, send)
                return
            elif ev.kind == "error":
                if not self.stream:
                    await self._error(scope, receive, send, ev)
                    return
                self.state.metrics.error("other", ev.error_type)
                await send({"type": "http.response.body", "body": _line({"error": ev.message}), "more_body": False})
                return


# --- handlers --------------------------------------------------------------------------------------

def _ollama_errors(handler: Any) -> Any:
    """Ollama's error shape, {"error": "message"}, for whatever the shared code refuses."""
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as e:
            _state(request).metrics.error("other", e.type)
            return _error(e.status, e.message)
    wrapped.__name__ = handler.__name__
    return wrapped


def _loaded(model: str, chat: bool, lease: Any) -> Response:
    """Ollama answers a request with nothing to generate by loading the model (done_reason "load"), or, with
    keep_alive 0, by unloading it (done_reason "unload": it goes once this answer is sent)."""
    out: dict[str, Any] = {"model": model, "created_at": _now()}
    out.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    gone = lease.loaded.keep_alive is not None and lease.loaded.keep_alive <= 0
    out.update(done=True, done_reason="unload" if gone else "load", load_duration=int(lease.load_seconds * 1e9))
    return JSONResponse(out)


def _respond(request: Request, state: Any, req: GenerationRequest, model: str, load_seconds: float,
             think: bool | str | None = None) -> Response:
    """submit(), the job streaming its deltas either way (the first one times the prompt's evaluation, so a
    non-streamed answer's eval_duration is the decode's real time), and its answer in Ollama's shape."""
    stream, req.stream = req.stream, True
    job, events = submit(state, req)
    return OllamaResponse(state, job, events, req, request.url.path, stream, model, load_seconds, think)


@_ollama_errors
async def chat(request: Request) -> Response:
    body, lease = await _leased(request, OllamaChatRequest)
    state = lease.state
    req = body.generation(state, "chat")
    if not body.messages:
        return _loaded(body.model, True, lease)
    req.messages = [m.as_dict(i) for i, m in enumerate(body.messages)]
    body.reasoning(req)
    if body.tools:
        req.tools = [t.model_dump(exclude_none=True) for t in body.tools]
        names = [t["function"]["name"] for t in req.tools]
        if len(set(names)) != len(names):
            raise bad("a function is defined twice in tools", "tools")
    await _run(prepare, state.model, req)
    return _respond(request, state, req, body.model, lease.load_seconds, body.think)


@_ollama_errors
async def generate(request: Request) -> Response:
    body, lease = await _leased(request, OllamaGenerateRequest)
    state = lease.state
    req = body.generation(state, "completion")
    if not body.prompt and not body.context:
        return _loaded(body.model, False, lease)
    await _run(prepare, state.model, req)   # the constraint; the prompt is Ollama's, below
    fmt = getattr(state.model, "reasoning_format", None)
    fmt = fmt if isinstance(fmt, str) else None
    try:
        if body.raw:
            ids = await _run(state.model.tokenize, body.prompt, not body.context)
            # a raw prompt is the client's own template: its reply is split only when think asks for it
            # (true or a level, which reaches no template here), inside <think> when the prompt left it open
            if fmt is not None and body.think not in (None, False):
                from barellm.text.reasoning import THINK, opens_inside

                req.reasoning, req.reasoning_inside = fmt, fmt == THINK and opens_inside(body.prompt)
        else:
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
                [{"role": "user", "content": body.prompt}]
            body.reasoning(req)
            if hasattr(state.model, "_chat_prompt"):
                ids, req.reasoning_inside = await _run(state.model._chat_prompt, messages, True, None,
                                                       req.template_kwargs)
                req.reasoning = fmt
            else:   # a model that only renders (no reasoning, no template variables)
                ids = await _run(state.model.chat_prompt, messages)
            if body.context:   # the conversation goes on: no second BOS
                bos = state.tokenizer.bos_id
                ids = ids[1:] if ids and ids[0] == bos else ids
    except InvalidRequest as e:
        raise bad(str(e), "prompt") from None
    if body.context:
        schemas._check_ids(body.context, state.n_vocab, "context")
        ids = list(body.context) + ids
    req.prompt = ids
    return _respond(request, state, req, body.model, lease.load_seconds, body.think)


def _ollama_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call in Ollama's shape: the arguments as an object (a string when not JSON)."""
    try:
        args = json.loads(call["function"]["arguments"])
    except ValueError:
        args = call["function"]["arguments"]
    return {"id": call.get("id") or "call_" + uuid.uuid4().hex[:24],
            "function": {"name": call["function"]["name"], "arguments": args}}


async def _run(fn: Any, *args: Any) -> Any:
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args)


def _entry(server: Any, cand: Any) -> dict[str, Any]:
    """A model as /api/tags lists it."""
    m = server.models.loaded.get(cand.name)
    details = _details(m.state) if m is not None else _details_of_file(cand.path, cand.modified)
    return {"name": _tag(cand.name), "model": _tag(cand.name), "modified_at": _modified(cand.modified),
            "size": cand.size, "digest": _digest(cand), "details": details}


async def tags(request: Request) -> Response:
    server = _state(request)
    return JSONResponse({"models": [_entry(server, c) for c in server.models.catalog(refresh=True)]})


@_ollama_errors
async def show(request: Request) -> Response:
    server = _state(request)
    body = schemas.parse(OllamaShowRequest, await read_body(request, server.max_body))
    name = body.model or body.name
    if not name:
        raise bad("model is required", "model")
    state = (await server.lease(request, name)).state
    details = _details(state)
    md = getattr(state.model, "metadata", {}) or {}
    arch = details["family"]
    info = {k: v for k, v in md.items() if isinstance(v, (str, int, float, bool)) and not k.startswith("tokenizer.")}
    info[f"{arch}.context_length"] = state.n_ctx
    template = getattr(getattr(state.model, "template", None), "source", "")
    from barellm.store import presets

    preset = presets.find(state.model_id)   # a preset: its FROM, system prompt and parameters, as Ollama shows
    lines = []
    for key, value in (preset.parameters.items() if preset is not None else ()):
        lines += [f"{key} {json.dumps(v) if isinstance(v, str) else v}" for v in (value if isinstance(value, list)
                                                                                else [value])]
    source = preset.base if preset is not None else state.model_id
    modelfile = f"# served by barellm {__version__}\nFROM {source}\n" + "".join(f"PARAMETER {p}\n" for p in lines)
    out: dict[str, Any] = {}
    if preset is not None and preset.system:
        modelfile += f'SYSTEM """{preset.system}"""\n'
        out["system"] = preset.system
    return JSONResponse({
        "modelfile": modelfile, **out,
        "parameters": "\n".join(lines), "template": template, "details": details, "model_info": info,
        "capabilities": ["completion"], "modified_at": _modified(state.created)})


async def version(request: Request) -> Response:
    return JSONResponse({"version": OLLAMA_API_VERSION})


def lifecycle_routes() -> list[Route]:
    return lifecycle.routes()


def routes() -> list[Route]:
    return [
        Route("/api/chat", leasing(chat), methods=["POST"]),
        Route("/api/generate", leasing(generate), methods=["POST"]),
        Route("/api/show", leasing(show), methods=["POST"]),
        Route("/api/tags", tags, methods=["GET"]),
        Route("/api/version", version, methods=["GET"]),
        *lifecycle_routes(),
    ]
