"""Soft-capped attention scores (Gemma 2: s -> cap tanh(s / cap)) and attention sinks (gpt-oss: exp(sink) in a
query's softmax denominator only) in every tier's attention kernel, sliding windows with them.

- Against NumPy: the float64 attention over what the cache holds, rtol/atol 2e-5 as test_ops' attention (the
  SIMD tiers' tanh is a polynomial within 1.5 ulp of tanh, their exp within 2 ulp; scores of a few units).
- Bits: every SIMD tier (avx512 and the amx tiers, which take avx512's attention) gives avx2's bits for every
  query whatever its block; a query's bits do not depend on the other queries of its block.
- The engine: gpt-oss (sinks, a window of 32 on every other layer) and Gemma 2 (capped scores, the same
  windows) take the tier's own attention kernel, give the same logits on every SIMD tier, for one thread or
  two and any chunking, and the same greedy tokens on every tier, scalar included.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_tiers import PRESENT, RUN, using
from test_ops import KV_CODE, KV_TYPES, _cache, row_bytes, skip_unless_holds

from barellm import _native as nat
from barellm.arch.config import config_of
from barellm.formats.gguf import GGUFFile
from barellm.runtime.engine import NativeEngine

from conftest import DATA

SIMD = [t for t in RUN if t != "scalar"]
# (cap, sinks): Gemma 2's cap of 50 (scores far below it), caps the scores reach, sinks with and without a cap
CAPS = [(50.0, False), (2.0, False), (0.0, True), (3.0, True)]


def _sinks(nq: int, rng: np.random.Generator) -> np.ndarray:
    """One sink per query: a spread of logits, one far above the scores (the sink takes most of the mass),
    one -inf (none)."""
    s = (rng.standard_normal(nq) * 2).astype(np.float32)
    s[0] = -np.inf
    if nq > 2:
        s[2] = 12.0
    return s


def attention_reference(q, K, V, pos, window, scale, cap, sinks):
    out = []
    for i, p in enumerate(pos):
        lo = max(0, p - window + 1) if window else 0
        s = K[lo:p + 1].astype(np.float64) @ q[i].astype(np.float64) * scale
        if cap:
            s = cap * np.tanh(s / cap)
        e = np.exp(s - s.max())
        denom = e.sum() + (np.exp(float(sinks[i]) - s.max()) if sinks is not None else 0.0)
        out.append((e / denom) @ V[lo:p + 1].astype(np.float64))
    return np.array(out)


@pytest.mark.parametrize("kv", KV_TYPES)
@pytest.mark.parametrize("cap,with_sinks", CAPS)
@pytest.mark.parametrize("hd,window", [(64, 0), (64, 128), (128, 70), (96, 0), (40, 0), (6, 0), (16, 130), (32, 1)])
def test_capped_attention_with_sinks_vs_numpy(isa, hd, window, cap, with_sinks, kv):
    skip_unless_holds(kv, hd)
    rng = np.random.default_rng(hd + window + int(cap))
    n_kv, n_ctx, S, head = 2, 320, 300, 1
    kc, vc, K, V = _cache(n_kv, n_ctx, hd, S, rng, kv)
    per = n_ctx * row_bytes(hd, kv) // kc.itemsize
    kh, vh = kc[head * per:(head + 1) * per], vc[head * per:(head + 1) * per]
    pos = np.array([0, 1, 62, 63, 64, 65, 127, 128, 129, 200, 255, 299], np.int32)
    nq = len(pos)
    q = (rng.standard_normal((nq, hd)) * 3).astype(np.float32)
    sinks = _sinks(nq, rng) if with_sinks else None
    scale = float(np.float32(1 / np.sqrt(hd)))

    def attend(q, pos, sink):
        out = np.empty((len(pos), hd), np.float32)
        args = () if sink is None else (sink,)
        nat.attend(q, pos, kh, vh, out, len(pos), hd, n_ctx, scale, KV_CODE[kv], window, cap, *args)
        return out

    out = attend(q, pos, sinks)
    want = attention_reference(q, K[:, head], V[:, head], pos, window, scale, cap, sinks)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    # a query's bits do not depend on the other queries of its block (nor on their sinks)
    for i in (0, 2, 5, nq - 1):
        one = attend(q[i:i + 1].copy(), pos[i:i + 1].copy(), None if sinks is None else sinks[i:i + 1].copy())
        assert np.array_equal(one[0], out[i])
    # one sink given for every query is that sink in each
    if with_sinks:
        assert np.array_equal(attend(q, pos, 1.5), attend(q, pos, np.full(nq, 1.5, np.float32)))
    # no sink (-inf) and no cap (0) are the plain kernel
    if not cap:
        plain = np.empty((nq, hd), np.float32)
        nat.attend(q, pos, kh, vh, plain, nq, hd, n_ctx, scale, KV_CODE[kv], window)
        assert np.array_equal(attend(q, pos, np.full(nq, -np.inf, np.float32)), plain)


@pytest.mark.parametrize("kv", KV_TYPES)
@pytest.mark.parametrize("cap", [0.0, 50.0, 3.0])
@pytest.mark.parametrize("hd,window", [(64, 0), (64, 128), (128, 70), (80, 0), (16, 1), (96, 130), (32, 0)])
def test_capped_attention_bits_equal_on_every_simd_tier(hd, kv, window, cap):
    """Every SIMD tier, the amx tiers (which take avx512's attention) included, gives avx2's bits for every query
    with capped scores and sinks of its own, whatever its block: 1..16 queries, some sharing a key range, some
    not, positions on and around tile boundaries, GQA groups (several heads at one position)."""
    skip_unless_holds(kv, hd)
    if "avx2" not in PRESENT:
        pytest.skip("this CPU lacks the avx2 tier")
    rng = np.random.default_rng(5 * hd + window + int(cap))
    n_ctx = 448
    kc, vc, _, _ = _cache(1, n_ctx, hd, n_ctx, rng, kv)
    edges = [0, 1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 300, 383, 384, 447]
    blocks = []
    for nq in range(1, nat.ATT_MAXQ + 1):
        for _ in range(2):
            pool = rng.choice(edges, size=rng.integers(1, 4)) + rng.integers(0, 2)
            blocks.append(np.minimum(rng.choice(pool, size=nq), n_ctx - 1).astype(np.int32))
        for grp in (2, 8):  # grp heads of one kv head at each of a few positions, as the executor makes them
            base = rng.integers(0, n_ctx - 3)
            blocks.append(np.repeat(np.arange(3) + base, grp)[:nq].astype(np.int32))

    def run(tier):
        outs = []
        with using(tier):
            want_source = "avx512" if tier.startswith("amx") else tier
            assert nat.kernel_sources()["attend"] == want_source
            for b, pos in enumerate(blocks):
                r = np.random.default_rng(b)
                q = (r.standard_normal((len(pos), hd)) * 3).astype(np.float32)
                sinks = _sinks(len(pos), r)
                out = np.empty((len(pos), hd), np.float32)
                nat.attend(q, pos, kc, vc, out, len(pos), hd, n_ctx, float(1 / np.sqrt(hd)), KV_CODE[kv], window,
                           cap, sinks)
                outs.append(out)
        return outs

    want = run("avx2")
    assert all(np.isfinite(o).all() for o in want)
    # the vector kernel computed them: the scalar one (libm's exp and tanh) rounds differently
    assert any(not np.array_equal(a, b) for a, b in zip(want, run("scalar"), strict=True))
    for tier in SIMD:
        for pos, a, b in zip(blocks, want, run(tier), strict=True):
            assert np.array_equal(a, b), (tier, pos.tolist())


GOLDEN = ["gpt-oss-tiny", "gemma2-tiny"]


def _logits(src, ids: list[int], tier: str, threads: int, chunk: int, kv_type: str) -> np.ndarray:
    """The prompt's logits (prefill in chunks), then four decoded tokens' after it."""
    with using(tier):
        e = NativeEngine(config_of(src), src, n_ctx=256, threads=threads, chunk=chunk, kv_type=kv_type,
                         adaptive_threads=False)
        first = e.forward(ids, 0, all_logits=True)
        steps = [e.forward([5 + t], len(ids) + t) for t in range(4)]
    return np.concatenate([first, *steps])


@pytest.mark.parametrize("name", GOLDEN)
@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_models_take_the_tiers_attention(name, kv_type):
    """gpt-oss's sinks and Gemma 2's capped scores run on the tier's own attention kernel: every SIMD tier gives
    the same logits, for one thread or two and prefill in one chunk or several, and they are the vector
    kernel's, not the scalar one's (whose libm exp and tanh round differently); every tier, scalar included,
    picks the same greedy tokens."""
    src = GGUFFile(DATA / f"{name}.gguf")
    ids = np.load(DATA / f"{name}.logits.npz")["ids"].tolist()
    cfg = config_of(src)
    assert cfg.spec.sinks or cfg.attn_softcap
    assert any(cfg.layer_window(i) for i in range(cfg.n_layers))
    runs = {}
    for tier in RUN:
        one = _logits(src, ids, tier, 1, 64, kv_type)
        assert np.array_equal(one, _logits(src, ids, tier, 2, 5, kv_type)), tier
        runs[tier] = one
    for tier in SIMD:
        assert np.array_equal(runs[tier], runs[SIMD[0]]), tier
    if "scalar" in runs and SIMD:
        assert not np.array_equal(runs["scalar"], runs[SIMD[0]])  # the vector kernel ran, not the scalar one
    picks = {tier: r.argmax(1) for tier, r in runs.items()}
    assert all(np.array_equal(p, picks["scalar"]) for p in picks.values())
    src.close()
