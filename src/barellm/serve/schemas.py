"""Request validation for the OpenAI-compatible endpoints, the error shape, and the OpenAPI document.

Every check raises ApiError, which the app turns into OpenAI's error object
{"error": {"message", "type", "param", "code"}} with a 4xx status. Validation is strict about what it
knows: a field of the wrong type or out of range, or an unknown field (OpenAI answers those with 400,
and silently ignoring a misspelt "max_token" would hide the mistake), is an error. Fields of OpenAI's
API that barellm does not implement are accepted only with their "off" value (tools: [], n: 1, ...).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from barellm.sampling import SamplingParams

MAX_BODY_BYTES = 1 << 20
MAX_STOPS = 16
MAX_STOP_CHARS = 1000
MAX_MESSAGES = 4096
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 128       # n; the server also needs one free slot per choice
MAX_LOGIT_BIAS = 300    # entries of logit_bias (OpenAI's limit)
MAX_JSON_DEPTH = 64
INT64 = 1 << 63


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# --- JSON ----------------------------------------------------------------------------------------

def parse_json(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise bad("the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad("the JSON body is nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the body must be a JSON object, got {_json_type(body)}", code="invalid_json")
    if _depth(body) > MAX_JSON_DEPTH:
        raise bad("the JSON body is nested too deeply", code="invalid_json")
    return body


def _depth(x: Any, limit: int = MAX_JSON_DEPTH + 1) -> int:
    # iterative, so a hostile body cannot exhaust the stack here either
    deepest = 0
    stack: list[tuple[Any, int]] = [(x, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if deepest >= limit:
            return deepest
        if isinstance(v, dict):
            stack.extend((c, d + 1) for c in v.values())
        elif isinstance(v, list):
            stack.extend((c, d + 1) for c in v)
    return deepest


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


# --- field readers -------------------------------------------------------------------------------

def _text(v: Any, param: str) -> str:
    """A string that can be encoded as UTF-8 (JSON allows lone surrogates; the tokenizer does not)."""
    if not isinstance(v, str):
        raise bad(f"{param} must be a string, got {_json_type(v)}", param)
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"{param} contains a lone UTF-16 surrogate", param) from None
    return v


def _bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{name} must be a boolean, got {_json_type(v)}", name)
    return v


def _int(body: Mapping[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer() and abs(v) < INT64:
        v = int(v)   # JSON has one number type; 16.0 means 16
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad(f"{name} must be an integer, got {_json_type(v)}", name)
    if not lo <= v <= hi:
        raise bad(f"{name} must be in {lo}..{hi}, got {v}", name)
    return v


def _num(body: Mapping[str, Any], name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise bad(f"{name} must be a number, got {_json_type(v)}", name)
    v = float(v)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise bad(f"{name} must be in [{lo:g}, {hi:g}], got {v}", name)
    return v


def _off(body: Mapping[str, Any], name: str, allowed: tuple[Any, ...], what: str) -> None:
    """A field barellm does not implement: only its neutral values pass."""
    v = body.get(name)
    if v is None or any(v == a and type(v) is type(a) for a in allowed):
        return
    raise bad(f"{name} is not supported by this server ({what})", name, "unsupported_parameter")


def _stops(body: Mapping[str, Any]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise bad(f"stop must be a string or an array of strings, got {_json_type(v)}", "stop")
    if len(v) > MAX_STOPS:
        raise bad(f"stop takes at most {MAX_STOPS} strings, got {len(v)}", "stop")
    out = []
    for i, s in enumerate(v):
        s = _text(s, f"stop[{i}]")
        if len(s) > MAX_STOP_CHARS:
            raise bad(f"stop[{i}] is longer than {MAX_STOP_CHARS} characters", "stop")
        if s:
            out.append(s)
    return out


# --- requests ------------------------------------------------------------------------------------

@dataclass
class GenerationRequest:
    kind: str                                  # "chat" or "completion"
    model: str | None
    params: SamplingParams
    max_tokens: int | None                     # None: the rest of the context (chat) / 16 (completions)
    stops: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None            # None: no logprobs
    tokens_as_ids: bool = False                # logprobs name tokens "token_id:<id>" (vLLM's extension)
    cache_prompt: bool = True                  # reuse a slot's cached prefix (llama.cpp server's extension)
    n: int = 1                                 # choices, sharing the prompt's KV cache
    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None


_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n",
    "stop", "seed", "presence_penalty", "frequency_penalty", "logprobs", "n", "stream", "stream_options",
    "user", "logit_bias", "metadata", "store", "service_tier", "return_tokens_as_token_ids", "cache_prompt",
}
CHAT_FIELDS = _COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "functions", "function_call", "response_format", "modalities", "reasoning_effort",
}
COMPLETION_FIELDS = _COMMON | {"prompt", "best_of", "echo", "suffix"}

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# keys a client echoes back from an earlier response; accepted when empty
_ECHOED_KEYS = {"refusal", "tool_calls", "function_call", "audio", "annotations", "reasoning_content"}


def _common(body: dict[str, Any], kind: str, allowed: set[str]) -> GenerationRequest:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"unrecognized request argument: {unknown[0]}", unknown[0], "unknown_parameter")
    model = body.get("model")
    if model is not None:
        model = _text(model, "model")
    n = _int(body, "n", 1, MAX_CHOICES) or 1
    if body.get("user") is not None:
        _text(body["user"], "user")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise bad("metadata must be an object", "metadata")
    _bool(body, "store")
    if body.get("service_tier") is not None:
        _text(body["service_tier"], "service_tier")
    logit_bias = _logit_bias(body.get("logit_bias"))

    temperature = _num(body, "temperature", 0.0, 2.0)
    top_p = _num(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        top_p = 1e-9   # OpenAI allows 0: keep only the most likely token
    top_k = _int(body, "top_k", 0, 1 << 31)
    min_p = _num(body, "min_p", 0.0, 1.0)
    repeat_penalty = _num(body, "repeat_penalty", 1e-6, 10.0)
    repeat_last_n = _int(body, "repeat_last_n", -1, 1 << 31)
    presence = _num(body, "presence_penalty", -2.0, 2.0)
    frequency = _num(body, "frequency_penalty", -2.0, 2.0)
    seed = _int(body, "seed", -INT64, (1 << 64) - 1)
    params = SamplingParams().with_(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty,
        repeat_last_n=repeat_last_n, presence_penalty=presence, frequency_penalty=frequency,
    )
    # NumPy's generator wants a non-negative seed; OpenAI takes any 64-bit one
    params = SamplingParams(**{**params.__dict__, "seed": None if seed is None else seed % (1 << 64),
                               "logit_bias": logit_bias})
    try:
        params.validated()
    except ValueError as e:
        raise bad(str(e)) from None

    stream = _bool(body, "stream")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad(f"stream_options must be an object, got {_json_type(so)}", "stream_options")
        if not stream:
            raise bad("stream_options is only allowed when stream is true", "stream_options")
        extra = sorted(set(so) - {"include_usage", "continuous_usage_stats"})
        if extra:
            raise bad(f"unrecognized stream_options field: {extra[0]}", "stream_options")
        include_usage = _bool(so, "include_usage")
        _bool(so, "continuous_usage_stats")
    return GenerationRequest(
        kind=kind, model=model, params=params, max_tokens=_int(body, "max_tokens", 1, 1 << 31),
        stops=_stops(body), stream=stream, include_usage=include_usage,
        tokens_as_ids=_bool(body, "return_tokens_as_token_ids"), cache_prompt=_bool(body, "cache_prompt", True),
        n=n,
    )


def _logit_bias(v: Any) -> dict[int, float] | None:
    """OpenAI's {"token id": bias in [-100, 100]}; the app checks the ids against the vocabulary."""
    if v is None or v == {}:
        return None
    if not isinstance(v, dict):
        raise bad(f"logit_bias must be an object mapping token ids to numbers, got {_json_type(v)}", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(v)}", "logit_bias")
    out: dict[int, float] = {}
    for k, b in v.items():
        if not (k.isascii() and k.isdigit()) or len(k) > 12:
            raise bad(f"logit_bias keys must be token ids (decimal integers), got {k!r}"[:200], "logit_bias")
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b) or not -100 <= b <= 100:
            raise bad(f"logit_bias[{k}] must be a number in [-100, 100]", "logit_bias")
        out[int(k)] = float(b)
    return out


