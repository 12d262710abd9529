"""A Model's chats: the prompt its messages (and tools) make through the chat template, the reasoning format
of its replies, and a reasoning model's text split into its reasoning and its answer as it comes.

`Chats` is what a Model has for this (`model.chats`); the Model's chat methods (chat, complete_chat,
chat_stream, chat_prompt, reasoning_format) are its own, built on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from barellm.api.completion import Completion
from barellm.generate.request import Event, Request

__all__ = ["Chats", "split_reasoning"]


class Chats:
    """The chat side of one Model: its prompt from messages and tools, its reasoning format, its chat requests."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._format: str | None = None
        self._format_known = False

    @property
    def reasoning_format(self) -> str | None:
        """How the model's replies carry their reasoning (text/reasoning.py): "harmony" (gpt-oss's channels),
        "think" (<think>...</think>), or None (a model that does not reason aloud). Found on first use."""
        if not self._format_known:
            from barellm.text.reasoning import reasoning_format
            from barellm.text.tokenizer import TokenType

            tokenizer = self.model.tokenizer

            def is_token(text: str) -> bool:
                i = tokenizer.token_to_id(text)
                return i is not None and tokenizer.token_type(i) in (TokenType.CONTROL, TokenType.USER_DEFINED)

            self._format = reasoning_format(self.model.template.source, is_token)
            self._format_known = True
        return self._format

    def prompt(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[dict[str, Any]] | None = None,
               template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], bool]:
        """Model.chat_prompt's ids, and whether the prompt leaves the reply inside a <think> block."""
        from barellm.text.reasoning import opens_inside, template_messages
        from barellm.text.toolcalls import prepare_messages, validate_tools

        model = self.model
        msgs: list[Any] = list(messages)
        if model.system and not any(isinstance(m, dict) and m.get("role") == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": model.system})   # a message's own system prompt wins
        extra: dict[str, Any] = dict(template_kwargs or {})
        if tools or any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in msgs):
            if all(isinstance(m, dict) for m in msgs):
                msgs, tool_extra = prepare_messages(msgs, validate_tools(tools) if tools else None,
                                                    model.tool_format)
                extra.update(tool_extra)
        msgs = template_messages(msgs, model.template.source)
        text = model.template.render(msgs, add_generation_prompt=add_generation_prompt, **extra)
        ids = model.tokenizer.encode(text, add_special=False, parse_special=True)
        bos = model.tokenizer.bos_id
        if model.tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids   # the template did not write the BOS the model expects
        return ids, add_generation_prompt and self.reasoning_format == "think" and opens_inside(text)

    def request(self, messages: Sequence[dict[str, Any]], options: dict[str, Any], reasoning_effort: Any,
                chat_template_kwargs: Any) -> tuple[Request, tuple[str, bool] | None]:
        """The chat's Request, submitted with its prompt and checked, and how to split its text: (the reasoning
        format, whether the reply starts inside the reasoning), or None for a model that does not reason."""
        from barellm.text.reasoning import template_kwargs

        model = self.model
        req = model._request(options)
        ids, inside = self.prompt(messages, template_kwargs=template_kwargs(chat_template_kwargs, reasoning_effort))
        fmt = self.reasoning_format
        return model._submit(ids, req), ((fmt, inside) if fmt is not None else None)

    def complete(self, req: Request, split: tuple[str, bool] | None) -> Completion:
        """The whole Completion of a chat request, each choice's reasoning split off its answer."""
        if split is None:
            return self.model._complete(req)
        req.stream = False
        c = Completion()
        for _ in split_reasoning(self.model._run(req, c), c, *split, token_bytes=self.model.tokenizer.token_bytes):
            pass
        return c


def split_reasoning(events: Iterator[Event], c: Completion, fmt: str, inside: bool,
                    token_bytes: Callable[[int], bytes] | None = None) -> Iterator[tuple[str, str]]:
    """A reasoning model's chat: each choice's text split into its reasoning and its answer as it comes
    (text/reasoning.py); yields the first choice's parts, and leaves each choice's answer in its text,
    its reasoning in its reasoning and, given token_bytes (the tokenizer's), how many of its tokens went
    to the reasoning in its reasoning_tokens (text/reasoning.count_reasoning_tokens)."""
    from barellm.text.reasoning import ReasoningStream, count_reasoning_tokens, token_pieces

    streams: dict[int, ReasoningStream] = {}
    got: dict[int, dict[str, list[str]]] = {}

    def take(index: int, parts: list[tuple[str, Any]]) -> Iterator[tuple[str, str]]:
        mine = got.setdefault(index, {"reasoning": [], "content": []})
        for kind, text in parts:
            if kind in mine and text:
                mine[kind].append(text)
                if index == 0:
                    yield kind, text

    for ev in events:
        if ev.text:
            stream = streams.setdefault(ev.index, ReasoningStream(fmt, inside=inside))
            yield from take(ev.index, stream.feed(ev.text))
    for ch in c.choices:
        stream = streams.get(ch.index, ReasoningStream(fmt, inside=inside))
        yield from take(ch.index, stream.finish())
        mine = got.get(ch.index, {"reasoning": [], "content": []})
        ch.text, ch.reasoning = "".join(mine["content"]), "".join(mine["reasoning"])
        if token_bytes is not None:
            ch.reasoning_tokens = count_reasoning_tokens(token_pieces(token_bytes, ch.token_ids), fmt, inside=inside)
    if c.choices:
        head = c.choices[0]
        c.text, c.reasoning, c.reasoning_tokens = head.text, head.reasoning, head.reasoning_tokens
