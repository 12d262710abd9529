"""Reasoning models: what a reply's text holds besides the answer, split off as it arrives.

Two formats, chosen from the model's chat template and vocabulary (`reasoning_format`):

- "harmony" (gpt-oss): the reply is a run of messages, each a header and a body,

      <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER

  (the first `<|start|>assistant` is the prompt's). The analysis channel is reasoning, the final channel (and
  commentary without a recipient, a preamble) is the answer, and a message to a function is a tool call:
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}` (the recipient may also come
  before `<|channel|>`). `<|end|>` ends a message, not the reply: the tokenizer leaves it out of the
  end-of-generation tokens when the vocabulary has `<|return|>` and `<|call|>`, which end the reply (the
  answer, a call), as llama.cpp does for this vocabulary.
- "think" (Qwen3, SmolLM3, DeepSeek-R1 and its distills): the reply may open with `<think>...</think>`,
  the reasoning; the rest is the answer. Templates that write `<think>` at the end of the prompt (the R1
  distills always, Qwen3 with thinking on) leave the reply inside the reasoning: `opens_inside` tells from
  the rendered prompt's tail, and the stream then starts there.

The reasoning is stripped of the whitespace around it, as llama.cpp's server strips it; the answer is left as
written, less the whitespace after `</think>`. A reply cut off inside the reasoning (max_tokens) is all
reasoning and an empty answer. The control tokens are seen as text: the detokenizer writes special tokens as
their text (it skips none while generating).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from barellm.text.toolcalls import new_call_id, partial_marker

__all__ = ["FORMATS", "HARMONY", "THINK", "ReasoningStream", "count_reasoning_tokens", "opens_inside",
           "reasoning_format", "split_reasoning", "token_pieces"]

HARMONY = "harmony"
THINK = "think"
FORMATS = (HARMONY, THINK)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

_CHANNEL = "<|channel|>"
_MESSAGE = "<|message|>"
_START = "<|start|>"
_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=functions\.([^<\s]+)")
_CHANNEL_NAME = re.compile(re.escape(_CHANNEL) + r"([A-Za-z_]+)")
_HEADER_LIMIT = 512   # characters of a header without <|message|>: the model is not writing harmony


def reasoning_format(template_source: str, has_token: Callable[[str], bool]) -> str | None:
    """The reasoning format of a model: "harmony" when its template or its vocabulary speaks harmony's
    channels, "think" when its template or vocabulary has `<think>`, None otherwise. has_token(text): whether
    text is one token."""
    if (_CHANNEL in template_source and _MESSAGE in template_source) or (has_token(_CHANNEL) and
                                                                         has_token(_MESSAGE)):
        return HARMONY
    if THINK_CLOSE in template_source or (has_token(THINK_OPEN) and has_token(THINK_CLOSE)):
        return THINK
    return None


def opens_inside(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside `<think>` (what follows is reasoning until `</think>`)."""
    i = prompt_text.rfind(THINK_OPEN)
    return i >= 0 and not prompt_text[i + len(THINK_OPEN):].strip()


