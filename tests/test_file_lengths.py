"""No file in src/ passes 600 lines unless docs/architecture.md names it under "Files over 600 lines", with its
reason: a file that grows past the bound is split by concept, or its exception is argued in the docs. A file
the section names must still exist and still be over the bound, so that the list never holds stale entries."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PACKAGE = SRC / "barellm"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
LIMIT = 600
SECTION = "## Files over 600 lines"
BUILT = {".so", ".pyd", ".dylib", ".o", ".a", ".pyc"}   # build outputs beside the sources, not sources


def source_files() -> list[Path]:
    """The text files under src/ (build outputs, caches and binary files left out)."""
    out = []
    for p in sorted(SRC.rglob("*")):
        if not p.is_file() or p.suffix in BUILT or "__pycache__" in p.parts or ".egg-info" in str(p):
            continue
        if b"\0" in p.read_bytes()[:8192]:
            continue
        out.append(p)
    return out


def lines(path: Path) -> int:
    """Lines as `wc -l` counts them, a last line without its newline included."""
    data = path.read_bytes()
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def named_exceptions(text: str) -> set[Path]:
    """The files the "Files over 600 lines" section names: each entry's first `path` (relative to
    src/barellm, or to the repository with src/ in front)."""
    start = text.index(SECTION) + len(SECTION)
    end = re.search(r"^#", text[start:], re.M)
    section = text[start: start + end.start()] if end else text[start:]
    out = set()
    for entry in re.finditer(r"^- `([^`]+)`", section, re.M):
        name = entry.group(1)
        out.add((ROOT / name) if name.startswith("src/") else (PACKAGE / name))
    return out


def test_the_section_names_files() -> None:
    text = ARCHITECTURE.read_text()
    assert SECTION in text, f"docs/architecture.md has no {SECTION!r} section"
    named = named_exceptions(text)
    assert named, f"the {SECTION!r} section names no file as `path`"


def test_no_file_in_src_passes_600_lines_unless_the_docs_name_it() -> None:
    named = named_exceptions(ARCHITECTURE.read_text())
    over = {p: n for p in source_files() if (n := lines(p)) > LIMIT}
    unnamed = sorted(f"{p.relative_to(ROOT)} ({n} lines)" for p, n in over.items() if p not in named)
    assert not unnamed, (f"over {LIMIT} lines, and not named under {SECTION!r} in docs/architecture.md: "
                         + ", ".join(unnamed) + ". Split it by concept, or name it there with the reason.")


def test_every_named_exception_is_still_over_600_lines() -> None:
    for p in sorted(named_exceptions(ARCHITECTURE.read_text())):
        assert p.is_file(), f"docs/architecture.md names {p.relative_to(ROOT)} under {SECTION!r}; it does not exist"
        assert lines(p) > LIMIT, (f"{p.relative_to(ROOT)} has {lines(p)} lines, within the bound: take it off the "
                                  f"list under {SECTION!r} in docs/architecture.md")


def test_the_check_counts_as_wc_and_finds_a_named_file(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    f.write_text("a\nb\nc")
    assert lines(f) == 3
    f.write_text("a\nb\n")
    assert lines(f) == 2
    doc = (f"# t\n\n{SECTION}\n\nwhy:\n\n- `formats/quant.py` (810): one table\n- `src/barellm/x.py`: y\n\n"
           "### next\n- `no.py`\n")
    assert named_exceptions(doc) == {PACKAGE / "formats" / "quant.py", SRC / "barellm" / "x.py"}
