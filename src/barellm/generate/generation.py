"""One generation from its prompt to its end: the state machine the Scheduler drives for every front end.

A Generation never calls the engine. Its driver (generate/scheduler.py) feeds the prompt into a KV cache
slot, hands the logits that follow the last fed token to `step`, feeds back `next_token` at `position`, and
repeats until `done`.
Everything else is decided here:

- the next token (the sampler, its history for the penalties, an optional allowed-token mask, or a
  structured.Guide whose parser gives the mask of each step: JSON schemas, regexes, grammars);
- the end: an end-of-generation token ("stop"), a stop string ("stop"; the text before it is kept, and
  tokens that begin inside it are not reported), max_tokens or the context ("length"); max_tokens None
  (DEFAULT_MAX_TOKENS, what every front end means when none is given) sets no limit of its own: the
  generation runs until it ends or fills the context;
- the text: the stream decoder turns ids into whole characters; text that could be the start of a stop
  string is held back until it cannot be, and flushed at the end;
- the tokens and their log-probabilities, reported with the text they begin in.

Every step's work is bounded by the stop strings' lengths, never by the text so far: the stop search
looks only at the held-back tail plus the new piece (before it, the tail held no whole stop string).

A generation's seconds by phase go to its `Timings` (timings.py); which KV cache slot it runs in is the
scheduler's choice (slots.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from barellm.generate.sampling import Sampler, SamplingParams, TokenLogprob, token_logprobs
from barellm.generate.timings import Timings

__all__ = ["DEFAULT_MAX_TOKENS", "Delta", "Generation", "TokenLogprob"]

# the finish reason of a generation whose output constraint reached a state no token can continue (not a
# completed output): its text is not a sentence of the grammar, and the reply must not pass for a success
CONSTRAINT_FAILED = "constraint_failed"

# max_tokens when none is given, for the Python API, the command line, the chat and the server's chat routes:
# no limit but the context. OpenAI's legacy completions (16 tokens) are the one exception (serve/relay.py).
DEFAULT_MAX_TOKENS: int | None = None

Allowed = np.ndarray | Callable[[Sequence[int]], "np.ndarray | None"] | None


@dataclass
class Delta:
    """What one step makes visible: text (may be ""), the tokens that begin in it and their logprobs (when
    asked), and the finish reason once the generation has ended."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def merge(self, d: Delta) -> Delta:
        """d's text, tokens and logprobs after this one's (text gathered until it is sent); returns self."""
        self.text += d.text
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs)
        return self


