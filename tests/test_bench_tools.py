"""The C measuring tool under bench/ (the machine's bandwidth and FMA peak) keeps building warning-free and
prints its figures."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "src" / "barellm" / "_native"
CC = shutil.which("cc") or shutil.which("gcc")

pytestmark = pytest.mark.skipif(CC is None, reason="needs a C compiler (the native core is built with one)")


def build(src: str, out: Path, *flags: str) -> Path:
    cmd = [CC, "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-pthread", *flags, str(ROOT / src), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out


def test_roofline_builds_and_reads(tmp_path):
    exe = build("bench/roofline.c", tmp_path / "roofline", "-mavx2", "-mfma")
    out = subprocess.run([exe, "64", "1"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert re.search(r"buffer 64 MB, \d+ MB of it in 2 MB pages", out)
    row = out.strip().splitlines()[-1].split()
    # threads, best, median, 2 streams best, 3 streams best, FMA GFLOP/s
    assert row[0] == "1" and len(row) == 6 and all(float(v) > 0 for v in row[1:])
    assert float(row[1]) >= float(row[2])
