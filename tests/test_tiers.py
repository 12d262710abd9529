"""The ISA tiers as data (tier.h): which tiers the CPU runs, the cap, the table each op resolves to, and a
real model's logits identical on every SIMD tier present (greedy text cannot differ between them)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from engine_support import load_config, open_source
from kernel_tiers import ALL, PRESENT, using

from barellm import _native as nat

SIMD = [t for t in PRESENT if t != "scalar"]


def test_tiers_are_a_prefix_of_the_order():
    assert PRESENT[0] == "scalar"
    assert list(PRESENT) == list(ALL[: len(PRESENT)])  # each tier adds to the ones below
    assert nat.cpu_info()["isa"] in PRESENT


@pytest.mark.parametrize("cap", ALL)
def test_cap_resolves_every_entry_at_or_under_it(cap):
    with using(cap):
        got = nat.cpu_info()["isa"]
        assert got == max((t for t in PRESENT if ALL.index(t) <= ALL.index(cap)), key=ALL.index)
        sources = nat.kernel_sources()
    assert {"rmsnorm", "attend", "argmax", "read_sum", "act q8", "matmul q4_k interleave8"} <= set(sources)
    assert all(ALL.index(s) <= ALL.index(got) for s in sources.values()), sources
    if got == "scalar":
        assert set(sources.values()) == {"scalar"}


def test_unknown_tier_is_refused():
    with pytest.raises(ValueError, match="unknown ISA tier"):
        nat.set_isa("avx1024")


def test_env_caps_the_tier_and_a_bad_name_is_a_clear_error():
    code = "from barellm import _native as n; print(n.cpu_info()['isa'])"
    env = dict(os.environ, BARELLM_ISA="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "scalar"
    env["BARELLM_ISA"] = "avx9"
    r = subprocess.run([sys.executable, "-m", "barellm.cli", "info"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "BARELLM_ISA='avx9' is not a kernel tier" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.model
@pytest.mark.skipif(len(SIMD) < 2, reason=f"one SIMD tier on this CPU ({', '.join(SIMD) or 'none'})")
@pytest.mark.parametrize("which", ["smollm_gguf", "gemma_gguf"])
def test_logits_identical_on_every_simd_tier(which, request):
    """Prefill (the lean tiles) and decode of a real model give the same bits on every SIMD tier (the scalar
    one differs only in exp: tests/test_engine.py's test_scalar_path)."""
    from barellm.engine import NativeEngine

    src = open_source(request.getfixturevalue(which))
    e = NativeEngine(load_config(src), src, n_ctx=128, threads=2, chunk=32, adaptive_threads=False)
    ids = [int(i) for i in np.random.default_rng(1).integers(10, 2000, 40)]
    runs = {}
    for tier in SIMD:
        with using(tier):
            pre = e.forward(ids, 0, all_logits=True)
            dec = [e.forward([ids[i]], 40 + i) for i in range(4)]
            runs[tier] = (pre, np.concatenate(dec))
    for tier in SIMD[1:]:
        assert np.array_equal(runs[SIMD[0]][0], runs[tier][0]), tier
        assert np.array_equal(runs[SIMD[0]][1], runs[tier][1]), tier
