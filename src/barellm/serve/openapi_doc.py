"""The OpenAPI document of the server, generated from the pydantic models: the request bodies (schemas.py)
and the response shapes below. The app builds its responses as plain dicts (barellm.api.openai); the
tests hold them to these models, which forbid fields they do not list."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from barellm.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    InfillRequest,
    TokenizeRequest,
)

# --- responses -------------------------------------------------------------------------------------

class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class Error(_Out):
    error: ErrorDetail


class PromptTokensDetails(_Out):
    cached_tokens: int = Field(description="prompt tokens whose KV cache entries were reused")


class CompletionTokensDetails(_Out):
    reasoning_tokens: int = Field(description="generated tokens that went to a reasoning model's reasoning "
                                              "(reasoning_content); 0 for a reply with none")


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="a chat completion's: how many of its completion tokens were reasoning")


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprobOut]


class CalledFunction(_Out):
    name: str
    arguments: str = Field(description="the arguments object as JSON text")


class ToolCall(_Out):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ToolCallDelta(ToolCall):
    index: int = Field(description="the call's place among the reply's calls (each call arrives whole)")


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the reply is tool calls only")
    refusal: None = None
    reasoning_content: str | None = Field(None, description="a reasoning model's reasoning (reasoning_format "
                                                            '"auto"), kept out of content')
    tool_calls: list[ToolCall] | None = None


FinishReason = Literal["stop", "length", "tool_calls", "constraint_failed"]


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(None, description="a piece of a reasoning model's reasoning")
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="with stream_options.include_usage: null on every chunk "
                                                  "but the last, whose choices are empty")


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class Completion(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    loaded: bool = Field(description="whether the model is loaded now (one not loaded loads on first use)")
    context_length: int | None = Field(None, description="the loaded model's context")
    n_vocab: int | None = Field(None, description="the loaded model's vocabulary size")
    slots: int | None = Field(None, description="the loaded model's slots")


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class Embedding(_Out):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="floats, or with encoding_format base64 the little-endian "
                                                     "float32 bytes in base64")


class EmbeddingUsage(_Out):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Out):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class InfillTimings(_Out):
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class Infill(_Out):
    index: int
    content: str = Field(description="the fill (empty in the last event of a stream)")
    tokens: list[int]
    id_slot: int
    stop: bool
    model: str | None = None
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None
    tokens_cached: int | None = None
    has_new_line: bool | None = None
    truncated: bool | None = None
    stop_type: Literal["eos", "word", "limit"] | None = None
    stopping_word: str | None = None
    timings: InfillTimings | None = None


class TokenPiece(_Out):
    id: int
    piece: str


class Tokens(_Out):
    tokens: list[int] | list[TokenPiece]


class Text(_Out):
    content: str


class Health(_Out):
    status: Literal["ok"]
    slots: int
    slots_in_use: int
    queue_depth: int
    models_loaded: int = Field(description="models loaded now (slots and queue: theirs together)")


_MODELS: list[type[BaseModel]] = [
    ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest, EmbeddingRequest, InfillRequest,
    Error, ChatCompletion, ChatCompletionChunk, Completion, ModelCard, ModelList, Tokens, Text, Health,
    EmbeddingList, Infill,
]


# --- OpenAPI -------------------------------------------------------------------------------------

ERROR_STATUSES = {
    400: "invalid request: a body the schema does not allow, or one refused for what no schema can state: token "
         "ids past the model's vocabulary, a prompt longer than its context, n past --slots, /infill on a model "
         "without fill-in-the-middle tokens, embedding dimensions not the model's, a tool_choice naming none of "
         "the tools or two tools of one name, a grammar, regex or JSON schema that does not compile or can never "
         "be satisfied",
    401: "missing or wrong API key (with --api-key)", 404: "unknown model", 413: "body over 1 MiB",
    415: "the body is not sent as application/json", 429: "the queue is full", 503: "waited past the time limit"}
# what every operation may answer, whatever its handler: the Guard's refusals (security.py), and for a body
# the parser's (schemas.py). A refusal of the connection itself (408, 503 past --max-connections:
# connections.py) comes before any route and is not an operation's answer.
_ALWAYS = (401,)
_WITH_BODY = (400, 413, 415)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def json_body(schema: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(schema)}}}


def sse_event(schema: str, done: bool = True) -> dict[str, Any]:
    """One server-sent event of a stream (before OpenAPI 3.2, a text/event-stream schema describes each
    event): its data is the JSON of `schema` or of an Error, or (done) the closing `[DONE]`."""
    data: dict[str, Any] = {"type": "string", "contentMediaType": "application/json",
                            "contentSchema": {"anyOf": [_ref(schema), _ref("Error")]}}
    if done:
        data = {"anyOf": [{"const": "[DONE]"}, data]}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def responses(ok: str, schema: str | None, *, stream: str | None = None, errors: tuple[int, ...] = (400,),
              media: str = "application/json", stream_schema: str | None = None, done: bool = True
              ) -> dict[str, Any]:
    content: dict[str, Any] = {media: {"schema": _ref(schema) if schema else {"type": "string"}}}
    if stream:
        content["text/event-stream"] = {"schema": {**sse_event(stream_schema or schema or "Error", done),
                                                   "description": stream}}
    out: dict[str, Any] = {"200": {"description": ok, "content": content}}
    for code in errors:
        out[str(code)] = {"description": ERROR_STATUSES[code],
                          "content": {"application/json": {"schema": _ref("Error")}}}
    return out


_GEN_ERRORS = (400, 401, 404, 413, 415, 429, 503)
_SSE = "with stream: true, `data: {chunk}` events (the chunk object), then `data: [DONE]`"
PATHS: dict[str, Any] = {
    "/v1/chat/completions": {"post": {
        "summary": "Chat completion (streaming with stream: true)", "operationId": "createChatCompletion",
        "requestBody": json_body("ChatCompletionRequest"),
        "responses": responses("a chat.completion object; streamed, chat.completion.chunk events", "ChatCompletion",
                               stream=_SSE, errors=_GEN_ERRORS, stream_schema="ChatCompletionChunk")}},
    "/v1/completions": {"post": {
        "summary": "Text completion (streaming with stream: true)", "operationId": "createCompletion",
        "requestBody": json_body("CompletionRequest"),
        "responses": responses("a text_completion object", "Completion", stream=_SSE, errors=_GEN_ERRORS)}},
    "/v1/embeddings": {"post": {
        "summary": "Embeddings: the model's pooled final hidden states, L2-normalised",
        "operationId": "createEmbedding", "requestBody": json_body("EmbeddingRequest"),
        "responses": responses("a list of embeddings", "EmbeddingList", errors=_GEN_ERRORS)}},
    "/infill": {"post": {
        "summary": "Fill-in-the-middle for code (llama.cpp server's /infill)", "operationId": "infill",
        "requestBody": json_body("InfillRequest"),
        "responses": responses("the fill and its counts", "Infill",
                               stream='with stream: true, `data: {"content", "stop": false}` events, then the '
                                      'whole object with "stop": true', errors=_GEN_ERRORS, done=False)}},
    "/v1/models": {"get": {"summary": "The served model", "operationId": "listModels",
                           "responses": responses("a list of models", "ModelList", errors=(401,))}},
    "/v1/models/{model}": {"get": {
        "summary": "One model", "operationId": "retrieveModel",
        "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": responses("the model", "ModelCard", errors=(401, 404))}},
    "/tokenize": {"post": {"summary": "Text to token ids", "operationId": "tokenize",
                           "requestBody": json_body("TokenizeRequest"), "responses": responses("token ids", "Tokens")}},
    "/detokenize": {"post": {"summary": "Token ids to text", "operationId": "detokenize",
                             "requestBody": json_body("DetokenizeRequest"),
                             "responses": responses("the text", "Text")}},
    "/health": {"get": {"summary": "Liveness and load", "operationId": "health",
                        "responses": responses("ok", "Health", errors=())}},
    "/metrics": {"get": {"summary": "Prometheus metrics", "operationId": "metrics",
                         "responses": responses("text exposition format 0.0.4", None, errors=(401,),
                                                media="text/plain")}},
    "/openapi.json": {"get": {"summary": "This document", "operationId": "openapi",
                              "responses": {"200": {"description": "OpenAPI 3.1",
                                                    "content": {"application/json": {"schema": {"type": "object"}}}}}}},
}


def openapi(version: str, extra_models: Sequence[type[BaseModel]] = (), extra_paths: Mapping[str, Any] | None = None
            ) -> dict[str, Any]:
    """The OpenAPI 3.1 document: the paths above (and another API family's), every schema generated from
    the models."""
    _, defs = models_json_schema([(m, "validation") for m in [*_MODELS, *extra_models]],
                                 ref_template="#/components/schemas/{model}")
    return {
        "openapi": "3.1.0",
        "info": {"title": "barellm", "version": version,
                 "description": "An OpenAI-compatible server for one model; concurrent requests are batched."},
        "paths": _every_status({**PATHS, **(extra_paths or {})}),
        "components": {"schemas": _json_bounds(defs.get("$defs", {})),
                       "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer",
                                                      "description": "needed when started with --api-key"}}},
        "security": [{"apiKey": []}, {}],
    }


def _every_status(paths: Mapping[str, Any]) -> dict[str, Any]:
    """paths with the statuses every operation can answer added where an operation leaves them out: the
    Guard's and the body parser's, and an unknown model's 404 on a body that names one. /api/* answer in
    Ollama's error shape ({"error": "..."}), the others in OpenAI's."""
    out: dict[str, Any] = {}
    for path, ops in paths.items():
        out[path] = {}
        for method, op in ops.items():
            op = {**op, "responses": dict(op.get("responses", {}))}
            codes = list(_ALWAYS)
            if "requestBody" in op:
                codes += [*_WITH_BODY, 404]
            if path.startswith("/api/"):
                schema: dict[str, Any] = {"type": "object", "properties": {"error": {"type": "string"}},
                                          "required": ["error"]}
            else:
                schema = _ref("Error")
            for code in sorted(codes):
                if path == "/health" and code == 401:
                    continue   # open for liveness probes
                op["responses"].setdefault(str(code), {
                    "description": ERROR_STATUSES[code] if code != 404 else "the body names a model not served here",
                    "content": {"application/json": {"schema": schema}}})
            out[path][method] = op
    return out


_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _json_bounds(schema: Any) -> Any:
    """schema with pydantic's bound keys put in JSON Schema's words. A Field(ge=...) on a type that carries a
    validator of its own (schema_types.Int: 16.0 read as 16) is written as "ge", which no JSON Schema reader
    knows: the document stated no bound at all for n, top_k, dimensions, ..."""
    if isinstance(schema, dict):
        numeric = schema.get("type") in ("integer", "number")
        return {(_BOUNDS[k] if numeric and k in _BOUNDS else k): _json_bounds(v) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_json_bounds(v) for v in schema]
    return schema
