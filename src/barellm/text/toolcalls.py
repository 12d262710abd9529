"""Tool calling: OpenAI's tools rendered into the prompt, the model's tool calls parsed out of its text.

The call format is the one Qwen2.5 (and Hermes-style models) are tuned on: each call is a JSON object on its
own line between markers,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and a tool's result comes back inside <tool_response></tool_response> in a user turn.

- A chat template that handles tools itself (its source uses the `tools` variable: Qwen2.5's) gets them as
  Hugging Face passes them: `tools` = the OpenAI tool objects, assistant messages with `tool_calls` (their
  JSON `arguments` strings parsed back into objects, as the templates expect) and `tool` messages.
- Any other template (SmolLM2's, Gemma's, the built-in chatml) gets the built-in form: the same
  instructions Qwen's template writes, put at the top of the system message; earlier calls written into the
  assistant's text as the model would have written them; `tool` results as a user turn of
  <tool_response> blocks. Small models follow it unevenly; tool_choice "required" or a named function
  constrains the output to a call (see `call_grammar`).

When the marker is a single token of the vocabulary (Qwen's <tool_call>), grammars name the token; otherwise
it is plain text. Parsing works on the generated text either way (special tokens are decoded as their text).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from barellm.errors import InvalidRequest
from barellm.text.tokenizer import TokenType

__all__ = ["ToolFormat", "ToolCallStream", "call_grammar", "new_call_id", "parse_tool_calls", "partial_marker",
           "prepare_messages", "tool_format", "validate_tools"]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


@dataclass(frozen=True)
class ToolFormat:
    """How one model meets tools: whether its template renders them (native) and whether the call markers
    are single tokens of its vocabulary (they are then named as tokens in grammars)."""

    native: bool
    marker_tokens: bool
    harmony: bool = False   # gpt-oss: calls are harmony messages to functions.NAME (text/reasoning.py parses them)


_HARMONY_TOKENS = ("<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|start|>")


def tool_format(template_source: str, tokenizer: Any) -> ToolFormat:
    def is_token(text: str) -> bool:   # a control or user-defined token: one symbol to the model
        i = tokenizer.token_to_id(text)
        return i is not None and tokenizer.token_type(i) in (TokenType.CONTROL, TokenType.USER_DEFINED)

    harmony = "<|channel|>" in template_source and all(is_token(t) for t in _HARMONY_TOKENS)
    return ToolFormat(native="tools" in template_source, marker_tokens=is_token(OPEN) and is_token(CLOSE),
                      harmony=harmony)


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """tools as OpenAI's [{"type": "function", "function": {"name", "description", "parameters"}}, ...]."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise InvalidRequest("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    out = []
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(fn, Mapping):
            raise InvalidRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"tools[{i}].function.name must be a non-empty string")
        if name in names:
            raise InvalidRequest(f"tools[{i}].function.name: {name!r} is defined twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append({"type": "function", "function": dict(fn)})
    return out


def resolve_choice(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any) -> tuple[str, str | None]:
    """OpenAI's tool_choice as (mode, function name): mode "none" (no tools: not rendered, nothing parsed),
    "auto" (the model decides; calls are parsed out of its text), "required" (one or more calls, any
    function) or "function" (a call of the named one). The default: "auto" with tools, "none" without."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequest(f'tool_choice must be "none", "auto", "required" or {{"type": "function", ...}}, '
                                 f"got {tool_choice!r}")
        if tool_choice != "none" and not tools:
            raise InvalidRequest(f'tool_choice "{tool_choice}" needs tools')
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise InvalidRequest('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                             '{"name": ...}}')
    if not any(t["function"]["name"] == name for t in tools or ()):
        raise InvalidRequest(f"tool_choice names the function {name!r}, which is not among the tools")
    return "function", name


def _arguments(call: Mapping[str, Any]) -> tuple[str, Any]:
    fn = call.get("function", call)
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise InvalidRequest("a tool call in messages has no function name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass   # kept as the string it is
    return name, args


def _call_text(name: str, args: Any) -> str:
    return f'{OPEN}\n{json.dumps({"name": name, "arguments": args}, ensure_ascii=False)}\n{CLOSE}'


def prepare_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                     fmt: ToolFormat) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables that render tools, earlier calls and tool results for a
    template of format fmt. tools None or empty: no tool instructions (earlier calls still render)."""
    if fmt.native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("content") is None:
                m["content"] = ""
            if m.get("tool_calls"):
                calls = []
                for c in m["tool_calls"]:
                    name, args = _arguments(c)
                    calls.append({**c, "function": {"name": name, "arguments": args}})
                m["tool_calls"] = calls
            out.append(m)
        return out, ({"tools": [dict(t) for t in tools]} if tools else {})
    out = []
    for m in messages:
        role = m.get("role")
        content = m.get("content")
        content = "" if content is None else content
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(*_arguments(c)) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")} | {"content": content})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        text = _INSTRUCTIONS.format(tools="".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, {}


def call_grammar(tools: Sequence[Mapping[str, Any]], fmt: ToolFormat, name: str | None = None,
                 parallel: bool = True) -> str:
    """llguidance Lark grammar for output that is tool calls only: one (or, with parallel, one or more) calls
    of the function `name` (None: any of tools), each with arguments valid for that function's schema.
    Compiled with end_on_exit (Model.tool_grammar): after a complete call the model's own choice decides
    whether another follows, so the list ends where the model ends its turn."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise InvalidRequest(f"tool_choice names the function {name!r}, which is not among the tools")
    alts = []
    for fn in chosen:
        params = dict(fn.get("parameters") or {"type": "object"})
        # a function takes the arguments it declares: unless the schema says otherwise, no others (a small
        # model constrained to "any further keys" may go on inventing them until max_tokens)
        if params.get("type") == "object" and not {"additionalProperties", "patternProperties"} & set(params):
            params["additionalProperties"] = False
        alts.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                     "required": ["name", "arguments"], "additionalProperties": False})
    if fmt.harmony:
        return _harmony_grammar(chosen)
    schema = {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}, "anyOf": alts} if len(alts) > 1 else \
        {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}, **alts[0]}
    if fmt.marker_tokens:
        call = f'{OPEN} "\\n" body "\\n" {CLOSE}'
    else:
        call = f'"{OPEN}\\n" body "\\n{CLOSE}"'
    # the calls of one turn: after each, another one or the end; a line break after the last is allowed, as
    # models trained on this format write one there before their end token (a list that could only go on
    # after it would force a next call on a model that meant to stop)
    start = 'call ("\\n" call)* "\\n"?' if parallel else "call"
    return f"start: {start}\ncall: {call}\nbody: %json {json.dumps(schema, ensure_ascii=False)}\n"


def _harmony_grammar(functions: Sequence[Mapping[str, Any]]) -> str:
    """A forced call in harmony's form (gpt-oss): an analysis message may come first, then one message on the
    commentary channel to functions.NAME whose body is the arguments' JSON; the model's <|call|> (an end of
    generation) ends the reply. One call per reply: harmony's calls each end the turn."""
    alts = []
    for i, fn in enumerate(functions):
        params = dict(fn.get("parameters") or {"type": "object"})
        if params.get("type") == "object" and not {"additionalProperties", "patternProperties"} & set(params):
            params["additionalProperties"] = False
        schema = {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}, **params}
        alts.append(f'call{i}: "commentary to=functions.{fn["name"]} " <|constrain|> "json" <|message|> '
                    f'args{i}\nargs{i}: %json {json.dumps(schema, ensure_ascii=False)}')
    calls = " | ".join(f"call{i}" for i in range(len(functions)))
    return (f'start: analysis? <|channel|> ({calls})\n'
            'analysis: <|channel|> "analysis" <|message|> /[^\\x00]*/ <|end|> <|start|> "assistant"\n'
            + "\n".join(alts) + "\n")