class Generation:
    """One sequence's state from prompt to finish (see the module docstring)."""

    def __init__(self, prompt: Sequence[int], tokenizer: Any, *, params: SamplingParams, max_tokens: int | None,
                 n_ctx: int,
                 stops: Sequence[str] = (), top_logprobs: int | None = None, allowed: Allowed = None,
                 eog: set[int] | frozenset[int] | None = None, n_vocab: int | None = None,
                 timings: Timings | None = None, guide: Any = None, min_indent: int = 0) -> None:
        self.prompt = list(prompt)
        # None: no limit of its own; the context still ends it
        self.max_tokens = max(0, n_ctx - len(self.prompt)) if max_tokens is None else max_tokens
        self.n_ctx = n_ctx
        self.top_logprobs = top_logprobs
        self.allowed = allowed
        self.guide = guide                    # a structured.Guide: the grammar's mask at every step
        self.eog = frozenset(tokenizer.eog_ids if eog is None else eog)
        self.timings = timings if timings is not None else Timings()
        self.sampler = Sampler(params, self.prompt, n_vocab)
        self.decoder = tokenizer.stream_decoder()
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.next_token: int | None = None   # sampled, waiting to be fed
        self.stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self.stops), default=0)
        self._first_chars = frozenset(s[0] for s in self.stops)
        self.min_indent = max(0, int(min_indent))   # a later line indented less ends the text (before it)
        self.stop_word: str | None = None     # the stop string that ended the generation, if one did
        self.dedented = False                 # a line indented less than min_indent ended it
        self._held = ""                       # decoded, not yet released (could begin a stop string)
        self._released = 0                    # characters released so far
        self._pending: deque[tuple[int, int, TokenLogprob | None]] = deque()  # (text offset, id, logprob)
        if self.max_tokens <= 0:
            self.finish_reason = "length"

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def position(self) -> int:
        """Where next_token goes in the sequence (its KV cache position)."""
        return len(self.prompt) + len(self.generated) - 1

    def step(self, row: np.ndarray) -> Delta | None:
        """Takes the logits that follow the last fed token, picks the next one and returns what became
        visible (None when nothing did). After it, either `done` or `next_token` waits to be fed."""
        clock = time.perf_counter
        tm = self.timings.seconds
        t0 = clock()
        guide = self.guide
        if guide is not None:
            allowed = guide.mask()
            ends = guide.exits(row)   # a grammar that leaves the end to the model (tool calls)
            t1 = clock()
            tm["grammar"] += t1 - t0
            t0 = t1
            if ends:
                return self._finish("stop")
        else:
            allowed = self.allowed(self.generated) if callable(self.allowed) else self.allowed
        tok = self.sampler.sample(row, allowed=allowed)
        t1 = clock()
        tm["sample"] += t1 - t0
        self.next_token = None
        if tok in self.eog:
            # a constraint that reached a dead end (its parser failed, or it stopped short of a complete
            # output, as a rule's max_tokens does) allows only the end tokens: the reply says it failed
            failed = guide is not None and (guide.error is not None or not guide.accepting)
            return self._finish(CONSTRAINT_FAILED if failed else "stop")
        if guide is not None:   # the next mask is computed from here on, beside the next forward pass
            guide.accept(tok)
            t2 = clock()
            tm["grammar"] += t2 - t1
            t1 = t2
        lp = None
        if self.top_logprobs is not None:
            lp = token_logprobs(row, tok, self.top_logprobs)
            t2 = clock()
            tm["logprobs"] += t2 - t1
            t1 = t2
        self.generated.append(tok)
        self.sampler.accept(tok)
        self.timings.tokens += 1
        self._pending.append((self._released + len(self._held), tok, lp))
        piece = self.decoder.feed(tok)
        t2 = clock()
        tm["detokenize"] += t2 - t1
        if piece:
            d = self._hold(piece)
            if d is not None:
                tm["stop"] += clock() - t2
                return d
        if len(self.generated) >= self.max_tokens or len(self.prompt) + len(self.generated) >= self.n_ctx:
            d = self._finish("length")
            tm["stop"] += clock() - t2
            return d
        self.next_token = tok
        hold = self._holdback() if self.stops else 0
        if self.min_indent:
            hold = max(hold, self._line_holdback())
        d = self._release(len(self._held) - hold)
        tm["stop"] += clock() - t2
        return d if d.text or d.token_ids else None

    def _hold(self, text: str) -> Delta | None:
        """Adds newly decoded text to what is held back; if a stop string (or, past min_indent, a dedent) now
        ends the generation, releases the text before it and returns that last delta."""
        self._held += text
        cut = self._stop_in(len(text)) if self.stops else -1
        if self.min_indent:
            dedent = self._dedent()
            if dedent >= 0 and (cut < 0 or dedent < cut):
                cut = dedent
                self.stop_word, self.dedented = None, True
        if cut < 0:
            return None
        d = self._release(cut, all_tokens=False)
        self._pending.clear()
        self._held = ""
        self.finish_reason = d.finish_reason = "stop"
        return d

    def finish(self, reason: str) -> Delta:
        """Ends the generation now (a time limit): flushes what is held back."""
        return self._finish(reason)

    def _finish(self, reason: str) -> Delta:
        self.next_token = None
        tail = self.decoder.flush()
        if tail:
            d = self._hold(tail)
            if d is not None:
                return d
        d = self._release(len(self._held), all_tokens=True)
        self.finish_reason = d.finish_reason = reason
        return d

    def _stop_in(self, new: int) -> int:
        """Where the first stop string begins in the held text, or -1. A stop string found now ends in the
        `new` last characters (the held text before them had none), so only that window is searched."""
        held = self._held
        lo = max(0, len(held) - new - self._longest + 1)
        hits = [(p, s) for s in self.stops if (p := held.find(s, lo)) >= 0]
        if not hits:
            return -1
        p, self.stop_word = min(hits)
        return p

    def _dedent(self) -> int:
        """Where the first line of the held text indented less than min_indent begins (its newline is cut
        too), or -1. The first line of the generation continues the prompt's and is never cut; a line of
        whitespace only is no line yet (its indentation is unknown until it holds something)."""
        held = self._held
        p = held.find("\n")
        while p >= 0:
            end = held.find("\n", p + 1)
            line = held[p + 1:] if end < 0 else held[p + 1:end]
            body = line.lstrip(" \t")
            if body and body != "\r" and len(line) - len(body) < self.min_indent:
                return p
            p = end
        return -1

    def _line_holdback(self) -> int:
        """The held tail from the last newline on, while the line after it holds only whitespace: whether it
        will be cut (a dedent) is not known yet."""
        held = self._held
        p = held.rfind("\n")
        if p >= 0 and not held[p + 1:].strip(" \t\r"):
            return len(held) - p
        return 0

    def _holdback(self) -> int:
        """Length of the longest end of the held text that could still grow into a stop string."""
        held = self._held
        for j in range(max(0, len(held) - self._longest + 1), len(held)):
            if held[j] in self._first_chars:
                tail = held[j:]
                if any(s.startswith(tail) for s in self.stops):
                    return len(held) - j
        return 0

    def _release(self, upto: int, all_tokens: bool = False) -> Delta:
        """Releases held[:upto] with the tokens that begin in the released text (or every pending token)."""
        text, self._held = self._held[:upto], self._held[upto:]
        self._released += upto
        d = Delta(text)
        pending = self._pending
        while pending and (all_tokens or pending[0][0] < self._released):
            _, tok, lp = pending.popleft()
            d.token_ids.append(tok)
            if lp is not None:
                d.logprobs.append(lp)
        return d
