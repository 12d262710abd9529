"""The terminal's Markdown rendering (cli/terminal_markdown.py), fed a character at a time as a reply
streams: what each construct looks like, and that wrapping never splits a word."""

from __future__ import annotations

import io
import re

from barellm.cli.terminal_markdown import MarkdownStream

ANSI = re.compile(r"\x1b\[[0-9;]*m")

TEXT = """# A heading with **bold**
Text with `inline code`, **bold words**, *italic*, 2*3 and a [link](https://example.com) in a sentence long \
enough to wrap at word boundaries without splitting anything at all.

- a first item, long enough that it wraps under its own text past the edge
- second *item*
> a quote

```python
def add(a, b):  # a comment
    return a + "b" + 42
```
After the code.
"""


class Terminal(io.StringIO):
    encoding = "utf-8"

    def isatty(self) -> bool:
        return True


def render(text: str, width: int = 50, color: bool = True) -> str:
    out = Terminal()
    stream = MarkdownStream(out, width=width, color=color)
    for c in text:   # the worst case of streaming: a character per piece
        stream.write(c)
    stream.finish()
    return out.getvalue()


def test_markdown_is_styled_and_its_markers_hidden() -> None:
    shown = render(TEXT)
    lines = shown.splitlines()
    assert lines[0] == "\x1b[1;36mA\x1b[0m \x1b[1;36mheading\x1b[0m \x1b[1;36mwith\x1b[0m \x1b[1;36;1mbold\x1b[0m"
    assert "\x1b[36minline\x1b[0m \x1b[36mcode\x1b[0m," in shown and "\x1b[1mbold\x1b[0m \x1b[1mwords\x1b[0m," in shown
    assert "\x1b[3mitalic\x1b[0m, 2*3\n" in shown                           # 2*3 is no emphasis
    assert "\x1b[4;34mlink\x1b[0m (\x1b[2mhttps://example.com\x1b[0m)" in shown
    assert "\x1b[33m• \x1b[0ma first item" in shown and "\x1b[33m• \x1b[0msecond \x1b[3mitem\x1b[0m" in shown
    assert "\x1b[2m│ \x1b[0m\x1b[3ma\x1b[0m \x1b[3mquote\x1b[0m" in shown
    assert "\x1b[2m─── python\x1b[0m\n\x1b[35mdef\x1b[0m add(a, b):  \x1b[90m# a comment\x1b[0m\n" in shown
    assert '    \x1b[35mreturn\x1b[0m a + \x1b[32m"b"\x1b[0m + \x1b[33m42\x1b[0m\n' in shown
    assert shown.endswith("\x1b[2m───\x1b[0m\nAfter the code.\n")
    plain = ANSI.sub("", shown)
    assert "**" not in plain and "`" not in plain and "# A" not in plain


def test_wrapping_is_between_words_and_indents_list_items() -> None:
    for width in (30, 50, 80):
        plain = ANSI.sub("", render(TEXT, width))
        assert all(len(line) < width for line in plain.splitlines() if not line.startswith(("def", "    ret")))
        words = re.findall(r"[A-Za-z0-9']+", plain)
        source = re.findall(r"[A-Za-z0-9']+", re.sub(r"\]\(", " ", TEXT.replace("```python", "python")))
        assert words == source
    lines = ANSI.sub("", render(TEXT, 50)).splitlines()
    item = lines.index(next(line for line in lines if line.startswith("• a first item")))
    assert lines[item + 1].startswith("  ") and lines[item + 1].strip()   # under the item's text


def test_without_colour_the_text_is_kept_and_only_wrapped() -> None:
    shown = render(TEXT, 50, color=False)
    assert "\x1b" not in shown and "**bold words**" in shown and "```python\n" in shown and "- second *item*" in shown
    assert shown.split() == TEXT.split()
