"""What a tokenizer needs to read its vocabulary out of a model file's metadata: typed, range-checked lookups of
the tokenizer.ggml.* keys, the costly checks of a vocabulary run once per machine (files.passed_before), and
the trie that finds special tokens' texts in raw text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from barellm.errors import FormatError


def _checked_once(what: tuple[str, list[str], list[str]], check: Callable[[], None]) -> None:
    """Runs `check` (which raises on a broken file) unless it has passed before for exactly these lists on this
    machine (files.passed_before). A start then skips checks that cost a Python loop over the whole
    vocabulary; a changed or new file is checked in full."""
    import hashlib

    from barellm.files import note_passed, passed_before

    h = hashlib.sha256(what[0].encode())
    for items in what[1:]:
        h.update(len(items).to_bytes(8, "little"))
        h.update("\0".join(items).encode("utf-8", "surrogatepass"))
    digest = h.hexdigest()
    if passed_before(digest):
        return
    check()
    note_passed(digest)

def _present(md: Mapping[str, Any], full: str, required: bool) -> bool:
    if full in md:
        return True
    if required:
        raise FormatError(f"{full}: missing from the model metadata")
    return False

def _key(md: Mapping[str, Any], name: str, kind: type | tuple[type, ...], required: bool = False) -> Any:
    full = f"tokenizer.ggml.{name}"
    if not _present(md, full, required):
        return None
    v = md[full]
    # bool is an int to Python; an id or a count given as true/false is a broken file, not a 0 or 1
    if isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise FormatError(f"{full}: expected {_kind_name(kind)}, got a bool")
    if not isinstance(v, kind):
        raise FormatError(f"{full}: expected {_kind_name(kind)}, got {type(v).__name__}")
    return v

def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)

def _array(md: Mapping[str, Any], name: str, item: type | tuple[type, ...], n: int | None,
           required: bool = False) -> list[Any] | None:
    full = f"tokenizer.ggml.{name}"
    if not _present(md, full, required):
        return None
    v = md[full]
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        v = v.tolist()  # a reader may hand numeric arrays over as NumPy arrays
    if not isinstance(v, (list, tuple)):
        raise FormatError(f"{full}: expected an array, got {type(v).__name__}")
    if n is not None and len(v) != n:
        raise FormatError(f"{full}: {len(v)} entries for {n} tokens")
    items = item if isinstance(item, tuple) else (item,)
    if not set(map(type, v)) <= set(items):  # (exact types: the common case, checked without a Python loop)
        for i, x in enumerate(v):
            if not isinstance(x, items) or (isinstance(x, bool) and bool not in items):
                raise FormatError(f"{full}[{i}]: expected {_kind_name(item)}, got {type(x).__name__}")
    return v if isinstance(v, list) else list(v)  # shared, not copied: the tokenizer never changes it

class _Trie:
    """Special-token texts by character, to find which of them occur in a text."""

    __slots__ = ("root", "depth", "_first", "_run")

    def __init__(self) -> None:
        self.root: dict[str, Any] = {}
        self.depth = 0
        self._first: re.Pattern[str] | None = None
        self._run = re.compile(r"(.)\1*", re.DOTALL)

    def add(self, text: str, value: int) -> None:
        node = self.root
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = value  # "" can never be a character, so it marks the end of a token
        self.depth = max(self.depth, len(text))

    def finish(self) -> None:
        if self.root:
            self._first = re.compile("[" + "".join(re.escape(c) for c in sorted(self.root)) + "]")

    def __bool__(self) -> bool:
        return bool(self.root)

    def _walk(self, text: str, p: int, found: set[int]) -> None:
        node = self.root.get(text[p])
        i, n = p + 1, len(text)
        while node is not None:
            v = node.get("")
            if v is not None:
                found.add(v)
            if i >= n:
                break
            node = node.get(text[i])
            i += 1

    def present(self, text: str) -> set[int]:
        """The values of all stored texts that occur in text."""
        found: set[int] = set()
        if self._first is None:
            return found
        search, run, k = self._first.search, self._run.match, self.depth
        p = 0
        while (m := search(text, p)) is not None:
            p = m.start()
            end = run(text, p).end()
            # Inside a run of one character every start sees the same walk until the run's end comes
            # within reach, so a long run (Gemma's whitespace tokens) costs one walk plus the last k.
            if end - p > k + 1:
                self._walk(text, p, found)
                p = end - k
            while p < end:
                self._walk(text, p, found)
                p += 1
        return found
