"""The request bodies of the OpenAI-compatible routes (and of llama.cpp server's /infill, /tokenize and
/detokenize) as pydantic models; what they are built from, shared with the Ollama routes' bodies:
serve/schema_types.py; their parsing and the error shape: serve/errors.py.

A body is parsed and validated in one pass (pydantic's Rust JSON parser), strictly: a field of the wrong
JSON type (no "10" for 10, no true for 1), out of range, or unknown is a 400 that names it (OpenAI answers
unknown fields with 400 too, and silently ignoring a misspelt "max_token" would hide the mistake). Fields
of OpenAI's API that barellm does not implement (echo, best_of > 1, the legacy functions, audio, ...) are
modelled with their real shape, so a malformed one is named like any other, and then refused unless they
hold their neutral value.

The models only check what a request says. What needs the model (token ids within the vocabulary, the
prompt fitting the context) and what spans fields is checked in to_generation() and by the app.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, ConfigDict, Discriminator, Field, Tag, WithJsonSchema
from pydantic_core import PydanticCustomError

from barellm.api.openai import Constraint, GenerationRequest, check_tool_choice, constraint_of
from barellm.errors import InvalidRequest
from barellm.generate.sampling import SamplingParams
from barellm.serve.errors import bad, parse
from barellm.serve.schema_types import (
    EMPTY,
    INT64,
    MAX_MESSAGES,
    MAX_STOP_CHARS,
    MAX_STOPS,
    UINT31,
    Int,
    Penalty,
    Prob,
    _Body,
    _by_json_type,
    _either,
    _either_of,
    _not_null,
    _null,
    _off,
    _tagged,
)
from barellm.text.chat import message_text
from barellm.text.reasoning import template_kwargs

MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 128       # n; the server also needs one free slot per choice
MAX_LOGIT_BIAS = 300    # entries of logit_bias (OpenAI's limit)


# --- tools and output formats ----------------------------------------------------------------------

class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = Field(None, description="accepted; forced calls always follow parameters")


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class ToolChoiceFunction(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = Field(None, description="accepted; the output always follows the schema")


class TextFormat(_Body):
    type: Literal["text"]


class JsonObjectFormat(_Body):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = _tagged(TextFormat, JsonObjectFormat, JsonSchemaResponseFormat,
                         what='must be an object with "type": "text", "json_object" or "json_schema"')


# --- messages ----------------------------------------------------------------------------------------

class TextPart(_Body):
    type: Literal["text"] = Field(description="this model reads text only")
    text: str


Content = _either(str, list[TextPart], "must be a string or an array of text parts")
Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _echoed(name: str) -> Any:
    """A key a client sends back from an earlier response: accepted while it says nothing."""
    return Annotated[Any, _off(name, EMPTY, "send it empty or leave it out")]


class CalledFunction(_Body):
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: CalledFunction


def _role_is(*roles: str) -> dict[str, Any]:
    return {"properties": {"role": {"enum": list(roles)}}}


_NO_CALLS = {"properties": {"tool_calls": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}}}
_NOT_ANSWERING = {"properties": {"tool_call_id": {"type": "null"}}}
# what _message() requires of a message beyond its fields' types, stated in the document: by role. (Few
# alternatives and no "not": a fuzzer that generates from the document expands each into branches.)
_MESSAGE_RULES: dict[str, Any] = _either_of(
    {"allOf": [_role_is("tool"), _not_null("tool_call_id"), _NO_CALLS]},
    {"allOf": [_role_is("assistant"), _NOT_ANSWERING, _either_of(
        _not_null("content"), {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array",
                                                                                          "minItems": 1}}})]},
    {"allOf": [_role_is("system", "developer", "user"), _not_null("content"), _NOT_ANSWERING, _NO_CALLS]},
)


class Message(_Body):
    model_config = ConfigDict(json_schema_extra=_MESSAGE_RULES)

    role: Role = Field(description="developer is read as system; tool: a tool's result (tool_call_id)")
    content: Content | None = Field(None, description="may be null on an assistant message with tool_calls, and "
                                                      "on a tool message (an empty result)")
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's earlier tool calls")
    tool_call_id: str | None = Field(None, description="the call a tool message answers")
    refusal: _echoed("refusal") = None
    function_call: _echoed("function_call") = None
    audio: _echoed("audio") = None
    annotations: _echoed("annotations") = None
    reasoning_content: str | None = Field(None, description="an assistant's earlier reasoning (llama-server's "
                                                            "field): rendered where the model's template renders it")


# --- generation requests -------------------------------------------------------------------------------

class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


Stop = _either(Annotated[str, Field(max_length=MAX_STOP_CHARS)],
               Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOPS)],
               "must be a string or an array of strings")


# what generation() requires beyond the fields' types: stream_options with stream true only; one output
# constraint at most (a null one, or response_format {"type": "text"}, constrains nothing)
_INACTIVE: dict[str, Any] = {
    "response_format": {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]},
    "json_schema": {"type": "null"}, "grammar": {"type": "null"}, "regex": {"type": "null"}}
_NO_CONSTRAINT: dict[str, Any] = {"properties": _INACTIVE}
_SAMPLING_RULES: list[dict[str, Any]] = [
    _either_of(_null("stream_options"), {"required": ["stream"], "properties": {"stream": {"const": True}}}),
    _either_of(*({"properties": {k: v for k, v in _INACTIVE.items() if k != c}} for c in _INACTIVE)),
]


def _rules(*rules: dict[str, Any]) -> ConfigDict:
    """A request model's config with cross-field rules for its schema (its fields' own types say the rest)."""
    return ConfigDict(json_schema_extra={"allOf": [*_SAMPLING_RULES, *rules]})


class _Sampling(_Body):
    model_config = _rules()

    model: str | None = Field(None, description="the served model's id, a file name of it, or an --alias")
    max_tokens: Annotated[Int, Field(ge=1, le=UINT31)] | None = Field(
        None, description="tokens to generate at most; prompt + max_tokens must fit the context")
    temperature: Annotated[float, Field(ge=0, le=2)] | None = Field(None, description="0 = greedy; default 0.8")
    top_p: Prob | None = Field(None, description="default 0.95")
    top_k: Annotated[Int, Field(ge=0, le=UINT31)] | None = Field(None, description="0 = off; default 40")
    min_p: Prob | None = Field(None, description="0 = off; default 0.05")
    repeat_penalty: Annotated[float, Field(ge=1e-6, le=10)] | None = Field(
        None, description="llama.cpp's rule; 1 = off (the default)")
    repeat_last_n: Annotated[Int, Field(ge=-1, le=UINT31)] | None = Field(
        None, description="tokens the penalties look back over; -1 = all; default 64")
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Annotated[Int, Field(ge=-INT64, le=(1 << 64) - 1)] | None = Field(
        None, description="makes a sampled generation reproducible")
    stop: Stop | None = Field(None, description="generation ends before the first occurrence (not included)")
    n: Annotated[Int, Field(ge=1, le=MAX_CHOICES)] | None = Field(
        None, description="choices of the prompt, each in its own slot (at most --slots); the prompt is prefilled "
                          "once")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="accepted and ignored")
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(
        max_length=MAX_LOGIT_BIAS, json_schema_extra={"propertyNames": {"pattern": "^[0-9]{1,12}$"}})
    ] | None = Field(None, description="token id -> added to its logit before sampling (-100 bans the token)")
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")
    store: bool | None = Field(None, description="accepted and ignored")
    service_tier: str | None = Field(None, description="accepted and ignored")
    return_tokens_as_token_ids: bool = Field(False, description='logprobs name tokens "token_id:<id>"')
    cache_prompt: bool = Field(True, description="reuse the longest cached prefix of the prompt; "
                                                 "false prefills it all")
    response_format: ResponseFormat | None = Field(
        None, description='{"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema"}}: '
                          "the output is JSON valid against the schema")
    json_schema: dict[str, Any] | None = Field(None, description="llama.cpp's extension: response_format's schema")
    grammar: str | None = Field(None, description="extension: the output follows this grammar (llguidance's Lark "
                                                  "dialect, or GBNF)")
    regex: str | None = Field(None, description="extension: the output matches this regular expression")
    draft: bool = Field(True, description="extension: speculative decoding, where the server drafts (barellm serve "
                                          "--draft); false turns it off for this request (the output is the same "
                                          "either way)")

    def params(self) -> SamplingParams:
        top_p = self.top_p
        if top_p == 0.0:
            top_p = 1e-9   # OpenAI allows 0: keep only the most likely token
        params = SamplingParams().with_(
            temperature=self.temperature, top_p=top_p, top_k=self.top_k, min_p=self.min_p,
            repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)
        # NumPy's generator wants a non-negative seed; OpenAI takes any 64-bit one
        seed = None if self.seed is None else self.seed % (1 << 64)
        try:
            return SamplingParams(**{**params.__dict__, "seed": seed, "logit_bias": self.bias()}).validated()
        except InvalidRequest as e:
            raise bad(str(e)) from None

    def bias(self) -> dict[int, float] | None:
        """logit_bias with its keys read as token ids (the app checks them against the vocabulary)."""
        if not self.logit_bias:
            return None
        out = {}
        for k, v in self.logit_bias.items():
            if not (k.isascii() and k.isdigit()) or len(k) > 12:
                raise bad(f"logit_bias keys must be token ids (decimal integers), got {k!r}"[:200], "logit_bias")
            out[int(k)] = v
        return out

    def stops(self) -> list[str]:
        v = self.stop
        stops = [v] if isinstance(v, str) else list(v or [])
        return [s for s in stops if s]

    def constraint(self) -> Constraint | None:
        """The one output constraint the request asks for (two are a 400)."""
        rf = self.response_format
        try:
            return constraint_of(rf.model_dump(by_alias=True) if rf is not None else None, self.json_schema,
                                 self.grammar, self.regex)
        except InvalidRequest as e:
            raise bad(str(e), e.param) from None

    def generation(self, kind: str) -> GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise bad("stream_options is only allowed when stream is true", "stream_options")
        return GenerationRequest(
            kind=kind, model=self.model, params=self.params(), max_tokens=self.max_tokens, stops=self.stops(),
            stream=self.stream, include_usage=bool(self.stream_options and self.stream_options.include_usage),
            tokens_as_ids=self.return_tokens_as_token_ids, cache_prompt=self.cache_prompt, n=self.n or 1,
            constraint=self.constraint(), draft=self.draft)


ToolChoice = Annotated[Union[Annotated[Literal["none", "auto", "required"], Tag("~string")],  # noqa: UP007
                             Annotated[ToolChoiceFunction, Tag("~object")]],
                       Discriminator(_by_json_type, custom_error_type="type_error",
                                     custom_error_message='must be "none", "auto", "required" or '
                                                          '{"type": "function", ...}')]
FunctionCall = Annotated[Union[Annotated[Literal["none", "auto"], Tag("~string")],  # noqa: UP007
                               Annotated[NamedFunction, Tag("~object")]],
                         Discriminator(_by_json_type, custom_error_type="type_error",
                                       custom_error_message='must be "none", "auto" or {"name": ...}')]


class ChatCompletionRequest(_Sampling):
    # to_generation()'s rules; two it cannot state: a named tool_choice names one of the tools, and no two
    # tools share a name
    model_config = _rules(
        _either_of(_null("max_tokens"), _null("max_completion_tokens")),
        _either_of(_null("top_logprobs"), {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}),
        _either_of({"properties": {"tool_choice": {"enum": [None, "none"]}}},
                   {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}),
        _either_of({"properties": {"tool_choice": {"enum": [None, "none", "auto"]}}}, _NO_CONSTRAINT),
    )

    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Annotated[Int, Field(ge=1, le=UINT31)] | None = Field(
        None, description="the same as max_tokens")
    logprobs: bool = False
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = Field(
        None, description="functions the model may call; rendered by the model's chat template")
    tool_choice: ToolChoice | None = Field(
        None, description='"auto" (default with tools), "none", "required" or a named function: the last two '
                          "constrain the output to calls whose arguments fit the function's schema")
    parallel_tool_calls: bool | None = Field(None, description='with "required": one call (false) or one or more')
    functions: Annotated[list[FunctionDef] | None, _off("functions", ([],), "use tools")] = None
    function_call: Annotated[FunctionCall | None, _off("function_call", ("none",), "use tool_choice")
                             ] = None
    modalities: Annotated[list[Literal["text", "audio"]] | None,
                          _off("modalities", (["text"],), 'only ["text"]')] = None
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None, description="passed to the chat template (gpt-oss's reads it: its reasoning's length)")
    reasoning_format: Literal["auto", "deepseek", "none"] = Field(
        "auto", description="llama-server's: a reasoning model's reasoning in message.reasoning_content "
                            '("auto", "deepseek"), or left in the content as generated, markers included ("none")')
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='further chat template variables (llama-server\'s), e.g. {"enable_thinking": false} '
                          "for Qwen3; at most 32 names")

    def to_generation(self) -> GenerationRequest:
        req = self.generation("chat")
        if self.max_completion_tokens is not None:
            if req.max_tokens is not None and req.max_tokens != self.max_completion_tokens:
                raise bad("max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
            req.max_tokens = self.max_completion_tokens
        if self.logprobs:
            req.top_logprobs = self.top_logprobs or 0
        elif self.top_logprobs is not None:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        req.messages = [_message(m, i) for i, m in enumerate(self.messages)]
        req.reasoning_format = self.reasoning_format
        try:
            req.template_kwargs = template_kwargs(self.chat_template_kwargs, self.reasoning_effort)
        except InvalidRequest as e:
            raise bad(str(e), e.param) from None
        if self.tools:
            req.tools = [t.model_dump(exclude_none=True) for t in self.tools]
        if self.tool_choice is not None:
            if not self.tools and self.tool_choice != "none":
                raise bad("tool_choice needs tools", "tool_choice")
            tc = self.tool_choice
            req.tool_choice = tc if isinstance(tc, str) else tc.model_dump()
            if isinstance(tc, ToolChoiceFunction) and not any(t.function.name == tc.function.name
                                                                for t in self.tools or ()):
                raise bad(f"tool_choice names the function {tc.function.name!r}, which is not among the tools",
                          "tool_choice.function.name")
        if self.parallel_tool_calls is not None:
            req.parallel_tool_calls = self.parallel_tool_calls
        try:
            check_tool_choice(req.tool_choice, req.constraint)
        except InvalidRequest as e:
            raise bad(str(e), e.param) from None
        if self.tools:
            names = [t.function.name for t in self.tools]
            dup = next((n for n in names if names.count(n) > 1), None)
            if dup is not None:
                raise bad(f"the function {dup!r} is defined twice", "tools")
        return req


def _message(m: Message, i: int) -> dict[str, Any]:
    """A message as the chat template path takes it (text content; tool calls and results as dicts)."""
    out: dict[str, Any] = {"role": ROLES[m.role]}
    if m.content is None and m.role == "tool":
        out["content"] = ""   # a tool that returned nothing
    elif m.content is None:
        if not (m.role == "assistant" and m.tool_calls):
            raise bad(f"messages[{i}].content is required (only an assistant message with tool_calls may leave it "
                      "out)", f"messages[{i}].content")
        out["content"] = None
    else:
        out["content"] = _text_of(m.content)
    if m.tool_calls:
        if m.role != "assistant":
            raise bad(f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                      f"messages[{i}].tool_calls")
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.reasoning_content and m.role == "assistant":
        out["reasoning_content"] = m.reasoning_content
    if m.role == "tool":
        if m.tool_call_id is None:
            raise bad(f"messages[{i}].tool_call_id is required on a tool message", f"messages[{i}].tool_call_id")
        out["tool_call_id"] = m.tool_call_id
    elif m.tool_call_id is not None:
        raise bad(f"messages[{i}].tool_call_id belongs on tool messages only", f"messages[{i}].tool_call_id")
    return out


def _text_of(content: str | list[TextPart]) -> str:
    # the rule for parts is text.chat's, which Model.chat applies too
    return message_text(content if isinstance(content, str) else [p.model_dump() for p in content])


def _one_prompt(v: Any) -> Any:
    # OpenAI's batch forms: a list of strings or of token lists; one of them is one prompt
    if isinstance(v, list) and v and all(isinstance(x, (str, list)) for x in v):
        if len(v) > 1:
            raise PydanticCustomError("unsupported_parameter",
                                      "one prompt per request: this server returns one choice per request")
        return v[0]
    return v


TokenId = Annotated[Int, Field(ge=0)]
_TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# what the schema says a prompt may be: OpenAI's batch forms with one prompt in them included
# (and a text with tokens: an empty one has none unless the model adds BOS)
_Text = Annotated[str, Field(min_length=1)]
_PromptInput = Union[_Text, _TokenIds, Annotated[list[_Text], Field(min_length=1, max_length=1)],  # noqa: UP007
                     Annotated[list[_TokenIds], Field(min_length=1, max_length=1)]]
Prompt = Annotated[_either(str, _TokenIds, "must be a string or an array of token ids"),
                   BeforeValidator(_one_prompt, json_schema_input_type=_PromptInput)]


class CompletionRequest(_Sampling):
    model_config = _rules(_either_of({"properties": {"suffix": {"enum": [None, ""]}}},
                                     {"properties": {"prompt": {"type": "string"}}}))

    prompt: Prompt
    logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    best_of: Annotated[Annotated[Int, Field(ge=1, le=128)] | None,
                       _off("best_of", (1,), "one choice per request: best_of must be 1")] = None
    echo: Annotated[bool | None, _off("echo", (False,), "echo is not implemented")] = None
    suffix: str | None = Field(None, description="the text after the completion: fill-in-the-middle with the "
                                                 "model's FIM tokens (the prompt is the text before)")

    def to_generation(self, n_vocab: int) -> GenerationRequest:
        req = self.generation("completion")
        req.top_logprobs = self.logprobs
        if isinstance(self.prompt, list):
            _check_ids(self.prompt, n_vocab, "prompt")
            req.prompt = list(self.prompt)
        else:
            req.prompt_text = self.prompt
        if self.suffix:
            if not isinstance(self.prompt, str):
                raise bad("suffix needs a string prompt (the text before the hole)", "suffix")
            req.suffix = self.suffix
        return req


MAX_EMBED_INPUTS = 2048   # OpenAI's limit on inputs per request


def _inputs(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": 1, "maxItems": MAX_EMBED_INPUTS}


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# inputs() takes one kind of input per request: the document states the four forms, not any mix; and a text
# must have tokens (an empty one has none unless the model adds BOS)
_TEXT = {"type": "string", "minLength": 1}
_EMBEDDING_INPUT = {"anyOf": [_TEXT, _inputs(_TEXT), _inputs(_TOKEN_IDS["items"]), _inputs(_TOKEN_IDS)]}


class EmbeddingRequest(_Body):
    input: Annotated[_either(str, Annotated[list[Union[str, TokenId, Annotated[list[TokenId], Field(min_length=1)]]],  # noqa: UP007
                                            Field(min_length=1, max_length=MAX_EMBED_INPUTS)],
                             "must be a string, an array of strings, an array of token ids or an array of those"),
                     WithJsonSchema(_EMBEDDING_INPUT)] = Field(
        description="a text, texts, one token-id list, or token-id lists")
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = Field(
        None, description="float (default) or base64: the little-endian float32 bytes")
    dimensions: Annotated[Int, Field(ge=1)] | None = Field(
        None, description="only the model's own embedding size (its hidden size) is served")
    user: str | None = Field(None, description="accepted and ignored")

    def inputs(self, n_vocab: int) -> list[str | list[int]]:
        """The inputs, each a text or a token-id list."""
        v = self.input
        if isinstance(v, str):
            return [v]
        if all(isinstance(x, int) for x in v):
            _check_ids(v, n_vocab, "input")   # type: ignore[arg-type]
            return [list(v)]   # type: ignore[arg-type]
        kinds = {type(x) for x in v}
        if kinds == {str}:
            return list(v)   # type: ignore[arg-type]
        if kinds == {list}:
            for i, ids in enumerate(v):
                _check_ids(ids, n_vocab, f"input[{i}]")   # type: ignore[arg-type]
            return [list(x) for x in v]   # type: ignore[arg-type]
        raise bad("input must be all strings, all token ids, or all token-id lists", "input")


class ExtraChunk(_Body):
    filename: str = Field("tmp", max_length=1000)
    text: str = ""


class InfillRequest(_Sampling):
    """llama.cpp server's /infill: the code before and after the cursor, other files for context."""

    model_config = _rules({"properties": {"n": {"anyOf": [{"const": 1}, {"type": "null"}]},
                                          "n_predict": {"not": {"const": 0}}}},
                          {"anyOf": [_null("max_tokens"), {"properties": {"n_predict": {"anyOf": [
                              {"type": "null"}, {"const": -1}]}}}]})

    input_prefix: str = Field("", description="the text before the hole")
    input_suffix: str = Field("", description="the text after the hole")
    input_extra: Annotated[list[ExtraChunk], Field(max_length=1024)] = Field(
        default_factory=list, description='other files, [{"filename", "text"}], put before as repository context')
    prompt: str = Field("", description="text that starts the middle (appended to the prefix)")
    n_predict: Annotated[Int, Field(ge=-1, le=UINT31)] | None = Field(
        None, description="tokens to generate at most (-1: until the end); the same as max_tokens")
    samplers: list[str] | None = Field(None, description="accepted and ignored: the sampling chain is fixed")
    n_indent: Int | None = Field(None, description="accepted and ignored")
    t_max_prompt_ms: Int | None = Field(None, description="accepted and ignored")
    t_max_predict_ms: Int | None = Field(None, description="accepted and ignored")
    response_fields: list[str] | None = Field(None, description="accepted and ignored: every field is sent")
    id_slot: Int | None = Field(None, description="accepted and ignored")

    def to_generation(self) -> GenerationRequest:
        req = self.generation("infill")
        if req.n != 1:
            raise bad("infill generates one completion: n must be 1", "n")
        if self.n_predict is not None and self.n_predict >= 0:
            if req.max_tokens is not None and req.max_tokens != self.n_predict:
                raise bad("max_tokens and n_predict disagree; send one", "n_predict")
            if self.n_predict == 0:
                raise bad("n_predict must be at least 1 (or -1: until the end)", "n_predict")
            req.max_tokens = self.n_predict
        req.short_default = False
        return req


