"""Prompt lookup: drafts by copying what followed an earlier occurrence of the sequence's last tokens.

No second model: the sequence itself (its prompt and what was generated) is the source, which is what a
coding assistant re-emitting a file with changes, a summary quoting its source, or a chat repeating a name
keep doing. llama.cpp's ngram-simple (the tokens after the last earlier occurrence of the last n-gram) is
the reference behaviour; two refinements:

- a cursor: once a draft was taken from a place, the place is followed as long as the output keeps
  copying it (each generated token that is the cursor's next token moves it on), so a long copy keeps
  drafting from the right place even where its last few tokens occur elsewhere too;
- the longest match first: the last NGRAM_MAX tokens, then fewer, down to one; the match length is
  reported with the draft, and the caller keeps an acceptance per length (one-token matches are guesses).

Every token is indexed once as it arrives (n-grams of 1..NGRAM_MAX tokens -> the position after their
latest occurrence), so drafting costs a few dictionary lookups whatever the sequence's length.
"""

from __future__ import annotations

from collections.abc import Iterable

NGRAM_MAX = 4   # the longest suffix looked up
LONG_RUN = 8    # a cursor's agreement is counted this far back at most


class Lookup:
    """One sequence's tokens and their n-gram index; `propose(k)` drafts up to k tokens."""

    __slots__ = ("tokens", "index", "cursor")

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}
        self.cursor: int | None = None   # tokens[cursor] is what the copy being followed says comes next
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        toks = self.tokens
        n = len(toks)
        c = self.cursor
        if c is not None:
            self.cursor = c + 1 if toks[c] == token else None
        index = self.index
        for size in range(1, min(NGRAM_MAX, n) + 1):
            index[tuple(toks[n - size:])] = n   # that n-gram is followed by the token at n
        toks.append(token)

    def propose(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens that would continue the sequence, and the length of the match they come from
        (0: no match, no draft)."""
        toks = self.tokens
        n = len(toks)
        if k <= 0 or n == 0:
            return [], 0
        c = self.cursor
        if c is not None and c < n:
            run = 1
            while run < LONG_RUN and run < c and toks[c - 1 - run] == toks[n - 1 - run]:
                run += 1
            return toks[c:c + k], run
        index = self.index
        for size in range(min(NGRAM_MAX, n), 0, -1):
            at = index.get(tuple(toks[n - size:]))
            if at is not None:
                self.cursor = at
                return toks[at:at + k], size
        return [], 0
