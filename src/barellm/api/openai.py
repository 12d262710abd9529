"""OpenAI's API in plain Python: the one place for its requests and its answers, used by the server's routes
(OpenAI's and Ollama's) and by Model.create_completion / create_chat_completion alike, so code written
against either sees the same shapes (and code written for llama-cpp-python's methods of those names moves
over unchanged).

- `GenerationRequest`: a chat or completion request as OpenAI's API words it (tools, tool_choice,
  response_format, a suffix, usage in a stream, ...). It is the Request the scheduler runs
  (generate/request.py), with those extras; the server's bodies (serve/schemas.py) and Model.create_*'s
  arguments both become one.
- `prepare`: its prompt's token ids and its compiled output constraint, from the messages and tools or the
  prompt and suffix.
- `ResponseBuilder`: the answer's objects, whole or as stream chunks, tool calls parsed out of a chat reply
  and log-probabilities in OpenAI's shapes. The server adds only the HTTP and server-sent-event framing.
- the response objects themselves as dicts (api/openai_objects.py, whose names are this module's too): pure
  functions of their arguments, which the server's pydantic models only describe (serve/openapi_doc.py), and
  its tests hold the dicts to.

No dependency beyond barellm's own: a Python API user needs no server extra.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from barellm.api.completion import Completion
from barellm.api.openai_objects import (
    chat_chunk,
    chat_completion,
    chat_logprobs,
    completion_logprobs,
    embeddings,
    new_id,
    text_chunk,
    text_completion,
    tool_call_deltas,
    usage,
    usage_chunk,
)
from barellm.errors import InvalidRequest
from barellm.generate.request import Request, SamplingOptions, from_options, takes_options

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Constraint", "GenerationRequest", "OpenAIFacade", "ResponseBuilder", "constraint_of", "model_method",
           "prepare", "new_id", "usage", "chat_completion", "text_completion", "chat_chunk", "text_chunk",
           "usage_chunk", "tool_call_deltas", "embeddings", "chat_logprobs", "completion_logprobs"]


# --- the request ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Constraint:
    """An output constraint as the request gave it: kind ("json_object", "json_schema", "grammar", "regex"),
    its value, and the field that asked (errors name it)."""

    kind: str
    value: Any
    param: str


def constraint_of(response_format: Mapping[str, Any] | None = None, json_schema: Any = None,
                  grammar: str | None = None, regex: str | None = None) -> Constraint | None:
    """The one output constraint a request asks for: OpenAI's response_format ({"type": "text"} is none), or
    llama.cpp's json_schema, grammar or regex. Two are an InvalidRequest naming the second."""
    given = []
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, Mapping) else None
        if kind == "json_object":
            given.append(Constraint("json_object", None, "response_format"))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, Mapping) else None
            given.append(Constraint("json_schema", {} if schema is None else schema,
                                    "response_format.json_schema.schema"))
        elif kind != "text":
            raise InvalidRequest('response_format must be an object with "type": "text", "json_object" or '
                                 '"json_schema"', "response_format")
    for name, value in (("json_schema", json_schema), ("grammar", grammar), ("regex", regex)):
        if value is not None:
            given.append(Constraint(name, value, name))
    if len(given) > 1:
        raise InvalidRequest(f"{given[0].param} and {given[1].param} both constrain the output: give one",
                             given[1].param)
    return given[0] if given else None


def check_tool_choice(tool_choice: Any, constraint: Constraint | None) -> None:
    """tool_choice "required" or a named function constrains the output to tool calls: no other constraint."""
    if constraint is not None and tool_choice not in (None, "none", "auto"):
        raise InvalidRequest(f"tool_choice {tool_choice!r} constrains the output to tool calls; it cannot be "
                             f"combined with {constraint.param}", "tool_choice")


