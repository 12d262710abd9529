"""A short run of the hostile-input campaign (bench/fuzz.py): mutated tiny model files through both engines,
each case in a process of its own. Every case must end as ok or as a clean BarellmError: no crash (signal),
no hang, no exception of another kind. The long run is `python bench/fuzz.py -n 20000` (docs/robustness.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parent.parent / "bench" / "fuzz.py"


@pytest.mark.skipif(sys.platform != "linux", reason="the campaign forks and limits address space the Linux way")
def test_two_hundred_mutated_tiny_models_end_cleanly():
    pytest.importorskip("barellm.runtime.engine", reason="native engine not built")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(FUZZ), "-n", "200", "--seed", "7", "--models", "tiny", "--json",
                           "--timeout", "30"], capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - t0
    assert proc.stdout, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    counts = result["counts"]
    assert sum(counts.values()) == 200
    assert counts["crash"] == 0 and counts["hang"] == 0 and counts["other"] == 0, result["finds"]
    assert counts["ok"] > 0 and counts["clean"] > 0  # the mutations reach both ends
    assert len(result["by_base"]) == 6  # the tiny GGUFs and their .blm conversions in both layouts
    assert proc.returncode == 0
    assert elapsed < 60, f"{elapsed:.0f} s"
