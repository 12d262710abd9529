"""What the Python API's generation methods return: a Completion (the text, ids, finish reason, counts, timings
and logprobs of every choice) and a Stream (the pieces as they come, its Completion filled meanwhile), and how
a Completion is filled from its request's events as they come (`filled`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from barellm.generate.request import Event, Request
from barellm.generate.sampling import TokenLogprob
from barellm.generate.timings import Timings


@dataclass
class Choice:
    """One of the n sequences a complete(..., n=n) call generates."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)   # every generated token (a stop string's too)
    finish_reason: str = "length"
    logprobs: list[TokenLogprob] | None = None            # one per token of the text, when asked
    reasoning: str = ""   # a reasoning model's chat: its reasoning (text/reasoning.py), kept out of text
    reasoning_tokens: int = 0   # a reasoning model's chat: how many of token_ids went to the reasoning

@dataclass
class Completion:
    """Everything about one generation; `text` is what generate() returns.

    text, token_ids, finish_reason and logprobs are those of the first choice; `choices` holds all n."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"      # "stop" (end of generation or stop string) or "length"
    prompt_tokens: int = 0
    cached_tokens: int = 0             # prompt tokens whose KV entries were reused
    prefill_seconds: float = 0.0       # prompt processing, up to the first token's logits
    decode_seconds: float = 0.0
    logprobs: list[TokenLogprob] | None = None   # with logprobs / top_logprobs: one per token of the text
    choices: list[Choice] = field(default_factory=list)
    timings: Timings | None = None     # seconds per phase of the token loop (timings.PHASES)
    reasoning: str = ""                # a reasoning model's chat: the first choice's reasoning (not in text)
    reasoning_tokens: int = 0          # a reasoning model's chat: how many of token_ids went to the reasoning

class Stream(Iterator[str]):
    """What stream() and chat_stream() return: an iterator of text pieces. The token ids generated so far
    are in `token_ids`; once the stream is exhausted, `finish_reason` says why it ended ("stop": an
    end-of-generation token or a stop string; "length": max_tokens or the full context); None before that
    and for a stream closed early. close() ends it and gives its KV cache slot back, as dropping it does.

    A reasoning model's chat_stream() yields the answer only; the reasoning so far is in `reasoning`, and
    parts() yields both as they come, each as (kind, text) with kind "reasoning" or "content"."""

    def __init__(self, pieces: Iterator[tuple[str, str]], completion: Completion) -> None:
        self._pieces = pieces
        self.completion = completion     # filled as the generation runs
        self._ended = False
        self.reasoning = ""              # the reasoning so far (a reasoning model's chat)

    def __iter__(self) -> Stream:
        return self

    def _next_part(self) -> tuple[str, str]:
        try:
            kind, text = next(self._pieces)
        except StopIteration:
            self._ended = True
            raise
        if kind == "reasoning":
            self.reasoning += text
        return kind, text

    def __next__(self) -> str:
        while True:
            kind, text = self._next_part()
            if kind == "content":
                return text

    def parts(self) -> Iterator[tuple[str, str]]:
        """The stream's pieces as (kind, text): kind "reasoning" (a reasoning model's thinking) or "content"
        (the answer). It draws on the same pieces as iterating the stream does."""
        while True:
            try:
                yield self._next_part()
            except StopIteration:
                return

    def close(self) -> None:
        close = getattr(self._pieces, "close", None)
        if close is not None:
            close()

    @property
    def token_ids(self) -> list[int]:
        return self.completion.choices[0].token_ids if self.completion.choices else []

    @property
    def prompt_tokens(self) -> int:
        return self.completion.prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        if not self._ended:
            return None
        return self.completion.choices[0].finish_reason if self.completion.choices else "length"


def filled(c: Completion, req: Request, events: Iterator[Event]) -> Iterator[Event]:
    """req's events, c filled from them as they come (counts, each choice's text, ids, logprobs and finish
    reason, the prefill and decode times); yields the deltas."""
    timings = c.timings = req.timings = req.timings if req.timings is not None else Timings()
    c.prompt_tokens = len(req.prompt)
    c.choices = [Choice(i) for i in range(req.n)]
    texts: list[list[str]] = [[] for _ in range(req.n)]
    logprobs = req.top_logprobs is not None
    for ch in c.choices:
        ch.logprobs = [] if logprobs else None
    started = time.perf_counter()
    for ev in events:
        if ev.kind == "delta":
            ch = c.choices[ev.index]
            texts[ev.index].append(ev.text)
            ch.token_ids.extend(ev.token_ids)
            if ch.logprobs is not None:
                ch.logprobs.extend(ev.tokens)
            yield ev
        elif ev.kind == "done":
            ch = c.choices[ev.index]
            ch.finish_reason = ev.finish_reason or "length"
            ch.token_ids[:] = ev.token_ids   # every generated token, a stop string's too
        elif ev.kind == "start":
            c.cached_tokens = ev.cached_tokens
    end = time.perf_counter()
    for ch in c.choices:
        ch.text = "".join(texts[ch.index])
    first = req.first_token_at if req.first_token_at is not None else end
    c.prefill_seconds = max(0.0, first - (req.admitted_at if req.admitted_at is not None else started))
    c.decode_seconds = max(0.0, end - first)
    timings.wall += c.decode_seconds
    head = c.choices[0]
    c.text, c.token_ids, c.finish_reason, c.logprobs = head.text, head.token_ids, head.finish_reason, head.logprobs
