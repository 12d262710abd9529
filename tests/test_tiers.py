"""The ISA tiers as data (tier.h): which tiers the CPU runs, the cap, the table each op resolves to, and a
real model's logits identical on every SIMD tier present (greedy text cannot differ between them)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from engine_support import load_config, open_source
from kernel_tiers import ALL, EMULATED, PRESENT, RUN, using

from barellm import _native as nat

SIMD = [t for t in RUN if t != "scalar"]  # the emulated amx kernels too: their bits are every tier's


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


@pytest.mark.skipif(not EMULATED, reason="no tile emulation on this CPU (not x86-64)")
def test_amx_emulated_lays_the_amx_kernels_over_the_best_tier_to_avx512():
    """The emulated amx kernels (tests only) fill the amx tier's matmul entries over what this CPU runs up to
    avx512; set_isa to a tier ends it, and the BARELLM_ISA names never reach it."""
    best = max((t for t in PRESENT if t != "amx"), key=ALL.index)
    with using("amx-emulated"):
        assert nat.cpu_info()["isa"] == "amx-emulated"
        sources = nat.kernel_sources()
    for t in ("q4_0", "q4_1", "q5_0", "q8_0", "q3_k", "q4_k", "q5_k", "q6_k"):
        assert sources[f"matmul {t} interleave8"] == "amx"
    others = {k: v for k, v in sources.items() if not k.endswith("interleave8")}
    assert max(others.values(), key=ALL.index) == best
    assert nat.cpu_info()["isa"] != "amx-emulated"
    env = dict(os.environ, BARELLM_ISA="amx-emulated")
    r = subprocess.run([sys.executable, "-m", "barellm", "info"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "is not a kernel tier" in r.stderr


def test_amx_min_tokens_is_set_and_checked():
    before = nat.amx_min_tokens()
    assert before >= 1
    assert nat.amx_min_tokens(7) == before and nat.amx_min_tokens() == 7
    nat.amx_min_tokens(before)
    env = dict(os.environ, BARELLM_AMX_MIN_TOKENS="0")
    r = subprocess.run([sys.executable, "-m", "barellm", "info"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "BARELLM_AMX_MIN_TOKENS='0'" in r.stderr and "Traceback" not in r.stderr
    code = "from barellm import _native as n; print(n.amx_min_tokens())"
    env["BARELLM_AMX_MIN_TOKENS"] = "48"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "48"


def test_unknown_tier_is_refused():
    with pytest.raises(ValueError, match="unknown ISA tier"):
        nat.set_isa("avx1024")


def test_env_caps_the_tier_and_a_bad_name_is_a_clear_error():
    code = "from barellm import _native as n; print(n.cpu_info()['isa'])"
    env = dict(os.environ, BARELLM_ISA="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "scalar"
    env["BARELLM_ISA"] = "avx9"
    r = subprocess.run([sys.executable, "-m", "barellm", "info"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "BARELLM_ISA='avx9' is not a kernel tier" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.model
@pytest.mark.skipif(len(SIMD) < 2, reason=f"one SIMD tier on this CPU ({', '.join(SIMD) or 'none'})")
@pytest.mark.parametrize("which", ["smollm_gguf", "gemma_gguf"])
def test_logits_identical_on_every_simd_tier(which, request):
    """Prefill (the lean tiles) and decode of a real model give the same bits on every SIMD tier (the scalar
    one differs only in exp: tests/test_engine.py's test_scalar_path)."""
    from barellm.runtime.engine import NativeEngine

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


def test_prefetch_rules_are_reported_and_set_by_env():
    """The decode tiles' prefetch rules: chosen per CPU family when the core loads, shown by cpu_info (and
    `barellm info`), replaced by BARELLM_PREFETCH; a value the core could not take is a one-line CLI error."""
    code = "from barellm import _native as n; print(n.cpu_info()['prefetch'])"
    default = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert default.startswith("kquants ") and ", blocks " in default
    env = dict(os.environ, BARELLM_PREFETCH="l2:4096,nta:16384")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == ("kquants l2:4096 nta:16384, blocks l2:4096 nta:16384, long blocks l2:4096 nta:16384, "
                           "mxfp4 l2:4096 nta:16384 (BARELLM_PREFETCH)")
    env["BARELLM_PREFETCH"] = "none"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == ("kquants none:0 none:0, blocks none:0 none:0, long blocks none:0 none:0, "
                           "mxfp4 none:0 none:0 (BARELLM_PREFETCH)")
    env["BARELLM_PREFETCH"] = ""  # set but empty: the CPU family's rules, as if unset
    out = subprocess.run([sys.executable, "-m", "barellm", "info"], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and f"decode prefetch: {default.strip()}" in out.stdout
    for bad in ("l3:4096", "l2:16", "l2:4096,nta:16384,l1:64", "l2"):
        env["BARELLM_PREFETCH"] = bad
        r = subprocess.run([sys.executable, "-m", "barellm", "info"], env=env, capture_output=True, text=True)
        assert r.returncode == 1 and f"BARELLM_PREFETCH={bad!r}" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.model
def test_prefetch_rules_change_no_bits(smollm_gguf, gemma_gguf):
    """Prefetching is speed only: decode with none, into L1 and into L2 gives the same logits, the blocks
    family (SmolLM2's Q4_1, Q8_0) and the K-quant family (Gemma's Q5_0, Q4_K, Q6_K) alike, on 1 and 2
    threads (alone and shared rules)."""
    code = """
import sys, numpy as np
from barellm.arch.config import config_from_metadata
from barellm.runtime.engine import NativeEngine
from barellm.formats.gguf import GGUFFile
src = GGUFFile(sys.argv[1])
cfg = config_from_metadata(src.metadata, src.tensors["token_embd.weight"].shape[0],
                           tied_output="output.weight" not in src.tensors)
out = []
for threads in (1, 2):
    e = NativeEngine(cfg, src, n_ctx=64, threads=threads, adaptive_threads=False)
    e.forward(list(range(100, 110)), 0)
    out += [e.forward([200 + i], 10 + i) for i in range(3)]
sys.stdout.buffer.write(np.concatenate(out).astype(np.float32).tobytes())
"""
    for path in (smollm_gguf, gemma_gguf):
        runs = []
        for rule in ("none", "l1:4096,nta:16384", "l2:8192"):
            env = dict(os.environ, BARELLM_PREFETCH=rule)
            runs.append(subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True,
                                       check=True).stdout)
        assert len(runs[0]) > 0 and runs[0] == runs[1] == runs[2]
