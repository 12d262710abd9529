"""`make build` (and so `make run`) rebuilds the native core only when its sources changed.

The repository's Makefile runs in a copy of the tree's shape: a C source, a header and setup.py, and a
stand-in virtual environment whose python records what it is asked to do (a build_ext writes the .so as
the real one does). Nothing is compiled.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")

FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/../calls"
if [ "$2" = "-q" ] && [ "$3" = "build_ext" ]; then touch src/barellm/_native.fake.so; fi
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    native = tmp_path / "src" / "barellm" / "_native"
    native.mkdir(parents=True)
    (native / "ops.c").write_text("int x;\n")
    (native / "ops.h").write_text("#pragma once\n")
    (tmp_path / "setup.py").write_text("")
    (tmp_path / "pyproject.toml").write_text("")
    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".installed").touch()
    return tmp_path


def _build(tree: Path) -> list[str]:
    """The native builds one `make build` ran."""
    calls = tree / ".venv" / "calls"
    calls.unlink(missing_ok=True)
    r = subprocess.run(["make", "-s", "build"], cwd=tree, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [c for c in calls.read_text().splitlines() if "build_ext" in c]


def _touch_later(path: Path, than: Path) -> None:
    """path changed after the build: the stamp dated back before it (the clock is never moved forward, so
    the next build's stamp is newer again, whatever the file system's time resolution)."""
    path.touch()
    t = path.stat().st_mtime - 10
    os.utime(than, (t, t))


def test_build_rebuilds_the_native_core_only_when_its_sources_change(tree: Path) -> None:
    assert _build(tree) == ["setup.py -q build_ext --inplace --force"]   # never built
    assert _build(tree) == []                                              # nothing changed: no build
    stamp = tree / "build" / ".native-core"
    for changed in ("src/barellm/_native/ops.h", "src/barellm/_native/ops.c", "setup.py"):
        _touch_later(tree / changed, stamp)
        assert len(_build(tree)) == 1, changed
        assert _build(tree) == []
    (tree / "src" / "barellm" / "_native.fake.so").unlink()                 # the core removed: built again
    assert len(_build(tree)) == 1