@dataclass(eq=False)
class GenerationRequest(Request):
    """A chat ("chat") or completion ("completion", "infill") request as OpenAI's API words it: the Request the
    scheduler runs, and what makes its prompt and shapes its answer."""

    kind: str = "chat"
    model: str | None = None                   # the model the request names
    include_usage: bool = False                # a stream ends with a usage chunk
    tokens_as_ids: bool = False                # logprobs name tokens "token_id:<id>" (vLLM's extension)
    messages: list[dict[str, Any]] | None = None
    prompt_text: str | None = None             # a completion's prompt as text (token ids go to `prompt` as they are)
    short_default: bool = True                 # no max_tokens on a completion: 16 tokens (OpenAI's), else the rest
    clamp_max_tokens: bool = False             # max_tokens past the context: cut to fit (Ollama's) instead of a 400
    constraint: Constraint | None = None       # the output's format (JSON schema, regex, grammar), as asked
    tools: list[dict[str, Any]] | None = None  # OpenAI's tool objects
    tool_choice: Any = None                    # "none", "auto", "required", {"type": "function", ...}; None: default
    parallel_tool_calls: bool = True
    suffix: str | None = None                  # fill-in-the-middle: the text after the hole
    tool_names: list[str] | None = field(default=None)   # parse tool calls of these functions out of the reply
    reasoning_format: str = "auto"             # llama-server's: "auto"/"deepseek" split the reasoning off, "none" not
    template_kwargs: dict[str, Any] | None = None   # further chat template variables (text/reasoning.template_kwargs)
    reasoning: str | None = None               # set by prepare: the reasoning format the reply is split by
    reasoning_inside: bool = False             # set by prepare: the prompt leaves the reply inside <think>


REASONING_FORMATS = ("auto", "deepseek", "none")


def check_reasoning_format(value: Any) -> str:
    if value not in REASONING_FORMATS:
        raise InvalidRequest(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got {value!r}",
                             "reasoning_format")
    return cast(str, value)


def constrain(model: Any, req: GenerationRequest) -> None:
    """Compiles req's output constraint into req.grammar (response_format, json_schema, grammar, regex, or
    tool_choice "required" / a named function) and decides whether tool calls are parsed out of the reply
    (req.tool_names). An InvalidRequest names the field that cannot be served (compiling a large schema takes
    a while, and the first one builds the model's vocabulary for llguidance: the server runs this off its
    event loop)."""
    from barellm.text.toolcalls import resolve_choice

    c = req.constraint
    param = c.param if c is not None else "tool_choice"
    try:
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
            check_tool_choice(req.tool_choice, c)
            param = "tool_choice"
            mode, name = resolve_choice(req.tools, req.tool_choice)
            if mode in ("required", "function"):
                assert req.tools is not None
                req.grammar = model.tool_grammar(req.tools, mode, name, req.parallel_tool_calls)
            if mode != "none" and req.tools:
                req.tool_names = [t["function"]["name"] for t in req.tools]
    except InvalidRequest as e:
        if e.param is None:
            e.param = param
        raise


def prepare(model: Any, req: GenerationRequest) -> None:
    """Makes req's prompt (token ids) and compiles its constraint (constrain): a chat's messages through the
    model's template, with its tools when their calls are parsed; a completion's text tokenized, or with a
    suffix made a fill-in-the-middle prompt whose end rules join req's (a completion given as token ids
    keeps them). An InvalidRequest names the field at fault."""
    constrain(model, req)
    if req.kind == "chat":
        check_reasoning_format(req.reasoning_format)
        tools = req.tools if req.tool_names is not None else None
        try:
            messages = req.messages or []
            if hasattr(model, "_chat_prompt"):
                req.prompt, req.reasoning_inside = model._chat_prompt(messages, True, tools, req.template_kwargs)
            else:   # a model that only renders (no reasoning, no template variables)
                req.prompt = model.chat_prompt(messages, tools=tools) if tools is not None else \
                    model.chat_prompt(messages)
        except InvalidRequest as e:
            raise InvalidRequest(str(e), e.param if e.param in ("chat_template_kwargs", "reasoning_effort")
                                 else "messages") from None
        fmt = getattr(model, "reasoning_format", None)
        req.reasoning = fmt if isinstance(fmt, str) and req.reasoning_format != "none" else None
        return
    text = req.prompt_text
    if text is None:
        return
    try:
        if req.suffix:
            from barellm.text.infill import end_rules

            req.prompt = model.infill_prompt(text, req.suffix, max_tokens=req.max_tokens, repo_level=False)
            stops, req.min_indent = end_rules(text, req.suffix)
            req.stops = req.stops + stops
        else:
            req.prompt = model.tokenize(text)
    except InvalidRequest as e:
        raise InvalidRequest(str(e), "suffix" if req.suffix else "prompt") from None


# --- the answer ----------------------------------------------------------------------------------------