def chat_request(body: dict[str, Any]) -> GenerationRequest:
    req = _common(body, "chat", CHAT_FIELDS)
    mct = _int(body, "max_completion_tokens", 1, 1 << 31)
    if mct is not None:
        if req.max_tokens is not None and req.max_tokens != mct:
            raise bad("max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
        req.max_tokens = mct
    if _bool(body, "logprobs"):
        req.top_logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    elif body.get("top_logprobs") is not None:
        _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    tools = body.get("tools")
    if tools is not None and tools != []:
        raise bad("tools are not supported by this server", "tools", "unsupported_parameter")
    _off(body, "tool_choice", ("none",), "no tools")
    _bool(body, "parallel_tool_calls")
    _off(body, "functions", ([],), "no tools")
    _off(body, "function_call", ("none",), "no tools")
    _off(body, "response_format", ({"type": "text"},), 'only {"type": "text"}')
    _off(body, "modalities", (["text"],), 'only ["text"]')
    if body.get("reasoning_effort") is not None:
        _text(body["reasoning_effort"], "reasoning_effort")
    req.messages = messages(body.get("messages"))
    return req


def messages(v: Any) -> list[dict[str, str]]:
    if v is None:
        raise bad("messages is required", "messages")
    if not isinstance(v, list):
        raise bad(f"messages must be an array, got {_json_type(v)}", "messages")
    if not v:
        raise bad("messages must not be empty", "messages")
    if len(v) > MAX_MESSAGES:
        raise bad(f"at most {MAX_MESSAGES} messages, got {len(v)}", "messages")
    out = []
    for i, m in enumerate(v):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{p} must be an object with role and content, got {_json_type(m)}", p)
        role = m.get("role")
        if not isinstance(role, str):
            raise bad(f"{p}.role must be a string, got {_json_type(role)}", f"{p}.role")
        if role not in ROLES:
            raise bad(f"{p}.role {role!r} is not supported (use {', '.join(ROLES)})", f"{p}.role")
        for k in m:
            if k in ("role", "content"):
                continue
            if k == "name":
                _text(m[k], f"{p}.name")
            elif k in _ECHOED_KEYS:
                if m[k] not in (None, [], ""):
                    raise bad(f"{p}.{k} is not supported by this server", f"{p}.{k}", "unsupported_parameter")
            else:
                raise bad(f"unrecognized field {p}.{k}", f"{p}.{k}")
        out.append({"role": ROLES[role], "content": _content(m.get("content"), f"{p}.content")})
    return out


def _content(v: Any, p: str) -> str:
    if isinstance(v, str):
        return _text(v, p)
    if v is None:
        raise bad(f"{p} is required", p)
    if not isinstance(v, list):
        raise bad(f"{p} must be a string or an array of text parts, got {_json_type(v)}", p)
    parts = []
    for j, part in enumerate(v):
        q = f"{p}[{j}]"
        if not isinstance(part, dict):
            raise bad(f"{q} must be an object, got {_json_type(part)}", q)
        kind = part.get("type")
        if kind != "text":
            raise bad(f"{q}.type must be \"text\" (this model reads text only), got {kind!r}"[:300], f"{q}.type")
        extra = sorted(set(part) - {"type", "text"})
        if extra:
            raise bad(f"unrecognized field {q}.{extra[0]}", f"{q}.{extra[0]}")
        parts.append(_text(part.get("text"), f"{q}.text"))
    return "".join(parts)


def completion_request(body: dict[str, Any], n_vocab: int) -> GenerationRequest:
    req = _common(body, "completion", COMPLETION_FIELDS)
    lp = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    req.top_logprobs = lp
    if body.get("best_of") not in (None, 1) or isinstance(body.get("best_of"), bool):
        raise bad("best_of must be 1: this server does not rank choices (n gives several)", "best_of")
    _off(body, "echo", (False,), "echo is not implemented")
    _off(body, "suffix", ("",), "no fill-in-the-middle")
    req.prompt = prompt(body.get("prompt"), n_vocab)
    return req


def prompt(v: Any, n_vocab: int) -> str | list[int]:
    """A string, a list of token ids, or (OpenAI's batch forms) a one-element list of either."""
    if v is None:
        raise bad("prompt is required", "prompt")
    if isinstance(v, str):
        return _text(v, "prompt")
    if not isinstance(v, list):
        raise bad(f"prompt must be a string or an array of token ids, got {_json_type(v)}", "prompt")
    if len(v) == 1 and isinstance(v[0], (str, list)):
        return prompt(v[0], n_vocab)    # a batch of one
    if v and all(isinstance(x, (str, list)) for x in v):
        raise bad("one prompt per request: this server takes no batches of prompts", "prompt")
    if not v:
        raise bad("prompt must not be empty", "prompt")
    for i, t in enumerate(v):
        if not isinstance(t, int) or isinstance(t, bool):
            raise bad(f"prompt[{i}] must be a token id (an integer), got {_json_type(t)}", "prompt")
        if not 0 <= t < n_vocab:
            raise bad(f"prompt[{i}] = {t} is outside the vocabulary (0..{n_vocab - 1})", "prompt")
    return list(v)


def tokenize_request(body: dict[str, Any]) -> tuple[str, bool, bool, bool]:
    unknown = sorted(set(body) - {"content", "add_special", "parse_special", "with_pieces", "model"})
    if unknown:
        raise bad(f"unrecognized request argument: {unknown[0]}", unknown[0], "unknown_parameter")
    if body.get("model") is not None:
        _text(body["model"], "model")
    if "content" not in body:
        raise bad("content is required", "content")
    return (_text(body["content"], "content"), _bool(body, "add_special", True), _bool(body, "parse_special", True),
            _bool(body, "with_pieces"))


def detokenize_request(body: dict[str, Any], n_vocab: int) -> list[int]:
    unknown = sorted(set(body) - {"tokens", "model"})
    if unknown:
        raise bad(f"unrecognized request argument: {unknown[0]}", unknown[0], "unknown_parameter")
    if body.get("model") is not None:
        _text(body["model"], "model")
    toks = body.get("tokens")
    if not isinstance(toks, list):
        raise bad(f"tokens must be an array of token ids, got {_json_type(toks)}", "tokens")
    for i, t in enumerate(toks):
        if not isinstance(t, int) or isinstance(t, bool):
            raise bad(f"tokens[{i}] must be an integer, got {_json_type(t)}", "tokens")
        if not 0 <= t < n_vocab:
            raise bad(f"tokens[{i}] = {t} is outside the vocabulary (0..{n_vocab - 1})", "tokens")
    return toks


# --- OpenAPI -------------------------------------------------------------------------------------

def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


_NUM = {"type": "number"}
_INT = {"type": "integer"}
_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOPS}],
         "nullable": True, "description": "generation ends before the first occurrence (not included)"}
