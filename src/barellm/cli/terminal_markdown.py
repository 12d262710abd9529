"""A reply streamed to a terminal as rendered Markdown: wrapped at word boundaries, with colour (ANSI codes).

Models answer in Markdown; printed raw, a reply wraps mid-word at the terminal's edge and shows its `**`,
backticks and fences. `MarkdownStream` takes the reply piece by piece as it is generated and writes:

- words whole: a word that would cross the right edge starts the next line (a list item's continuation
  lines are indented under its text); a word is held back only until it is complete;
- headings bold and coloured (without their #), list markers as bullets, quotes behind a bar;
- **bold**, *italic*, `inline code` and links styled, their markers hidden;
- fenced code blocks line by line, with simple highlighting (keywords, strings, numbers, comments), never
  wrapped, so that code copied from the terminal is the code; the fence lines become a dim label.

Only for a terminal: piped or redirected output gets the model's text byte for byte (chat_repl decides).
NO_COLOR (https://no-color.org) keeps the text and its markers as they are, wrapping only.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import TextIO

RESET = "\x1b[0m"
BOLD, DIM, ITALIC, UNDERLINE = "1", "2", "3", "4"
HEADING = "1;36"
INLINE_CODE = "36"
LINK = "4;34"
BULLET = "33"
KEYWORD, STRING, NUMBER, COMMENT = "35", "32", "33", "90"

# a line's start that may still become a block marker (heading, list item, quote, fence)
_MARKER_PREFIX = re.compile(r"[ \t]*(#{0,6}|[-*+]|\d{1,3}[.)]?|>|`{1,3}|~{1,3})")
_MARKER = re.compile(r"([ \t]*)(#{1,6} |[-*+] |\d{1,3}[.)] |> )")
_FENCE = re.compile(r"[ \t]*(```|~~~)\s*([\w+#.-]*)")
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")

_KEYWORDS = frozenset("""
    and as assert async await break case catch class const continue def default defer del do elif else enum
    except export extends false False final finally fn for from func function go if impl import in interface
    is lambda let loop match mod mut new nil None nonlocal not null or package pass pub raise return self
    static struct super switch this throw true True try type typeof use var void while with yield
""".split())
_HASH_COMMENTS = frozenset({"python", "py", "sh", "bash", "shell", "zsh", "console", "ruby", "rb", "yaml", "yml",
                            "toml", "r", "perl", "dockerfile", "makefile", "make", "ini", "conf", "powershell"})
_CODE_TOKEN = re.compile(r"""(?P<string>"(?:[^"\\]|\\.)*"?|'(?:[^'\\]|\\.)*'?)|(?P<number>\b\d[\d_]*(?:\.\d+)?\b)"""
                         r"""|(?P<word>[A-Za-z_]\w*)""")


def color_allowed() -> bool:
    return "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


def _sgr(code: str, text: str) -> str:
    return f"\x1b[{code}m{text}{RESET}" if code and text else text


def highlight_code(line: str, language: str) -> str:
    """One line of code with its keywords, strings, numbers and comment coloured."""
    comment_at = _comment_start(line, language)
    code, comment = (line, "") if comment_at is None else (line[:comment_at], line[comment_at:])
    out: list[str] = []
    pos = 0
    for m in _CODE_TOKEN.finditer(code):
        out.append(code[pos:m.start()])
        kind = m.lastgroup
        text = m.group()
        if kind == "string":
            out.append(_sgr(STRING, text))
        elif kind == "number":
            out.append(_sgr(NUMBER, text))
        else:
            out.append(_sgr(KEYWORD, text) if text in _KEYWORDS else text)
        pos = m.end()
    out.append(code[pos:])
    return "".join(out) + _sgr(COMMENT, comment)


