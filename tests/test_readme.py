"""Every Python example in README.md runs as written, in order, in one namespace (a later block may use what
an earlier one made, as a reader following along would): on the real models the examples name.

A block that cannot run here (it needs a running server or the network) opts out with a first line
`# not run by the tests: <why>`; the reason is required, so an opt-out is always visible and explained."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
OPT_OUT = "# not run by the tests:"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The ```python blocks of a Markdown text: (line of the block's first code line, code)."""
    out = []
    for m in re.finditer(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, re.S | re.M):
        out.append((text.count("\n", 0, m.start(1)) + 1, m.group(1)))
    return out


def opted_out(code: str) -> bool:
    first = code.lstrip("\n").split("\n", 1)[0].strip()
    if not first.startswith(OPT_OUT):
        return False
    assert first[len(OPT_OUT):].strip(), f"an opt-out must say why: {first!r}"
    return True


def test_the_block_parser_and_the_opt_out_marker() -> None:
    text = "a\n```python\nx = 1\n```\n```sh\nls\n```\n```python\n# not run by the tests: needs a server\ny\n```\n"
    blocks = python_blocks(text)
    assert blocks == [(3, "x = 1\n"), (9, "# not run by the tests: needs a server\ny\n")]
    assert not opted_out(blocks[0][1]) and opted_out(blocks[1][1])
    with pytest.raises(AssertionError, match="must say why"):
        opted_out("# not run by the tests:\nz\n")


@pytest.mark.model
def test_every_python_example_in_the_readme_runs_as_written(smollm_gguf: Path, qwen05_gguf: Path) -> None:
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 3   # the Python API section's examples
    namespace: dict[str, object] = {"__name__": "readme"}
    for line, code in blocks:
        if opted_out(code):
            continue
        # compiled at its own lines of README.md, so that a failure's traceback points there
        program = compile("\n" * (line - 1) + code, str(README), "exec")
        with contextlib.redirect_stdout(io.StringIO()):
            exec(program, namespace)
