"""Byte-level BPE's pre-tokenization: GPT-2's printable byte alphabet, and the split of raw text into pieces by
the regexes a model's tokenizer.ggml.pre names (llama.cpp's table), translated from the Unicode property
classes they are written with into Python's `re` (compiled once per machine and cached).
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

# --- GPT-2 byte alphabet -------------------------------------------------------------------------------

def _bytes_to_unicode() -> list[str]:
    # Printable bytes stand for themselves; the rest are shifted above U+0100 so that every byte has a
    # visible, non-whitespace character and the vocabulary can be stored as text.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = [""] * 256
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_ENC: list[str] = _bytes_to_unicode()
_BYTE_DEC: dict[str, int] = {c: b for b, c in enumerate(_BYTE_ENC)}
# latin-1 decoding turns bytes into code points 0..255 one to one; translate then maps them to the alphabet
_LATIN1_TO_BYTE_LEVEL = {b: c for b, c in enumerate(_BYTE_ENC)}


def _to_byte_level(text: str) -> str:
    return text.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_BYTE_LEVEL)


# --- pre-tokenizer regexes -------------------------------------------------------------------------------

# llama.cpp's whitespace set. Python's \s also takes U+001C..U+001F, which would split differently.
_WS = "\\t\\n\\x0b\\x0c\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"


# Letters, numbers and punctuation occur only in planes 0-3 (planes 4-13 are unassigned, 14 holds format
# characters and marks, 15-16 private use), so the scan stops there: a quarter of the code points.
_SCAN_END = 0x40000


def _keep(path: Path, value: Any) -> None:
    """value as JSON in the model cache, for later starts to read back."""
    from barellm.files import write_bytes_atomic

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, json.dumps(value).encode("utf-8"))
    except OSError:
        pass  # a read-only cache only costs the work again next time


@functools.lru_cache(maxsize=1)
def _unicode_classes() -> dict[str, str]:
    """Character-class bodies for \\p{L}, \\p{N}, \\p{P} built from unicodedata (the stdlib re has no \\p).

    Building them takes a few tenths of a second, so they are kept in the model cache, one file per
    Unicode version, and later starts read them back.
    """
    from barellm.files import home

    cache = home() / f"unicode-classes-{unicodedata.unidata_version}.json"
    try:
        classes = json.loads(cache.read_text(encoding="utf-8"))
        if isinstance(classes, dict) and set(classes) == {"L", "N", "P"} and all(
                isinstance(v, str) for v in classes.values()):
            return classes
    except (OSError, ValueError):
        pass
    cats = "".join([unicodedata.category(chr(cp))[0] for cp in range(_SCAN_END)])

    def body(letter: str) -> str:
        parts = []
        for m in re.finditer(f"{letter}+", cats):
            lo, hi = m.start(), m.end() - 1
            parts.append(re.escape(chr(lo)) if lo == hi else f"{re.escape(chr(lo))}-{re.escape(chr(hi))}")
        return "".join(parts)

    classes = {"L": body("L"), "N": body("N"), "P": body("P")}
    _keep(cache, classes)
    return classes


def _translate_regex(pattern: str) -> str:
    """Rewrite a llama.cpp pre-tokenizer regex (\\p{L}, \\p{N}, \\p{P}, \\s, \\S) for Python's re."""
    classes = _unicode_classes()
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            m = re.match(r"\\p\{(L|N|P)\}", pattern[i:])
            if m:
                b = classes[m.group(1)]
                out.append(b if in_class else f"[{b}]")
                i += m.end()
                continue
            nxt = pattern[i + 1]
            if nxt == "s":
                out.append(_WS if in_class else f"[{_WS}]")
            elif nxt == "S" and not in_class:
                out.append(f"[^{_WS}]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            # a ']' right after '[' or '[^' is a literal, not the end of the class
            j = i + 1
            if j < len(pattern) and pattern[j] == "^":
                j += 1
            out.append(pattern[i:j])
            i = j
            if i < len(pattern) and pattern[i] == "]":
                out.append("\\]")
                i += 1
            continue
        if c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-oss, Phi-4-mini, Llama 4): its tokenizer.json splits on \p{Lu}/\p{Ll}-style letter classes; this is