JSON_WHITESPACE = r"[\x20\x09]{1,4}|\x0D?\x0A[\x20\x09]{0,20}"   # structured.JSON_WHITESPACE (no import upward)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _as_call(body: str) -> dict[str, Any] | None:
    """OpenAI's tool call object for one block's JSON, or None when it is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        text = args
    else:
        text = json.dumps(args, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": text}}


_FENCE = re.compile(r"\s*```[a-zA-Z]*[ \t]*\n(.*)\n\s*```\s*", re.DOTALL)


def _bare_calls(text: str, names: frozenset[str]) -> list[dict[str, Any]] | None:
    """The calls of a reply that is nothing but call objects without markers ({"name": ..., "arguments":
    ...}, one after another, maybe inside one ``` fence as Qwen2.5-Coder writes them), each naming one of
    the tools; None for anything else."""
    fenced = _FENCE.fullmatch(text)
    if fenced:
        text = fenced.group(1)
    dec = json.JSONDecoder()
    i, calls = 0, []
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return calls or None
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        if not (isinstance(obj, dict) and obj.get("name") in names and set(obj) <= {"name", "arguments"}):
            return None
        call = _as_call(json.dumps(obj))
        if call is None:
            return None
        calls.append(call)


def parse_tool_calls(text: str, names: Sequence[str] = ()) -> tuple[str | None, list[dict[str, Any]]]:
    """The content (the text around the calls, stripped; None when there is none) and the tool calls in a
    reply. A block that is not a call's JSON stays in the content as it was; an unclosed last block counts
    when what follows its marker is a whole call (the model ended without the closing marker). With the
    tools' names, a reply made only of call objects without markers (small models write them so) is calls
    too."""
    stream = ToolCallStream(names)
    parts = stream.feed(text) + stream.finish()
    content = "".join(p for kind, p in parts if kind == "content").strip()
    calls = [p for kind, p in parts if kind == "call"]
    return (content or None), calls


class ToolCallStream:
    """Splits a reply arriving in pieces into content and tool calls as early as they are certain.

    feed(text) and finish() return [("content", str) | ("call", dict)]. Text that may be the start of a
    marker is held back; a call is emitted whole when its closing marker arrives. Whitespace that only
    separates calls (or trails the reply) is not content."""

    def __init__(self, names: Sequence[str] = ()) -> None:
        self.names = frozenset(names)
        self._bare: bool | None = None if self.names else False   # a reply of call objects without markers?
        self._buf = ""
        self._in_call = False
        self._ws = ""             # whitespace held until something follows it
        self._ws_call = ""        # the whitespace before the current block (back in the text if it is no call)
        self.calls = 0            # calls parsed so far
        self.sent = 0             # calls the caller has passed on (the next one's index in a stream)
        self._started = False     # content emitted yet (leading whitespace is dropped)

    def _content(self, text: str, out: list[tuple[str, Any]]) -> None:
        s = self._ws + text
        if not s.strip():
            self._ws = s
            return
        if not self._started:
            s = s.lstrip()
        body = s.rstrip()
        self._ws = s[len(body):]
        out.append(("content", body))
        self._started = True

    def feed(self, text: str) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        self._buf += text
        if self._bare is None:   # a reply that opens with "{" (or a fence and "{") is held: it may be bare calls
            self._bare = _opens_bare(self._buf)
            if self._bare is None:
                return out
        if self._bare:
            return out
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return out
                self._emit_call(self._buf[:end], out)
                self._buf = self._buf[end + len(CLOSE):]
                self._in_call = False
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                self._content(self._buf[:start], out)
                self._ws_call, self._ws = self._ws, ""
                self._buf = self._buf[start + len(OPEN):]
                self._in_call = True
                continue
            keep = partial_marker(self._buf, (OPEN,))
            self._content(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def _emit_call(self, body: str, out: list[tuple[str, Any]]) -> None:
        call = _as_call(body.strip())
        if call is None:   # not a call: the block stays text
            self._ws = self._ws_call
            self._content(f"{OPEN}{body}{CLOSE}", out)
            return
        self.calls += 1
        out.append(("call", call))

    def finish(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if self._bare:
            self._bare = False
            calls = _bare_calls(self._buf, self.names)
            if calls is not None:
                self._buf = ""
                self.calls += len(calls)
                return [("call", c) for c in calls]
            out = self.feed("")
        if self._in_call:
            call = _as_call(self._buf.strip())
            if call is not None:
                self.calls += 1
                out.append(("call", call))
            else:
                self._ws = self._ws_call
                self._content(OPEN + self._buf, out)
        else:
            self._content(self._buf, out)
        self._buf = ""
        self._in_call = False
        return out


def _opens_bare(text: str) -> bool | None:
    """Whether a reply beginning so opens with a call object ("{", or a ``` fence line and then "{"); None
    while it cannot be told yet."""
    head = text.lstrip()
    if not head or "```".startswith(head):
        return None
    if head.startswith("{"):
        return True
    if not head.startswith("```"):
        return False
    nl = head.find("\n")
    if nl < 0:
        return None if len(head) < 40 else False
    rest = head[nl + 1:].lstrip()
    return None if not rest else rest.startswith("{")


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of text that is a proper start of one of markers: what a stream holds back
    until the next piece tells whether a marker begins there (the tool-call and reasoning streams')."""
    for k in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0