def _comment_start(line: str, language: str) -> int | None:
    """Where a line comment starts outside strings: # for shell-like languages, // for C-like ones (both
    when the language is not named)."""
    marks = ("#",) if language in _HASH_COMMENTS else ("//",) if language else ("#", "//")
    quote = ""
    i = 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif any(line.startswith(mark, i) for mark in marks):
            return i
        i += 1
    return None


class MarkdownStream:
    """Writes Markdown, given in pieces, to a terminal of `width` columns (the terminal's by default).
    write() as the pieces come, finish() at the end (it writes what a last, unfinished word held back)."""

    def __init__(self, out: TextIO, width: int | None = None, color: bool | None = None) -> None:
        self.out = out
        # one column short of the edge: a line that fills the last column makes some terminals wrap early
        self.width = max(20, (width or shutil.get_terminal_size((80, 24)).columns) - 1)
        self.color = color_allowed() if color is None else color
        encoding = (getattr(out, "encoding", None) or "").lower().replace("-", "")
        self.unicode = encoding.startswith("utf")
        self._buf: list[str] = []
        self.head: str | None = ""   # the start of the line while it may still be a block marker
        self.in_code = False
        self.language = ""
        self.code_line = ""
        self.col = 0
        self.indent = 0               # where a wrapped line of the current block starts
        self.line_style = ""          # the SGR code of the whole line (a heading, a quote)
        self.word = ""
        self.space = False            # a space is owed before the next word
        self.bold = self.italic = self.code = False

    # --- in ----------------------------------------------------------------------------------------

    def write(self, text: str) -> None:
        for c in text:
            self._feed(c)
        self.flush()

    def flush(self) -> None:
        if self._buf:
            self.out.write("".join(self._buf))
            self._buf.clear()
        self.out.flush()

    def finish(self) -> None:
        """Writes what is held back (an unfinished word or line) and ends any open style."""
        if self.in_code:
            if self.code_line:
                self._emit(self._code(self.code_line))
                self.code_line = ""
        elif self.head:
            self._start_line(self.head)
        self.head = None
        self._flush_word()
        self.flush()

    # --- the line's start --------------------------------------------------------------------------

    def _feed(self, c: str) -> None:
        if self.in_code:
            if c == "\n":
                self._code_line_done()
            else:
                self.code_line += c
            return
        if self.head is not None:
            if c == "\n":
                head, self.head = self.head, None
                if _FENCE.fullmatch(head):
                    self._fence(head)
                    self.head = ""
                    return
                self._start_line(head)
                self._newline()
                return
            self.head += c
            if _MARKER_PREFIX.fullmatch(self.head) or (self.head.lstrip().startswith(("```", "~~~"))):
                return
            head, self.head = self.head, None
            self._start_line(head)
            return
        if c == "\n":
            self._newline()
        elif c in " \t":
            self._flush_word()
            self.space = self.col > self.indent
        else:
            self.word += c

    def _start_line(self, head: str) -> None:
        """The line's start, now that it is known to be a marker or text: its marker rendered, the rest fed."""
        m = _MARKER.match(head)
        rest = head
        if m and self.color:
            lead, marker = m.group(1), m.group(2)
            rest = head[m.end():]
            if marker.startswith("#"):
                self.line_style = HEADING
            elif marker == "> ":
                bar = "│ " if self.unicode else "| "
                self._emit(lead + _sgr(DIM, bar))
                self.line_style = ITALIC
                self.col = self.indent = len(lead) + 2
            else:
                bullet = ("• " if self.unicode else "- ") if marker[0] in "-*+" else marker
                self._emit(lead + _sgr(BULLET, bullet))
                self.col = self.indent = len(lead) + len(bullet)
        elif m and not m.group(2).startswith("#"):   # no colour: the marker as it is, the item's text under it
            rest = head[m.end():]
            self._emit(m.group(0))
            self.col = self.indent = len(m.group(0))
        for c in rest:
            self._feed(c)

    def _newline(self) -> None:
        self._flush_word()
        self._emit("\n")
        self.col = self.indent = 0
        self.space = False
        self.line_style = ""
        # a style left open (a lone ** or backtick) ends with its line rather than colouring the rest
        self.bold = self.italic = self.code = False
        self.head = ""

    # --- code blocks -------------------------------------------------------------------------------

    def _fence(self, line: str) -> None:
        m = _FENCE.match(line)
        assert m is not None
        if not self.in_code:
            self.in_code = True
            self.language = m.group(2).lower()
            label = line if not self.color else _sgr(DIM, ("─── " if self.unicode else "--- ") +
                                                        (m.group(2) or "code"))
            self._emit(label + "\n")
        else:
            self.in_code = False
            self.language = ""
            self._emit((line if not self.color else _sgr(DIM, "───" if self.unicode else "---")) + "\n")
        self.col = self.indent = 0

    def _code_line_done(self) -> None:
        line, self.code_line = self.code_line, ""
        if _FENCE.fullmatch(line) and not _FENCE.fullmatch(line).group(2):   # type: ignore[union-attr]
            self._fence(line)
            return
        self._emit(self._code(line) + "\n")

    def _code(self, line: str) -> str:
        return highlight_code(line, self.language) if self.color else line

    # --- words -------------------------------------------------------------------------------------

    def _flush_word(self) -> None:
        if not self.word:
            return
        word, self.word = self.word, ""
        styled, visible = self._styled(word) if self.color else (word, len(word))
        if self.col > self.indent and self.col + int(self.space) + visible > self.width:
            self._emit("\n" + " " * self.indent)
            self.col = self.indent
        elif self.space:
            self._emit(" ")
            self.col += 1
        self.space = False
        self._emit(styled)
        self.col += visible

    def _styled(self, word: str) -> tuple[str, int]:
        """The word with its inline markers turned into styles (which may run on into the next words), and
        its width on screen."""
        word = _LINK.sub(lambda m: f"\x00{m.group(1)}\x01{m.group(2)}\x02", word)
        runs: list[tuple[str, str]] = []
        link = url = False
        i = 0
        while i < len(word):
            c = word[i]
            if c == "`":
                self.code = not self.code
                i += 1
                continue
            if not self.code:
                if word.startswith("**", i):
                    self.bold = not self.bold
                    i += 2
                    continue
                if c == "*":
                    before = word[i - 1] if i else " "
                    after = word[i + 1] if i + 1 < len(word) else " "
                    # *opens* before a word's first letter and closes after its last (2*3 stays as it is)
                    if (after.isalnum() and not before.isalnum()) if not self.italic else \
                            (before.isalnum() and not after.isalnum()):
                        self.italic = not self.italic
                        i += 1
                        continue
                if c in "\x00\x01\x02":
                    link, url = c == "\x00", c == "\x01"
                    if c == "\x01":
                        runs.append(("", " ("))
                    elif c == "\x02":
                        runs.append(("", ")"))
                    i += 1
                    continue
            runs.append((self._style(link, url, word), c))
            i += 1
        out: list[str] = []
        for code, text in _merge(runs):
            out.append(_sgr(code, text))
        return "".join(out), sum(len(t) for _, t in runs)

    def _style(self, link: bool, url: bool, word: str) -> str:
        codes = [self.line_style] if self.line_style else []
        if self.bold:
            codes.append(BOLD)
        if self.italic:
            codes.append(ITALIC)
        if self.code:
            codes.append(INLINE_CODE)
        if link or (not self.code and word.startswith(("http://", "https://"))):
            codes.append(LINK)
        if url:
            codes.append(DIM)
        return ";".join(codes)

    def _emit(self, text: str) -> None:
        self._buf.append(text)


def _merge(runs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Neighbouring characters of one style as one run (one escape sequence for a styled word)."""
    merged: list[tuple[str, str]] = []
    for code, text in runs:
        if merged and merged[-1][0] == code:
            merged[-1] = (code, merged[-1][1] + text)
        else:
            merged.append((code, text))
    return merged