_SAMPLING = {
    "model": {"type": "string", "description": "the served model's id, a file name of it, or an --alias; optional"},
    "max_tokens": {**_INT, "minimum": 1, "nullable": True,
                   "description": "tokens to generate at most; prompt + max_tokens must fit the context"},
    "temperature": {**_NUM, "minimum": 0, "maximum": 2, "default": 0.8, "description": "0 = greedy"},
    "top_p": {**_NUM, "minimum": 0, "maximum": 1, "default": 0.95},
    "top_k": {**_INT, "minimum": 0, "default": 40, "description": "barellm extension; 0 = off"},
    "min_p": {**_NUM, "minimum": 0, "maximum": 1, "default": 0.05, "description": "barellm extension; 0 = off"},
    "repeat_penalty": {**_NUM, "exclusiveMinimum": 0, "maximum": 10, "default": 1.0,
                       "description": "barellm extension (llama.cpp's rule); 1 = off"},
    "repeat_last_n": {**_INT, "minimum": -1, "default": 64, "description": "tokens the penalties look back over"},
    "presence_penalty": {**_NUM, "minimum": -2, "maximum": 2, "default": 0},
    "frequency_penalty": {**_NUM, "minimum": -2, "maximum": 2, "default": 0},
    "seed": {**_INT, "nullable": True, "description": "makes a sampled generation reproducible"},
    "stop": _STOP,
    "n": {**_INT, "minimum": 1, "maximum": MAX_CHOICES, "default": 1,
          "description": "choices to generate; each needs a free slot of the server's --slots"},
    "logit_bias": {"type": "object", "nullable": True,
                   "additionalProperties": {**_NUM, "minimum": -100, "maximum": 100},
                   "description": "token id -> added to its logit before sampling (-100 bans it)"},
    "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object", "nullable": True,
                       "properties": {"include_usage": {"type": "boolean", "default": False}}},
    "user": {"type": "string", "description": "accepted and ignored"},
    "return_tokens_as_token_ids": {"type": "boolean", "default": False,
                                   "description": 'logprobs name tokens "token_id:<id>"'},
    "cache_prompt": {"type": "boolean", "default": True,
                     "description": "reuse the longest cached prefix of the prompt; false prefills it all"},
}
_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {
            **_INT, "description": "prompt tokens whose KV cache entries were reused"}}},
    },
}
_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": "string", "nullable": True},
    "code": {"type": "string", "nullable": True}}}}}