class _Trimmed:
    """A run of text passed on without the whitespace at its start and its end (held until text follows)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.started = False
        self.ws = ""

    def put(self, text: str, out: list[tuple[str, Any]]) -> None:
        s = self.ws + text
        if not self.started:
            s = s.lstrip()
        body = s.rstrip()
        self.ws = s[len(body):]
        if body:
            out.append((self.kind, body))
            self.started = True

    def separate(self) -> None:
        """A next run of this kind follows an earlier one: a blank line between them."""
        if self.started:
            self.ws = "\n\n"


class ReasoningStream:
    """Splits a reply arriving in pieces into reasoning, answer and (harmony) tool calls, as early as each is
    certain. feed(text) and finish() return [("reasoning", str) | ("content", str) | ("call", dict)]; text
    that may be the start of a marker is held back until it is known.

    fmt: "harmony" or "think". inside: the reply starts inside the reasoning (think; see opens_inside).
    calls: harmony's messages to functions become ("call", {...}) in OpenAI's shape; without, their bodies
    are reasoning (the model's own working, not the answer)."""

    def __init__(self, fmt: str, *, inside: bool = False, calls: bool = False) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"reasoning format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        self.fmt = fmt
        self.calls = calls
        self.reasoning = _Trimmed("reasoning")
        self._buf = ""
        self._content_ws = ""        # think: whitespace after </think>, dropped
        # think: "start" (before anything but whitespace), "reasoning", "after" (after </think>), "content"
        # harmony: "header", "body"
        self._state = ("reasoning" if inside else "start") if fmt == THINK else "header"
        self._channel = ""           # harmony: the current message's kind: "reasoning", "content" or "call"
        self._recipient = ""
        self._body = ""              # harmony: a call's arguments so far

    # --- think ------------------------------------------------------------------------------------------

    def _feed_think(self, out: list[tuple[str, Any]]) -> None:
        while True:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(THINK_OPEN):
                    self._buf = head[len(THINK_OPEN):]
                    self._state = "reasoning"
                    continue
                if not head or THINK_OPEN.startswith(head):
                    return   # whitespace, or the start of <think>: not known yet
                self._state = "content"   # no reasoning: the reply as it is, leading whitespace included
                continue
            if self._state == "reasoning":
                end = self._buf.find(THINK_CLOSE)
                if end < 0:
                    keep = partial_marker(self._buf, (THINK_CLOSE,))
                    self.reasoning.put(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self.reasoning.put(self._buf[:end], out)
                self._buf = self._buf[end + len(THINK_CLOSE):]
                self._state = "after"
                continue
            if self._state == "after":
                head = self._buf.lstrip()
                if not head:
                    self._buf = ""
                    return
                self._buf = head
                self._state = "content"
                continue
            if self._buf:
                out.append(("content", self._buf))
            self._buf = ""
            return

    # --- harmony ----------------------------------------------------------------------------------------

    def _feed_harmony(self, out: list[tuple[str, Any]], final: bool = False) -> None:
        while True:
            if self._state == "header":
                at = self._buf.find(_MESSAGE)
                if at < 0:
                    if len(self._buf) > _HEADER_LIMIT and _CHANNEL not in self._buf:
                        self._state, self._channel = "body", "content"   # plain text: the answer as it is
                        continue
                    return
                self._open(self._buf[:at])
                self._buf = self._buf[at + len(_MESSAGE):]
                self._state = "body"
                continue
            ends = [(p, m) for m in _ENDS if (p := self._buf.find(m)) >= 0]
            if self._channel == "content" and self._buf.find(_START) >= 0:
                ends.append((self._buf.find(_START), ""))   # a message that ended without <|end|>
            if not ends:
                keep = 0 if final else partial_marker(self._buf, (*_ENDS, _START))
                self._body_text(self._buf[:len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                return
            at, marker = min(ends)
            self._body_text(self._buf[:at], out)
            self._close(out)
            self._buf = self._buf[at + len(marker):]
            self._state = "header"

    def _open(self, header: str) -> None:
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL_NAME.search(header)
        name = channel.group(1) if channel else ""
        if recipient:
            self._channel, self._recipient, self._body = "call", recipient.group(1), ""
        elif name == "analysis":
            self._channel = "reasoning"
            self.reasoning.separate()
        else:   # final, a commentary preamble, or a header it cannot read: the answer
            self._channel = "content"

    def _body_text(self, text: str, out: list[tuple[str, Any]]) -> None:
        if not text:
            return
        if self._channel == "reasoning":
            self.reasoning.put(text, out)
        elif self._channel == "call":
            self._body += text
        else:
            out.append(("content", text))

    def _close(self, out: list[tuple[str, Any]]) -> None:
        if self._channel != "call":
            return
        body = self._body.strip()
        self._body = ""
        try:
            json.loads(body)
            valid = True
        except ValueError:
            valid = False
        if self.calls and valid:
            out.append(("call", {"id": new_call_id(), "type": "function",
                                 "function": {"name": self._recipient, "arguments": body}}))
            return
        self.reasoning.separate()   # no tools asked for (or no JSON): the model's working, not the answer
        self.reasoning.put(f"to={self._recipient}: {body}", out)

    # --- both -------------------------------------------------------------------------------------------

    @property
    def region(self) -> str | None:
        """Where the text read next goes: "reasoning", "content" (the answer, a harmony call's message when
        calls are parsed) or None while the stream cannot tell (before anything but whitespace of a think
        reply, in a harmony message's header)."""
        if self.fmt == THINK:
            return {"start": None, "reasoning": "reasoning"}.get(self._state, "content")
        if self._state == "header":
            return None
        if self._channel == "call":
            return "content" if self.calls else "reasoning"
        return self._channel

    def feed(self, text: str) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        self._buf += text
        if self.fmt == THINK:
            self._feed_think(out)
        else:
            self._feed_harmony(out)
        return out

    def finish(self) -> list[tuple[str, Any]]:
        """What is held at the end of the reply: an unclosed reasoning is reasoning (the answer stays empty),
        an unfinished call counts when its arguments are whole JSON, a header never completed is dropped
        unless it is plain text."""
        out: list[tuple[str, Any]] = []
        if self.fmt == THINK:
            if self._state == "start":
                self._state = "content"
            elif self._state == "reasoning":
                self.reasoning.put(self._buf, out)
                self._buf = ""
            self._feed_think(out)
            return out
        if self._state == "body":
            self._feed_harmony(out, final=True)
            self._close(out)
        elif self._buf and _CHANNEL not in self._buf and _MESSAGE not in self._buf and _START not in self._buf:
            out.append(("content", self._buf))
        self._buf = ""
        self._state = "header"
        return out


def split_reasoning(text: str, fmt: str, *, inside: bool = False, calls: bool = False
                    ) -> tuple[str, str, list[dict[str, Any]]]:
    """A whole reply as (reasoning, answer, tool calls): ReasoningStream's parts joined."""
    stream = ReasoningStream(fmt, inside=inside, calls=calls)
    parts = stream.feed(text) + stream.finish()
    return ("".join(p for k, p in parts if k == "reasoning"), "".join(p for k, p in parts if k == "content"),
            [p for k, p in parts if k == "call"])


def count_reasoning_tokens(pieces: Iterable[str], fmt: str, *, inside: bool = False, calls: bool = False) -> int:
    """How many of a reply's tokens went to its reasoning, given each token's text in order. A token counts
    where the splitter is as its text arrives (so the marker closing the reasoning, `</think>` or the
    analysis message's `<|end|>`, counts with it); a token read while the splitter cannot tell yet (a
    harmony message's header, `<think>` itself) counts with the part its text turns out to open. Tokens
    still undecided at the end (a header never completed) are not reasoning."""
    stream = ReasoningStream(fmt, inside=inside, calls=calls)
    count = pending = 0
    for text in pieces:
        where = stream.region
        stream.feed(text)
        if where is None:
            pending += 1
            where = stream.region
            if where is None:
                continue
            n, pending = pending, 0
        else:
            n = 1
        if where == "reasoning":
            count += n
    return count


def token_pieces(token_bytes: Callable[[int], bytes], ids: Iterable[int]) -> Iterator[str]:
    """Each token's text as generation decodes it (special tokens as their text; "" for a token that only
    starts a character)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for i in ids:
        yield decoder.decode(token_bytes(i))


# --- what reaches the template ----------------------------------------------------------------------------

EFFORTS = ("low", "medium", "high")
# the variables a request's chat_template_kwargs may not set: the ones the renderer itself passes
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"})
_MAX_KWARGS = 32
_MAX_KWARGS_CHARS = 16384
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def template_kwargs(kwargs: Any = None, reasoning_effort: Any = None) -> dict[str, Any]:
    """The extra template variables of a request: llama-server's chat_template_kwargs (an object of at most
    32 names, its JSON at most 16 KiB; not the variables the renderer sets itself) and OpenAI's
    reasoning_effort ("low", "medium", "high"; passed as the `reasoning_effort` variable, which gpt-oss's
    template reads). InvalidRequest naming the field otherwise."""
    from barellm.errors import InvalidRequest

    out: dict[str, Any] = {}
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise InvalidRequest("chat_template_kwargs must be an object of template variables",
                                 "chat_template_kwargs")
        if len(kwargs) > _MAX_KWARGS:
            raise InvalidRequest(f"chat_template_kwargs has {len(kwargs)} names (at most {_MAX_KWARGS})",
                                 "chat_template_kwargs")
        for k in kwargs:
            if not isinstance(k, str) or not _NAME.fullmatch(k):
                raise InvalidRequest(f"chat_template_kwargs: {str(k)[:70]!r} is not a variable name",
                                     "chat_template_kwargs")
            if k in _RESERVED:
                raise InvalidRequest(f"chat_template_kwargs cannot set {k!r} (the request gives it)",
                                     "chat_template_kwargs")
        try:
            size = len(json.dumps(kwargs, ensure_ascii=False))
        except (TypeError, ValueError):
            raise InvalidRequest("chat_template_kwargs must hold JSON values", "chat_template_kwargs") from None
        if size > _MAX_KWARGS_CHARS:
            raise InvalidRequest(f"chat_template_kwargs is {size} characters of JSON (at most {_MAX_KWARGS_CHARS})",
                                 "chat_template_kwargs")
        out.update(kwargs)
    if reasoning_effort is not None:
        if reasoning_effort not in EFFORTS:
            raise InvalidRequest(f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {reasoning_effort!r}",
                                 "reasoning_effort")
        out["reasoning_effort"] = reasoning_effort
    return out


def template_messages(messages: list[dict[str, Any]], template_source: str) -> list[dict[str, Any]]:
    """Messages with an assistant's earlier reasoning, given back as `reasoning_content` (OpenAI clients of
    llama-server) or `thinking` (Ollama's), under the name the template reads (gpt-oss's: thinking; Qwen3's:
    reasoning_content), or without it where the template reads neither (each template decides what of it
    it renders)."""
    reads = [name for name in ("thinking", "reasoning_content") if re.search(rf"\b{name}\b", template_source)]
    out = []
    for m in messages:
        if not isinstance(m, dict) or not ({"thinking", "reasoning_content"} & m.keys()):
            out.append(m)
            continue
        given = next((v for v in (m.get("reasoning_content"), m.get("thinking")) if isinstance(v, str) and v), None)
        m = {k: v for k, v in m.items() if k not in ("thinking", "reasoning_content")}
        if given is not None:
            m.update({name: given for name in reads})
        out.append(m)
    return out