class ResponseBuilder:
    """The objects of one request's answer in OpenAI's shapes: whole (`whole`) or as the chunks of a stream
    (`opening`, `text`, `closing`, `usage_chunk`), each choice's tool calls parsed out of a chat reply (in a
    stream, each call as soon as it is complete) and its log-probabilities mapped, the same for the server and
    for Model.create_*."""

    def __init__(self, req: GenerationRequest, model: str, token_bytes: Callable[[int], bytes], *,
                 prompt_chars: int = 0, fingerprint: str | None = None) -> None:
        self.req = req
        self.chat = req.kind == "chat"
        self.model = model
        self.token_bytes = token_bytes
        self.id = new_id(self.chat)
        self.created = int(time.time())
        self.fingerprint = fingerprint
        self.prompt_chars = prompt_chars    # legacy logprobs' text_offset counts from the start of the prompt
        self.offsets: dict[int, int] = {}   # per choice: text_offset of its next token
        self.tool_names = req.tool_names if self.chat else None
        # a reasoning model's reply: split (text/reasoning.py); a chat's, or Ollama's /api/generate's
        self.reasoning = req.reasoning
        self._calls: dict[int, Any] = {}    # per choice: its ToolCallStream
        self._reasoners: dict[int, Any] = {}   # per choice: its ReasoningStream
        self._sent: dict[int, int] = {}     # per choice: tool calls passed on (the next one's index in a stream)
        self._held: dict[int, list[Any]] = {}   # per choice: logprobs of text a call still holds

    def usage(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
              generated: Sequence[Sequence[int]] = ()) -> dict[str, Any]:
        """The usage object; a chat's says how many of the generated tokens (each choice's ids) went to a
        reasoning model's reasoning (completion_tokens_details.reasoning_tokens: 0 for a reply not split)."""
        if not self.chat:
            return usage(prompt_tokens, completion_tokens, cached_tokens)
        reasoning = sum(self.reasoning_tokens(ids) for ids in generated)
        return usage(prompt_tokens, completion_tokens, cached_tokens, reasoning)

    def reasoning_tokens(self, ids: Sequence[int]) -> int:
        """How many of one choice's generated tokens went to its reasoning (text/reasoning.count_reasoning_tokens:
        each token where the splitter put its text); 0 when the reply is not split."""
        if self.reasoning is None or not ids:
            return 0
        from barellm.text.reasoning import count_reasoning_tokens, token_pieces

        return count_reasoning_tokens(token_pieces(self.token_bytes, ids), self.reasoning,
                                      inside=self.req.reasoning_inside, calls=self.tool_names is not None)

    def logprobs(self, toks: Sequence[Any], index: int = 0) -> dict[str, Any] | None:
        """A run of one choice's tokens (TokenLogprob) as OpenAI's logprobs object; None when not asked."""
        if self.req.top_logprobs is None:
            return None
        as_ids = self.req.tokens_as_ids
        if self.chat:
            return chat_logprobs(toks, self.token_bytes, as_ids)
        out, self.offsets[index] = completion_logprobs(toks, self.token_bytes,
                                                       self.offsets.get(index, self.prompt_chars), as_ids)
        return out

    def calls(self, text: str, reason: str) -> tuple[str | None, list[dict[str, Any]] | None, str]:
        """A whole chat reply's content, tool calls and finish reason ("tool_calls" when it called any and
        stopped of its own accord); the text as it is when the request parses no calls or it made none."""
        if self.reasoning is not None:
            parts = self.split(-1, text, final=True)
            content = "".join(p for k, p in parts if k == "content")
            calls = [p for k, p in parts if k == "call"]
            if not calls:
                return content, None, reason
            return content.strip() or None, calls, "tool_calls" if reason == "stop" else reason
        if self.tool_names is None:
            return text, None, reason
        from barellm.text.toolcalls import parse_tool_calls

        content, calls = parse_tool_calls(text, self.tool_names)
        if not calls:
            return text, None, reason
        return content, calls, "tool_calls" if reason == "stop" else reason

    def whole(self, choices: Sequence[tuple[str, Sequence[Any], str]], usage: dict[str, Any]) -> dict[str, Any]:
        """The response object of (text, logprobs, finish reason) of each choice."""
        body: dict[str, Any] | None = None
        ids = {"created": self.created, "fingerprint": self.fingerprint}
        for i, (text, toks, reason) in enumerate(choices):
            lps = self.logprobs(toks, i)
            if self.chat:
                content, calls, reason = self.calls(text, reason)
                one = chat_completion(self.id, self.model, content, reason, usage, logprobs=lps, tool_calls=calls,
                                      reasoning=self.reasoning_of(-1), **ids)
            else:
                one = text_completion(self.id, self.model, text, reason, usage, logprobs=lps, **ids)
            if body is None:
                body = one
            else:
                body["choices"].append({**one["choices"][0], "index": i})
        assert body is not None
        return body

    def reasoning_of(self, index: int) -> str | None:
        """The reasoning a whole reply's split found (None: none), forgetting its stream."""
        stream = self._reasoners.pop(index, None)
        self._calls.pop(index, None)
        return getattr(stream, "text", None) or None

    def chunk(self, text: str | None, logprobs: dict[str, Any] | None = None, finish_reason: str | None = None,
              role: bool = False, index: int = 0, tool_calls: list[dict[str, Any]] | None = None,
              reasoning: str | None = None) -> dict[str, Any]:
        """One chunk of choice `index`."""
        ids = {"created": self.created, "fingerprint": self.fingerprint, "with_usage": self.req.include_usage}
        if self.chat:
            out = chat_chunk(self.id, self.model, text=text, role=role, finish_reason=finish_reason,
                             logprobs=logprobs, tool_calls=tool_calls, reasoning=reasoning, **ids)
        else:
            out = text_chunk(self.id, self.model, text=text or "", finish_reason=finish_reason, logprobs=logprobs,
                             **ids)
        if index:
            out["choices"][0]["index"] = index
        return out

    def opening(self, n: int) -> list[dict[str, Any]]:
        """A stream's first chunks: a chat's role for each choice (a completion has none)."""
        return [self.chunk(None, role=True, index=i) for i in range(n)] if self.chat else []

    def split(self, index: int, text: str, final: bool = False) -> list[tuple[str, Any]]:
        """A chat reply's run of text split into reasoning, content and whole tool calls ([("reasoning", str) |
        ("content", str) | ("call", dict)]), as its ReasoningStream (a reasoning model's) and ToolCallStream
        (with tools) see them; final: the reply ended, what they hold comes out."""
        parts: list[tuple[str, Any]] = [("content", text)]
        if self.reasoning is not None:
            from barellm.text.reasoning import HARMONY, ReasoningStream

            reasoner = self._reasoners.get(index)
            if reasoner is None:
                reasoner = self._reasoners[index] = _Reasoner(ReasoningStream(
                    self.reasoning, inside=self.req.reasoning_inside, calls=self.tool_names is not None))
            parts = reasoner.feed(text) + (reasoner.finish() if final else [])
            if self.reasoning == HARMONY:   # its calls are messages of their own, split off above
                return parts
        if self.tool_names is None:
            return parts
        from barellm.text.toolcalls import ToolCallStream

        stream = self._calls.get(index)
        if stream is None:
            stream = self._calls[index] = ToolCallStream(self.tool_names or ())
        out: list[tuple[str, Any]] = []
        for kind, p in parts:
            out.extend(stream.feed(p) if kind == "content" else [(kind, p)])
        return out + (stream.finish() if final else [])

    def text(self, index: int, text: str, toks: Sequence[Any]) -> list[dict[str, Any]]:
        """The chunks of a run of one choice's text: one, or with reasoning or tool calls parsed, the
        reasoning, the content and the calls complete so far (the logprobs go with the first chunk after
        their text; a call still open holds them)."""
        if self.tool_names is None and self.reasoning is None:
            return [self.chunk(text, self.logprobs(toks, index), index=index)]
        return self._parts(index, self.split(index, text), toks)

    def _parts(self, index: int, parts: list[tuple[str, Any]], toks: Sequence[Any]) -> list[dict[str, Any]]:
        held = self._held.setdefault(index, [])
        held.extend(toks)
        out = []
        for kind, p in parts:
            lps = self.logprobs(held, index)
            held.clear()
            if kind == "content":
                out.append(self.chunk(p, lps, index=index))
            elif kind == "reasoning":
                out.append(self.chunk(None, lps, index=index, reasoning=p))
            else:
                sent = self._sent.get(index, 0)
                out.append(self.chunk(None, lps, index=index, tool_calls=tool_call_deltas([p], sent)))
                self._sent[index] = sent + 1
        return out

    def closing(self, index: int, reason: str) -> list[dict[str, Any]]:
        """A choice's last chunks: what its tool-call parsing still holds, and the one with its finish reason
        ("tool_calls" when it called any and stopped of its own accord)."""
        out = []
        if self.tool_names is not None or self.reasoning is not None:
            out = self._parts(index, self.split(index, "", final=True), [])
            if self._sent.get(index) and reason == "stop":
                reason = "tool_calls"
        return out + [self.chunk(None, finish_reason=reason, index=index)]

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return usage_chunk(self.id, self.model, self.chat, usage, created=self.created, fingerprint=self.fingerprint)