# llama.cpp's form of it, which the comparator tokenizes by: "a letter that is not a-z" for the upper class, "a
# letter that is not A-Z" for the lower one, and ASCII-only cases for the contractions.
_GPT4O_RE = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
             r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
             r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
             r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (regexes applied in turn, ignore_merges). The groups are llama.cpp's; "ignore_merges"
# means a piece that is itself a vocabulary entry is taken whole without merging.
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {}
for _name in ("gpt-2", "gpt2", "phi-2", "roberta-bpe", "mpt", "olmo", "jais"):
    _PRE_TOKENIZERS[_name] = ((_GPT2_RE,), False)
for _name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"):
    # digits one by one first; the GPT-2 split then sees digit-free pieces only
    _PRE_TOKENIZERS[_name] = ((r"\p{N}", _GPT2_RE), False)
for _name in ("llama3", "llama-v3", "llama-bpe", "falcon3"):
    _PRE_TOKENIZERS[_name] = ((_LLAMA3_RE,), True)
for _name in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"):  # (the R1 distills of Qwen: its split)
    _PRE_TOKENIZERS[_name] = ((_QWEN2_RE,), False)
for _name in ("gpt-4o", "llama4"):
    _PRE_TOKENIZERS[_name] = ((_GPT4O_RE,), False)
del _name


@functools.cache
def _compiled(pattern: str) -> re.Pattern[str]:
    return _compile_cached(_translate_regex(pattern))


def _compile_cached(source: str) -> re.Pattern[str]:
    """re.compile(source), taking the compiled program from the model cache when this Python made it before.

    Compiling a pre-tokenizer regex walks every code point of its \\p{L} and \\p{N} classes in Python: 10-15 ms
    of each start. What it produces is a list of integers that the regex engine (_sre) takes as it is, so the
    list is kept, one file per pattern, keyed by the pattern and by the Python build and _sre version that made
    it; a start that finds it hands the same program to _sre.compile and gets the same pattern object
    re.compile would give. Anything unexpected (another Python's internals, an unreadable file) falls back on
    re.compile.
    """
    try:
        import _sre
        from re import _compiler, _parser  # type: ignore[attr-defined]  # (Python >= 3.11)

        from barellm.files import home
    except ImportError:
        return re.compile(source)
    import hashlib
    import sys

    key = hashlib.sha256(f"{sys.version}\0{sys.implementation.cache_tag}\0{_sre.MAGIC}\0{_sre.CODESIZE}\0{source}"
                         .encode("utf-8", "surrogatepass")).hexdigest()
    path = home() / "regex" / f"{key}.json"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        return _sre.compile(source, saved["flags"], saved["code"], saved["groups"], saved["groupindex"],
                            tuple(saved["indexgroup"]))
    except Exception:  # noqa: BLE001 - no cache, or one this Python cannot use: compile
        pass
    try:  # what re._compiler.compile does, keeping its program
        parsed = _parser.parse(source, 0)
        code = _compiler._code(parsed, 0)
        state = parsed.state
        indexgroup = [None] * state.groups
        for k, i in state.groupdict.items():
            indexgroup[i] = k
        saved = {"flags": state.flags, "code": code, "groups": state.groups - 1,
                 "groupindex": dict(state.groupdict), "indexgroup": indexgroup}
        compiled = _sre.compile(source, saved["flags"], code, saved["groups"], saved["groupindex"],
                                tuple(indexgroup))
    except Exception:  # noqa: BLE001 - internals unlike 3.11's
        return re.compile(source)
    _keep(path, saved)
    return compiled


def _make_splitter(regexes: tuple[str, ...]) -> Callable[[str], list[str]]:
    pats = [_compiled(r) for r in regexes]

    def split(text: str) -> list[str]:
        pieces = [text]
        for pat in pats:
            out: list[str] = []
            for piece in pieces:
                last = 0
                for m in pat.finditer(piece):
                    s, e = m.span()
                    if s > last:  # text no alternative matched stays a piece of its own, as in llama.cpp
                        out.append(piece[last:s])
                    if e > s:
                        out.append(piece[s:e])
                    last = e
                if last < len(piece):
                    out.append(piece[last:])
            pieces = out
        return pieces

    return split