def _json_body(schema: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(schema)}}}


def _responses(ok: str, ok_schema: dict[str, Any], *, stream: bool = False, errors: tuple[int, ...] = (400,)
               ) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": ok_schema}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string", "description":
                                                   "with stream: true, `data: {chunk}` events, then `data: [DONE]`"}}
    out: dict[str, Any] = {"200": {"description": ok, "content": content}}
    for code in errors:
        out[str(code)] = {"description": {400: "invalid request", 404: "unknown model", 413: "body over 1 MiB",
                                          429: "the queue is full", 503: "waited past the time limit"}[code],
                          "content": {"application/json": {"schema": _ref("Error")}}}
    return out


def openapi(version: str) -> dict[str, Any]:
    gen_errors = (400, 404, 413, 429, 503)
    return {
        "openapi": "3.0.3",
        "info": {"title": "barellm", "version": version,
                 "description": "An OpenAI-compatible server for one model; concurrent requests are batched."},
        "paths": {
            "/v1/chat/completions": {"post": {
                "summary": "Chat completion (streaming with stream: true)", "operationId": "createChatCompletion",
                "requestBody": _json_body("ChatCompletionRequest"),
                "responses": _responses("a chat.completion object", _ref("ChatCompletion"), stream=True,
                                        errors=gen_errors)}},
            "/v1/completions": {"post": {
                "summary": "Text completion (streaming with stream: true)", "operationId": "createCompletion",
                "requestBody": _json_body("CompletionRequest"),
                "responses": _responses("a text_completion object", _ref("Completion"), stream=True,
                                        errors=gen_errors)}},
            "/v1/models": {"get": {"summary": "The served model", "operationId": "listModels",
                                   "responses": _responses("a list of models", _ref("ModelList"), errors=())}},
            "/v1/models/{model}": {"get": {
                "summary": "One model", "operationId": "retrieveModel",
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": _responses("the model", _ref("Model"), errors=(404,))}},
            "/tokenize": {"post": {
                "summary": "Text to token ids", "operationId": "tokenize", "requestBody": _json_body("TokenizeRequest"),
                "responses": _responses("token ids", {"type": "object", "properties": {"tokens": {
                    "type": "array", "items": {"oneOf": [_INT, {"type": "object", "properties": {
                        "id": _INT, "piece": {"type": "string"}}}]}}}})}},
            "/detokenize": {"post": {
                "summary": "Token ids to text", "operationId": "detokenize",
                "requestBody": _json_body("DetokenizeRequest"),
                "responses": _responses("the text", {"type": "object",
                                                     "properties": {"content": {"type": "string"}}})}},
            "/health": {"get": {"summary": "Liveness and load", "operationId": "health",
                                "responses": _responses("ok", {"type": "object"}, errors=())}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "operationId": "metrics", "responses": {
                "200": {"description": "text exposition format 0.0.4",
                        "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "This document", "operationId": "openapi",
                                      "responses": _responses("OpenAPI 3.0", {"type": "object"}, errors=())}},
        },
        "components": {"schemas": {
            "Error": _ERROR,
            "Usage": _USAGE,
            "Message": {"type": "object", "required": ["role", "content"], "properties": {
                "role": {"type": "string", "enum": sorted(ROLES)},
                "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
                    "type": "object", "required": ["type", "text"],
                    "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]},
                "name": {"type": "string"}}},
            "ChatCompletionRequest": {"type": "object", "required": ["messages"], "additionalProperties": False,
                                      "properties": {
                "messages": {"type": "array", "minItems": 1, "items": _ref("Message")},
                **_SAMPLING,
                "max_completion_tokens": {**_INT, "minimum": 1, "nullable": True,
                                          "description": "the same as max_tokens"},
                "logprobs": {"type": "boolean", "default": False},
                "top_logprobs": {**_INT, "minimum": 0, "maximum": MAX_TOP_LOGPROBS, "nullable": True},
            }},
            "CompletionRequest": {"type": "object", "required": ["prompt"], "additionalProperties": False,
                                  "properties": {
                "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": _INT, "minItems": 1}]},
                **_SAMPLING,
                "logprobs": {**_INT, "minimum": 0, "maximum": MAX_TOP_LOGPROBS, "nullable": True},
                "echo": {"type": "boolean", "enum": [False]},
                "best_of": {**_INT, "enum": [1]},
            }},
            "ChatCompletion": {"type": "object", "properties": {
                "id": {"type": "string"}, "object": {"type": "string", "enum": ["chat.completion"]},
                "created": _INT, "model": {"type": "string"}, "system_fingerprint": {"type": "string"},
                "choices": {"type": "array", "items": {"type": "object", "properties": {
                    "index": _INT, "message": {"type": "object", "properties": {
                        "role": {"type": "string"}, "content": {"type": "string"}}},
                    "logprobs": {"type": "object", "nullable": True},
                    "finish_reason": {"type": "string", "enum": ["stop", "length"]}}}},
                "usage": _ref("Usage")}},
            "Completion": {"type": "object", "properties": {
                "id": {"type": "string"}, "object": {"type": "string", "enum": ["text_completion"]},
                "created": _INT, "model": {"type": "string"}, "system_fingerprint": {"type": "string"},
                "choices": {"type": "array", "items": {"type": "object", "properties": {
                    "index": _INT, "text": {"type": "string"}, "logprobs": {"type": "object", "nullable": True},
                    "finish_reason": {"type": "string", "enum": ["stop", "length"]}}}},
                "usage": _ref("Usage")}},
            "Model": {"type": "object", "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                                       "created": _INT, "owned_by": {"type": "string"}}},
            "ModelList": {"type": "object", "properties": {"object": {"type": "string"},
                                                           "data": {"type": "array", "items": _ref("Model")}}},
            "TokenizeRequest": {"type": "object", "required": ["content"], "properties": {
                "content": {"type": "string"}, "add_special": {"type": "boolean", "default": True},
                "parse_special": {"type": "boolean", "default": True},
                "with_pieces": {"type": "boolean", "default": False}}},
            "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
                "tokens": {"type": "array", "items": _INT}}},
        }},
    }
