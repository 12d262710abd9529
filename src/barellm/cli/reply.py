"""A reply streamed to the terminal or a pipe, for `barellm run` and the interactive chat (chat_repl.py): the
text rendered as Markdown on a terminal (terminal_markdown.py), written as it comes elsewhere; a reasoning
model's thinking (text/reasoning.py) split off the answer and shown before it, dimmed on a terminal between
Ollama's 'Thinking...' and '...done thinking.' lines, or left out; and what the reply was (`Reply`: its text
and thinking, counts, times, and which limit or interruption ended it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from barellm.generate.generation import DEFAULT_MAX_TOKENS

__all__ = ["DIM", "DONE_THINKING", "PLAIN", "THINKING", "Reply", "is_terminal", "shows_reasoning", "stream_reply"]


@dataclass
class Reply:
    """One streamed generation, as the front end saw it."""

    text: str                 # the answer (a reasoning model's thinking is in `reasoning`)
    tokens: int               # generated tokens
    prompt_tokens: int
    seconds: float            # from the request to the last piece
    first_token_seconds: float
    interrupted: bool         # stopped by Ctrl-C
    context_full: bool        # stopped because prompt + reply filled the context
    max_tokens_hit: bool = False   # stopped at max_tokens (with room left in the context)
    timings: Any = None            # the generation's Timings (speculative decoding's counts among them)
    finish_reason: str | None = None   # "stop" (end token or stop string) or "length", as the generation said
    reasoning: str = ""                # a reasoning model's thinking, kept out of text

    @property
    def draft_note(self) -> str:
        """With speculative decoding: how many drafted tokens were accepted and the tokens each check gave."""
        t = self.timings
        if t is None or not t.drafted:
            return ""
        return (f"; drafts: {t.accepted}/{t.drafted} accepted ({100 * t.acceptance:.0f}%), "
                f"{t.tokens_per_verification:.2f} tokens per verification")

    @property
    def tokens_per_second(self) -> float:
        decode = self.seconds - self.first_token_seconds
        if self.tokens > 1 and decode > 0:
            return (self.tokens - 1) / decode
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def is_terminal(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):   # a closed or stand-in stream
        return False


DIM, PLAIN = "\x1b[2m", "\x1b[0m"
THINKING, DONE_THINKING = "Thinking...", "...done thinking."


class _Thoughts:
    """Where a reasoning model's thinking goes: dimmed on a terminal, between Ollama's 'Thinking...' and
    '...done thinking.' lines elsewhere, or nowhere (hidden)."""

    def __init__(self, out: TextIO, show: bool) -> None:
        self.out = out
        self.show = show
        self.color = is_terminal(out)
        self.open = False

    def write(self, text: str) -> None:
        if not self.show:
            return
        if not self.open:
            self.open = True
            self.out.write(f"{DIM}{THINKING}\n" if self.color else f"{THINKING}\n")
        self.out.write(text)
        self.out.flush()

    def close(self) -> None:
        if self.open:
            self.open = False
            self.out.write(f"\n{DONE_THINKING}{PLAIN}\n\n" if self.color else f"\n{DONE_THINKING}\n\n")
            self.out.flush()


def shows_reasoning(mode: str, out: TextIO) -> bool:
    """--reasoning's choice: show, hide, or auto (shown on a terminal, left out of piped output)."""
    return mode == "show" or (mode == "auto" and is_terminal(out))


def stream_reply(model: Any, prompt_ids: Sequence[int], options: dict[str, Any], out: TextIO,
                 stop: threading.Event | None = None, echo: str = "", reasoning: tuple[str, bool] | None = None,
                 show_reasoning: bool = False) -> Reply:
    """Streams the continuation of prompt_ids to out, after `echo` (written once the model has accepted the
    prompt and the options, so that a refusal is not preceded by output). Setting `stop` ends it at the next
    piece: the generator is closed, which leaves the model ready for the next call. On a terminal the text
    is rendered as Markdown, wrapped at word boundaries (terminal_markdown.py); anywhere else it is written
    as the model gave it. reasoning: a reasoning model's (format, whether the prompt leaves the reply inside
    its thinking): the thinking is split off the answer, and written before it only with show_reasoning."""
    from barellm.text.reasoning import ReasoningStream

    max_tokens = options.get("max_tokens", DEFAULT_MAX_TOKENS)
    t0 = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    thought: list[str] = []
    interrupted = False
    gen = model.stream(list(prompt_ids), **options)   # checks the prompt and the options
    splitter = ReasoningStream(reasoning[0], inside=reasoning[1]) if reasoning is not None else None
    thoughts = _Thoughts(out, show_reasoning)
    sink: Any = out
    if is_terminal(out):
        from barellm.cli.terminal_markdown import MarkdownStream

        sink = MarkdownStream(out)
    if echo:
        sink.write(echo)
        sink.flush()

    def emit(split: list[tuple[str, Any]]) -> None:
        for kind, text in split:
            if kind == "reasoning":
                thoughts.write(text)
                thought.append(text)
            elif kind == "content":
                thoughts.close()
                sink.write(text)
                sink.flush()
                parts.append(text)

    try:
        for piece in gen:
            if stop is not None and stop.is_set():
                interrupted = True
                break
            if first is None:
                first = time.perf_counter()
            emit(splitter.feed(piece) if splitter is not None else [("content", piece)])
        if splitter is not None:
            emit(splitter.finish())
    finally:
        gen.close()
        thoughts.close()
        if sink is not out:
            sink.finish()
    interrupted = interrupted or (stop is not None and stop.is_set())
    seconds = time.perf_counter() - t0
    tokens = len(gen.token_ids)
    cut = not interrupted and gen.finish_reason == "length"
    # a limit ended the reply: the context when the reply took all the room it left, else max_tokens
    context_full = cut and len(prompt_ids) + tokens >= model.n_ctx
    max_tokens_hit = cut and not context_full and max_tokens is not None and tokens >= max_tokens
    return Reply("".join(parts), tokens, len(prompt_ids), seconds, (first or time.perf_counter()) - t0, interrupted,
                 context_full, max_tokens_hit, getattr(getattr(gen, "completion", None), "timings", None),
                 gen.finish_reason, "".join(thought))