class _Reasoner:
    """A ReasoningStream that keeps the reasoning it has split off (a whole reply's message needs it)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.text = ""

    def _keep(self, parts: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        self.text += "".join(p for k, p in parts if k == "reasoning")
        return parts

    def feed(self, text: str) -> list[tuple[str, Any]]:
        return self._keep(self.stream.feed(text))

    def finish(self) -> list[tuple[str, Any]]:
        return self._keep(self.stream.finish())


# --- the Python API's OpenAI methods -------------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])


def model_method(fn: F) -> F:
    """An OpenAIFacade method offered as a Model's own (Model.create_completion, ...): the same signature and
    docstring, run by the model's facade."""
    @functools.wraps(fn)
    def method(model: Any, /, *args: Any, **kwargs: Any) -> Any:
        return fn(model.openai, *args, **kwargs)
    return cast(F, method)


def include_usage(stream_options: Any, stream: bool) -> bool:
    """OpenAI's stream_options ({"include_usage": bool}, with stream=True only) as the flag it sets."""
    if stream_options is None:
        return False
    if not stream:
        raise InvalidRequest("stream_options is only allowed with stream=True")
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"} \
            or not isinstance(stream_options.get("include_usage", False), bool):
        raise InvalidRequest(f"stream_options must be {{'include_usage': True or False}}, got {stream_options!r}")
    return bool(stream_options.get("include_usage", False))