class TokenizeRequest(_Body):
    content: str
    add_special: bool = Field(True, description="apply the model's BOS rule")
    parse_special: bool = Field(True, description="read special-token text as those tokens")
    with_pieces: bool = Field(False, description="answer {id, piece} objects instead of bare ids")
    model: str | None = None


class DetokenizeRequest(_Body):
    tokens: list[TokenId] = Field(description="token ids (within the model's vocabulary)")
    model: str | None = None


def _check_ids(ids: list[int], n_vocab: int, param: str) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < n_vocab:
            raise bad(f"{param}[{i}] = {t} is outside the vocabulary (0..{n_vocab - 1})", param)





def chat_request(raw: bytes) -> GenerationRequest:
    return parse(ChatCompletionRequest, raw).to_generation()


def completion_request(raw: bytes, n_vocab: int) -> GenerationRequest:
    return parse(CompletionRequest, raw).to_generation(n_vocab)


def infill_request(raw: bytes) -> tuple[InfillRequest, GenerationRequest]:
    body = parse(InfillRequest, raw)
    return body, body.to_generation()


def tokenize_request(raw: bytes) -> TokenizeRequest:
    return parse(TokenizeRequest, raw)


def detokenize_request(raw: bytes, n_vocab: int) -> list[int]:
    ids = parse(DetokenizeRequest, raw).tokens
    _check_ids(ids, n_vocab, "tokens")
    return ids