class OpenAIFacade:
    """A model's methods that take and give OpenAI's shapes, as llama-cpp-python's of these names do: their
    requests become the GenerationRequest a server body becomes, prepared and answered by the same code. The
    Model offers them as its own (model_method); model.openai is its facade."""

    def __init__(self, model: Any) -> None:
        self.model = model

    @takes_options(leave_out=("top_logprobs", "timings"))
    def create_completion(self, prompt: str | Sequence[int], *, max_tokens: int | None = 16, stream: bool = False,
                          stream_options: dict[str, Any] | None = None,
                          response_format: dict[str, Any] | None = None, suffix: str | None = None,
                          logprobs: int | None = None, **options: Unpack[SamplingOptions]
                          ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """complete() as OpenAI's text_completion object (id, object, created, model, choices[0].text and
        finish_reason, usage), as llama-cpp-python's method of this name returns it; stream=True yields the
        chunk objects as they come. max_tokens None: the rest of the context; logprobs=k: each token's
        log-probability and its k best alternatives (0..20); suffix: the text after a hole to fill (the prompt
        is the text before it); stream_options={"include_usage": True}: the stream ends with a chunk holding the
        usage (OpenAI's); other keywords as generate()."""
        if "top_logprobs" in options:
            raise InvalidRequest("create_completion takes logprobs=k (the alternatives per token)")
        if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool)
                                     or not 0 <= logprobs <= 20):
            raise InvalidRequest(f"logprobs must be an integer in 0..20, got {logprobs!r}")
        req = self._request("completion", options, max_tokens, stream, logprobs, response_format, stream_options)
        if isinstance(prompt, str):
            req.prompt_text, req.suffix = prompt, suffix or None
        elif suffix:
            raise InvalidRequest("suffix needs a string prompt (the text before the hole)")
        else:
            req.prompt = self.model._prompt_ids(prompt)
        return self._answer(req)

    @takes_options(leave_out=("timings",))
    def create_chat_completion(self, messages: Sequence[dict[str, Any]], *, max_tokens: int | None = None,
                               stream: bool = False, stream_options: dict[str, Any] | None = None,
                               tools: Sequence[dict[str, Any]] | None = None,
                               tool_choice: Any = None, parallel_tool_calls: bool = True,
                               response_format: dict[str, Any] | None = None, logprobs: bool = False,
                               top_logprobs: int | None = None, reasoning_effort: str | None = None,
                               chat_template_kwargs: dict[str, Any] | None = None, reasoning_format: str = "auto",
                               **options: Unpack[SamplingOptions]) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """chat() as OpenAI's chat.completion object (choices[0].message), or with stream=True its
        chat.completion.chunk objects (stream_options={"include_usage": True}: ending with a chunk holding the
        usage, reasoning_tokens included). max_tokens None: the rest of the context.

        tools, tool_choice ("auto" by default with tools; "none", "required", {"type": "function",
        "function": {"name": ...}}), parallel_tool_calls: OpenAI's; the model's calls come back as
        message.tool_calls (streamed: delta.tool_calls) with finish_reason "tool_calls". "required" and a
        named function constrain the output to calls whose arguments fit the function's schema.
        response_format: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}.
        logprobs, top_logprobs: OpenAI's chat ones (a flag, and the alternatives per token).
        A reasoning model's reasoning comes back as message.reasoning_content (streamed:
        delta.reasoning_content), llama-server's shape; reasoning_format "none" leaves it in the content as
        generated. reasoning_effort ("low", "medium", "high") and chat_template_kwargs reach the template."""
        from barellm.text.reasoning import template_kwargs
        from barellm.text.toolcalls import validate_tools

        if not isinstance(logprobs, bool):
            raise InvalidRequest(f"logprobs must be True or False here, got {logprobs!r}")
        if top_logprobs is not None and not logprobs:
            raise InvalidRequest("top_logprobs needs logprobs=True")
        req = self._request("chat", options, max_tokens, stream, (top_logprobs or 0) if logprobs else None,
                            response_format, stream_options)
        req.messages = list(messages)
        req.tools = validate_tools(tools) if tools else None
        req.tool_choice, req.parallel_tool_calls = tool_choice, parallel_tool_calls
        req.template_kwargs = template_kwargs(chat_template_kwargs, reasoning_effort)
        req.reasoning_format = check_reasoning_format(reasoning_format)
        return self._answer(req)

    def _request(self, kind: str, options: Any, max_tokens: int | None, stream: bool,
                 top_logprobs: int | None, response_format: Any, stream_options: Any = None) -> GenerationRequest:
        """The GenerationRequest of create_*'s arguments, as the server makes one of a body: the output
        constraint kept as asked (response_format, json_schema, grammar or regex: one of them), compiled with
        the prompt (prepare, as the server does)."""
        for k in ("timings", "max_tokens", "logprobs", "top_logprobs"):
            if k in options:
                raise InvalidRequest(f"unknown generation parameter here: {k}")
        constraint = constraint_of(response_format, *(options.get(k) for k in ("json_schema", "grammar", "regex")))
        rest = {k: v for k, v in options.items() if k not in ("json_schema", "grammar", "regex")}
        if constraint is not None and rest.get("allowed_tokens") is not None:
            raise InvalidRequest(f"allowed_tokens and {constraint.param} both constrain the output: give one")
        req = from_options({**rest, "logprobs": top_logprobs is not None, "top_logprobs": top_logprobs,
                            "max_tokens": max_tokens}, cls=GenerationRequest)
        req.kind, req.constraint, req.stream, req.clamp_max_tokens = kind, constraint, stream, True
        req.include_usage = include_usage(stream_options, stream)
        return req

    def _answer(self, req: GenerationRequest) -> dict[str, Any] | Iterator[dict[str, Any]]:
        m = self.model
        m._check_served()
        prepare(m, req)
        if req.max_tokens is None:   # OpenAI's None: the rest of the context
            req.max_tokens = max(m.n_ctx - len(req.prompt), 0)
        m._submit(req.prompt, req)   # a bad request fails here, not at a stream's first next()
        prompt_chars = len(req.prompt_text) if req.prompt_text is not None else 0
        out = ResponseBuilder(req, m.name, m.tokenizer.token_bytes, prompt_chars=prompt_chars)
        if req.stream:
            return self._chunks(req, out)
        c = m._complete(req)
        usage = out.usage(c.prompt_tokens, c.cached_tokens, sum(len(ch.token_ids) for ch in c.choices),
                          [ch.token_ids for ch in c.choices])
        return out.whole([(ch.text, ch.logprobs or [], ch.finish_reason) for ch in c.choices], usage)

    def _chunks(self, req: GenerationRequest, out: Any) -> Iterator[dict[str, Any]]:
        c = Completion()
        yield from out.opening(req.n)
        for ev in self.model._run(req, c, pause=True):
            if ev.text or ev.tokens:
                yield from out.text(ev.index, ev.text, ev.tokens)
        for ch in c.choices:
            yield from out.closing(ch.index, ch.finish_reason)
        if req.include_usage:
            ids = [ch.token_ids for ch in c.choices]
            yield out.usage_chunk(out.usage(c.prompt_tokens, c.cached_tokens, sum(map(len, ids)), ids))
