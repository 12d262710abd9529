"""The element-wise and attention kernels (ops_*.c) against NumPy, on both ISA paths.

Tolerances, per op (x, w ~ N(0, 1) unless said):
- rmsnorm: the sum of squares is accumulated in a different order than NumPy's pairwise sum; relative
  error of the sum <= n * 2^-24 bounds the scale's relative error by about n * 2^-25 (< 2e-5 at
  n = 1000); then two roundings per value: rtol 3e-5 of |x * w / rms|, atol 1e-6.
- rope: one rotation per pair, products of O(1) values, with or without fma: a few ulp; atol 2e-6.
- softmax, silu_mul: the AVX2 exp is a polynomial within 2 ulp; the sum over n adds n ulp relative;
  rtol 1e-5 (softmax) / 2e-6 (silu) and atol 1e-7 of the output scale.
- add: exact.
- dequant_row: the same float formula as the block definitions: exact against an independent NumPy
  decoding (K-quants: within 1 ulp, the products are grouped differently).
- attention: online softmax over tiles vs the exact float64 softmax: rtol/atol 2e-5 (scores ~ 8, so
  exp amplifies score rounding by ~ 8 ulp; sums over up to 300 keys).
  And: a query gives identical bits whether attended alone or in a block with others.
- q8_0 KV cache: the stored bytes equal ggml's q8_0 of each key and value block (kv_q8.q8_0_split, the
  NumPy reference) exactly; attention over it is held to the same tolerance against the float64 attention
  over the dequantized keys and values (the kernels compute with those exact values), and every SIMD tier
  gives avx2's bits.
- hadamard (what the executor turns keys and queries by before a q8_0 cache): adds and subtractions in a
  fixed order, then one product: the NumPy codec's bits exactly; against the float64 matrix product, a few
  ulp per butterfly level.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_tiers import PRESENT, using

from barellm import _native as nat
from barellm.formats import kernels
from barellm.formats.kv_q8 import hadamard, kv_rotation, q8_0_join, q8_0_split

TILE = nat.KV_TILE




def aligned(shape, dtype=np.float32):
    from barellm.runtime.engine import aligned_zeros

    return aligned_zeros(shape, dtype)


@pytest.mark.parametrize("n", [1, 7, 8, 31, 33, 64, 576, 1000])
def test_rmsnorm(isa, n):
    rng = np.random.default_rng(n)
    T = 3
    x = rng.standard_normal((T, n)).astype(np.float32) * 3
    w = rng.standard_normal(n).astype(np.float32)
    out = np.empty_like(x)
    nat.rmsnorm(x, w, out, T, n, 1e-5)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(out, ref, rtol=3e-5, atol=1e-6)


def rope_ref(x, pos, head_dim, rope_dim, base, style):
    inv = 1.0 / base ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    ang = np.outer(pos, inv)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    T = x.shape[0]
    y = x.reshape(T, -1, head_dim).astype(np.float64).copy()
    h = rope_dim // 2
    if style == 0:
        a, b = y[..., 0:rope_dim:2].copy(), y[..., 1:rope_dim:2].copy()
        y[..., 0:rope_dim:2], y[..., 1:rope_dim:2] = a * c - b * s, a * s + b * c
    else:
        a, b = y[..., :h].copy(), y[..., h:rope_dim].copy()
        y[..., :h], y[..., h:rope_dim] = a * c - b * s, a * s + b * c
    return y.reshape(T, -1), ang


@pytest.mark.parametrize("style", [0, 1])
@pytest.mark.parametrize("n_heads,head_dim,rope_dim", [(9, 64, 64), (2, 64, 32), (3, 10, 10), (2, 66, 18), (1, 8, 2)])
def test_rope(isa, style, n_heads, head_dim, rope_dim):
    rng = np.random.default_rng(head_dim * 7 + rope_dim)
    T = 5
    pos = np.array([0, 1, 63, 64, 4000])
    x = rng.standard_normal((T, n_heads * head_dim)).astype(np.float32)
    ref, ang = rope_ref(x, pos, head_dim, rope_dim, 10000.0, style)
    cs = np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)
    y = x.copy()
    nat.rope(y, cs, T, n_heads, head_dim, rope_dim, style)
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6)
    # the part of each head past rope_dim is untouched
    yh, xh = y.reshape(T, n_heads, head_dim), x.reshape(T, n_heads, head_dim)
    assert np.array_equal(yh[..., rope_dim:], xh[..., rope_dim:])


@pytest.mark.parametrize("n", [1, 5, 8, 17, 49152])
def test_softmax(isa, n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((2, n)) * 10).astype(np.float32)
    x[1, 0] = 80.0  # one dominant value
    y = x.copy()
    nat.softmax(y, 2, n)
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(-1, keepdims=True))
    ref = e / e.sum(-1, keepdims=True)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-7)
    assert np.allclose(y.sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("n", [1, 7, 8, 33, 1536])
def test_silu_mul_and_add(isa, n):
    rng = np.random.default_rng(n)
    g = (rng.standard_normal(n) * 6).astype(np.float32)
    g[0] = -100.0  # far tail: exp(100) must not turn into inf/nan
    u = rng.standard_normal(n).astype(np.float32)
    out = np.empty_like(g)
    nat.silu_mul(g, u, out, n)
    g64 = g.astype(np.float64)
    ref = g64 / (1 + np.exp(-g64)) * u
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=max(1e-7 * np.abs(ref).max(), 1e-30))
    assert np.isfinite(out).all()
    x = u.copy()
    nat.add(x, g, n)
    assert np.array_equal(x, u + g)


@pytest.mark.parametrize("n", [1, 7, 8, 33, 2048])
def test_gelu_mul(isa, n):
    """gelu_tanh(g) * u, computed as g / (1 + e^(-2u)) * u: exp within 2 ulp (its argument's rounding
    is amplified by |2u| <= ~40 at most for the g used here), a division and two products: rtol 1e-5."""
    rng = np.random.default_rng(n)
    g = (rng.standard_normal(n) * 4).astype(np.float32)
    g[0] = -60.0
    u = rng.standard_normal(n).astype(np.float32)
    out = np.empty_like(g)
    nat.gelu_mul(g, u, out, n)
    g64 = g.astype(np.float64)
    # 0.5 g (1 + tanh(v)) written without float64's own cancellation where tanh(v) is near -1
    with np.errstate(over="ignore"):  # g = -60: e^(+big) = inf, g / inf = -0, the right limit
        ref = g64 / (1 + np.exp(-2 * np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64**3))) * u
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-30)
    assert np.isfinite(out).all()


def test_f16_conversion_exhaustive():
    bits = np.arange(65536, dtype=np.uint16)
    out = np.empty(65536, np.float32)
    kernels.dequantize_rows(1, 0, 1, 65536, bits.view(np.uint8), out=out.reshape(1, -1))
    ref = bits.view(np.float16).astype(np.float32)
    same = (out == ref) | (np.isnan(out) & np.isnan(ref))
    assert same.all()


def _random_blocks(qtype, nblocks, rng):
    """Random raw blocks with sane f16 scales (so values are finite)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.constants import GGML_QUANT_SIZES

    bs, bb = GGML_QUANT_SIZES[Q(qtype)]
    raw = rng.integers(0, 256, (nblocks, bb), dtype=np.uint8)
    f16 = lambda v: np.asarray(v, np.float16).view(np.uint8).reshape(nblocks, 2)  # noqa: E731
    d = rng.uniform(-0.1, 0.1, nblocks)
    if qtype in (2, 3, 6, 7, 8):
        raw[:, 0:2] = f16(d)
        if qtype in (3, 7):
            raw[:, 2:4] = f16(rng.uniform(-1, 1, nblocks))
    elif qtype in (12, 13):
        raw[:, 0:2] = f16(np.abs(d))
        raw[:, 2:4] = f16(np.abs(rng.uniform(0, 0.1, nblocks)))
    elif qtype == 14:
        raw[:, 208:210] = f16(d)
    elif qtype == 11:
        raw[:, 108:110] = f16(d)
    return raw, bs


@pytest.mark.parametrize("qtype", [0, 1, 2, 3, 6, 7, 8, 11, 12, 13, 14, 30])
def test_dequant_row(qtype):
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    rng = np.random.default_rng(qtype)
    if qtype in (0, 1, 30):
        n = 70
        vals = rng.standard_normal(n).astype(np.float32)
        raw = {0: vals.view(np.uint8), 1: vals.astype(np.float16).view(np.uint8),
               30: (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)}[qtype]
        ref = {0: vals, 1: vals.astype(np.float16).astype(np.float32),
               30: ((vals.view(np.uint32) >> 16) << 16).view(np.float32)}[qtype]
    else:
        raw, bs = _random_blocks(qtype, 4, rng)
        n = 4 * bs
        raw = raw.reshape(-1)
        ref = dequantize(raw, Q(qtype)).reshape(-1).astype(np.float32)
    assert kernels.row_bytes(qtype, n) == raw.size
    out = kernels.dequantize_rows(qtype, 0, 1, n, raw).reshape(-1)
    np.testing.assert_allclose(out, ref, rtol=2.0**-23, atol=0)


def test_dequant_unsupported():
    assert kernels.row_bytes(3, 33) == 0  # not a whole number of blocks
    assert kernels.row_bytes(99, 64) == 0
    with pytest.raises(ValueError):
        kernels.dequantize_rows(99, 0, 1, 64, np.zeros(64, np.uint8))


def test_float_to_half():
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.standard_normal(100000).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 6, 100000),
        np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65519.99, 65520, 1e6, 6e-8, 3e-8, 2.98e-8, 6.1e-5, 6.09e-5,
                  1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11)], np.float32),
        # ties at every exponent: halfway between two halves
        (np.arange(1, 2049, dtype=np.float32) + np.float32(0.5)) * np.float32(2.0**-10),
    ]).astype(np.float32)
    out = np.empty(len(x), np.uint16)
    nat.float_to_half(x, out, len(x))
    with np.errstate(over="ignore"):
        assert np.array_equal(out, x.astype(np.float16).view(np.uint16))
    nan = np.empty(1, np.uint16)
    nat.float_to_half(np.array([np.nan], np.float32), nan, 1)
    assert np.isnan(nan.view(np.float16)[0])


KV_TYPES = {"f32": np.float32, "f16": np.float16, "q8_0": np.uint8}
KV_CODE = {"f32": 0, "f16": 1, "q8_0": nat.KV_Q8_0}  # ops.h's enum bl_kv_type


def row_bytes(hd, kv):
    """One position's bytes of one head's K (and of its V): q8_0 takes hd int8 and hd / 32 f16 scales."""
    return hd + hd // 16 if kv == "q8_0" else hd * np.dtype(KV_TYPES[kv]).itemsize


def skip_unless_holds(kv, hd):
    if kv == "q8_0" and hd % 32:
        pytest.skip("a q8_0 cache needs head_dim % 32 == 0")


def _cache(n_kv, n_ctx, hd, S, rng, kv="f32"):
    dt = KV_TYPES[kv]
    n = n_kv * n_ctx * row_bytes(hd, kv) // np.dtype(dt).itemsize
    kc, vc = aligned(n, dt), aligned(n, dt)
    K = rng.standard_normal((S, n_kv, hd)).astype(np.float32)
    V = rng.standard_normal((S, n_kv, hd)).astype(np.float32)
    for p in range(S):
        nat.kv_store(kc, vc, K[p].reshape(-1), V[p].reshape(-1), p, n_kv, hd, n_ctx, KV_CODE[kv])
    # what the cache holds
    if kv == "q8_0":
        return kc, vc, q8_0_join(*q8_0_split(K)), q8_0_join(*q8_0_split(V))
    return kc, vc, K.astype(dt).astype(np.float32), V.astype(dt).astype(np.float32)


def q8_views(kc, vc, n_kv, n_ctx, hd):
    """A q8_0 cache's parts (ops.h): K int8 [n_kv, tiles, hd, TILE] and f16 scales [n_kv, tiles, hd / 32, TILE],
    V int8 [n_kv, n_ctx, hd] and scales [n_kv, n_ctx, hd / 32]."""
    rb, tiles = row_bytes(hd, "q8_0"), n_ctx // TILE
    kt = kc.reshape(n_kv, tiles, TILE * rb)
    kq = kt[..., :TILE * hd].view(np.int8).reshape(n_kv, tiles, hd, TILE)
    kd = kt[..., TILE * hd:].view(np.float16).reshape(n_kv, tiles, hd // 32, TILE)
    vr = vc.reshape(n_kv, n_ctx, rb)
    return kq, kd, vr[..., :hd].view(np.int8), vr[..., hd:].view(np.float16)


@pytest.mark.parametrize("hd", [32, 64, 96, 256])
def test_kv_store_q8_0_bytes(isa, hd):
    """The stored int8 values and f16 scales are ggml's q8_0 of each 32-value block of every key and value,
    bit for bit, in ops.h's layout; positions not written stay zero."""
    rng = np.random.default_rng(hd)
    n_kv, n_ctx, S = 3, 192, 130
    kc, vc, _, _ = _cache(n_kv, n_ctx, hd, S, rng, "q8_0")
    rng = np.random.default_rng(hd)  # the same K, V again
    K = rng.standard_normal((S, n_kv, hd)).astype(np.float32)
    V = rng.standard_normal((S, n_kv, hd)).astype(np.float32)
    kq, kd, vq, vd = q8_views(kc, vc, n_kv, n_ctx, hd)
    (Kq, Kd), (Vq, Vd) = q8_0_split(K), q8_0_split(V)
    k_vals = kq.transpose(0, 1, 3, 2).reshape(n_kv, n_ctx, hd)
    k_scales = kd.transpose(0, 1, 3, 2).reshape(n_kv, n_ctx, hd // 32)
    assert np.array_equal(k_vals[:, :S], Kq.transpose(1, 0, 2))
    assert np.array_equal(k_scales[:, :S].view(np.uint16), Kd.transpose(1, 0, 2).view(np.uint16))
    assert np.array_equal(vq[:, :S], Vq.transpose(1, 0, 2))
    assert np.array_equal(vd[:, :S].view(np.uint16), Vd.transpose(1, 0, 2).view(np.uint16))
    assert not k_vals[:, S:].any() and not k_scales[:, S:].view(np.uint16).any()
    assert not vq[:, S:].any() and not vd[:, S:].view(np.uint16).any()


@pytest.mark.parametrize("n,blocks", [(1, 3), (2, 1), (32, 3), (64, 2), (128, 1), (256, 2), (1024, 1)])
def test_hadamard(isa, n, blocks):
    """The Walsh-Hadamard transform a q8_0 cache turns keys and queries by: the NumPy codec's bits
    (kv_q8.hadamard, the same butterflies in float32), each block of n on its own, orthonormal (dot products
    kept, its own inverse) to float32 rounding, and an outlier spread over its whole block."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((blocks, n)) * 4).astype(np.float32)
    y = x.copy().reshape(-1)
    nat.hadamard(y, y.size, n)
    assert np.array_equal(y, hadamard(x, n).reshape(-1))
    h = np.array([[1.0]])
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    np.testing.assert_allclose(y.reshape(blocks, n), x.astype(np.float64) @ h.T / np.sqrt(n), rtol=0,
                               atol=1e-5 * np.abs(x).max() * np.log2(2 * n))
    back = y.copy()
    nat.hadamard(back, back.size, n)
    np.testing.assert_allclose(back, x.reshape(-1), rtol=0, atol=1e-5 * np.abs(x).max() * np.log2(2 * n))
    if n >= 32:
        spike = np.zeros(n, np.float32)
        spike[5] = 100.0
        nat.hadamard(spike, n, n)
        assert np.allclose(np.abs(spike), 100 / np.sqrt(n))
    with pytest.raises(ValueError, match="power of two"):
        nat.hadamard(np.zeros(48, np.float32), 48, 48)
    with pytest.raises(ValueError, match="power of two"):
        nat.hadamard(np.zeros(48, np.float32), 48, 32)


def test_kv_rotation():
    """The order keys are turned in: the largest power of two dividing head_dim (a whole head of 64, 128 or
    256; 32 for 96)."""
    assert [kv_rotation(hd) for hd in (32, 64, 96, 128, 160, 192, 256)] == [32, 64, 32, 128, 32, 64, 256]


def test_kv_q8_0_rounding_rule():
    """ggml's rule on the cases that tell rules apart: halves go away from zero (roundf, not rint), the block's
    largest magnitude maps to +-127, an all-zero block gets scale 0 and zeros."""
    hd, n_ctx = 32, TILE
    x = np.zeros((2, hd), np.float32)
    x[0, :4] = [127.0, -63.5, 0.5, -1.5]  # d = 1: x / d is exact, halves must go away from zero
    x[0, 4:] = np.linspace(-100, 100, hd - 4)
    kc, vc = aligned(n_ctx * row_bytes(hd, "q8_0"), np.uint8), aligned(n_ctx * row_bytes(hd, "q8_0"), np.uint8)
    for p in range(2):
        nat.kv_store(kc, vc, x[p], x[p], p, 1, hd, n_ctx, KV_CODE["q8_0"])
    kq, kd, vq, vd = q8_views(kc, vc, 1, n_ctx, hd)
    assert vq[0, 0, :4].tolist() == [127, -64, 1, -2]
    assert kq[0, 0, :4, 0].tolist() == [127, -64, 1, -2]
    assert vd[0, 0, 0] == 1.0 and kd[0, 0, 0, 0] == 1.0
    assert not vq[0, 1].any() and vd[0, 1, 0] == 0
    want_q, want_d = q8_0_split(x[0])
    assert np.array_equal(vq[0, 0], want_q) and vd[0, 0, 0] == want_d[0]


@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_kv_store_layout(isa, kv):
    rng = np.random.default_rng(0)
    n_kv, hd, n_ctx, S = 2, 12, 128, 70  # head_dim 12: a vector of 8 and a tail of 4
    kc, vc, K, V = _cache(n_kv, n_ctx, hd, S, rng, kv)
    k = kc.reshape(n_kv, n_ctx // TILE, hd, TILE).transpose(0, 1, 3, 2).reshape(n_kv, n_ctx, hd)
    assert np.array_equal(k[:, :S].astype(np.float32), K.transpose(1, 0, 2))
    assert np.array_equal(vc.reshape(n_kv, n_ctx, hd)[:, :S].astype(np.float32), V.transpose(1, 0, 2))


@pytest.mark.parametrize("kv", KV_TYPES)
@pytest.mark.parametrize("hd,window", [(64, 0), (128, 0), (40, 0), (6, 0), (64, 70), (64, 1), (16, 130), (96, 0),
                                       (32, 130)])
def test_attention(isa, hd, kv, window):
    skip_unless_holds(kv, hd)
    rng = np.random.default_rng(hd + window)
    n_kv, n_ctx, S = 2, 320, 300
    kc, vc, K, V = _cache(n_kv, n_ctx, hd, S, rng, kv)
    scale = np.float32(1 / np.sqrt(hd))
    positions = np.array([0, 1, 62, 63, 64, 65, 127, 128, 200, 299], np.int32)
    nq = len(positions)
    head = 1
    q = (rng.standard_normal((nq, hd)) * 3).astype(np.float32)
    per = n_ctx * row_bytes(hd, kv) // kc.itemsize  # one head's elements
    kh = kc[head * per:(head + 1) * per]
    vh = vc[head * per:(head + 1) * per]
    out = np.empty((nq, hd), np.float32)

    def attend(q, pos, out):
        nat.attend(q, pos, kh, vh, out, len(pos), hd, n_ctx, float(scale), KV_CODE[kv], window)

    attend(q, positions, out)
    for i, p in enumerate(positions):
        lo = max(0, p - window + 1) if window else 0
        s = (K[lo:p + 1, head].astype(np.float64) @ q[i].astype(np.float64)) * float(scale)
        e = np.exp(s - s.max())
        ref = (e / e.sum()) @ V[lo:p + 1, head].astype(np.float64)
        np.testing.assert_allclose(out[i], ref, rtol=2e-5, atol=2e-5)
    # a query's bits do not depend on the other queries of its block
    for i in (0, 4, 9):
        one = np.empty((1, hd), np.float32)
        attend(q[i:i + 1].copy(), positions[i:i + 1].copy(), one)
        assert np.array_equal(one[0], out[i])
    rev = np.empty_like(out)
    attend(q[::-1].copy(), positions[::-1].copy(), rev)
    assert np.array_equal(rev[::-1], out)


@pytest.mark.parametrize("kv", KV_TYPES)
@pytest.mark.parametrize("hd,window", [(64, 0), (128, 0), (128, 70), (64, 130), (80, 0), (16, 1), (96, 0), (32, 1)])
def test_attention_bits_equal_on_every_simd_tier(hd, kv, window):
    """Every SIMD tier gives avx2's bits for every query (greedy output must not depend on the tier),
    whatever the block: 1..16 queries, some sharing a key range (one position, several heads; those a
    tier may attend together), some not, positions on and around tile boundaries."""
    skip_unless_holds(kv, hd)
    tiers = [t for t in PRESENT if t != "scalar"]
    if "avx2" not in tiers:
        pytest.skip("this CPU lacks the avx2 tier")
    rng = np.random.default_rng(7 * hd + window)
    n_ctx = 448
    kc, vc, _, _ = _cache(1, n_ctx, hd, n_ctx, rng, kv)
    edges = [0, 1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 300, 383, 384, 447]
    blocks = []
    for nq in range(1, nat.ATT_MAXQ + 1):
        for _ in range(3):
            pool = rng.choice(edges, size=rng.integers(1, 4)) + rng.integers(0, 2)
            pos = np.minimum(rng.choice(pool, size=nq), n_ctx - 1).astype(np.int32)
            blocks.append(pos)
        blocks.append(np.sort(np.repeat(np.arange(3) + rng.integers(0, n_ctx - 3), 6)[:nq]).astype(np.int32))

    def run(tier):
        outs = []
        with using(tier):
            if tier in ("avx2", "avx512"):  # the tier's own kernel is the one under test
                assert nat.kernel_sources()["attend"] == tier
            for b, pos in enumerate(blocks):
                q = (np.random.default_rng(b).standard_normal((len(pos), hd)) * 3).astype(np.float32)
                out = np.empty((len(pos), hd), np.float32)
                nat.attend(q, pos, kc, vc, out, len(pos), hd, n_ctx, float(1 / np.sqrt(hd)), KV_CODE[kv], window)
                outs.append(out)
        return outs

    want = run("avx2")
    assert all(np.isfinite(o).all() for o in want)
    for tier in tiers:
        for pos, a, b in zip(blocks, want, run(tier), strict=True):
            assert np.array_equal(a, b), (tier, pos.tolist())


@pytest.mark.parametrize("hd", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("window", [0, 1, 70])
def test_attention_q8_0_exact_buffers(isa, hd, window):
    """q8_0 store and attention with every buffer (keys and values in, the cache, queries, positions, outputs)
    exactly as large as it must be, so that under AddressSanitizer (`make test-asan`) a read or write past
    any of them fails; 1 to 5 queries, the cache's last position among them (its last tile read to the end)."""
    rng = np.random.default_rng(3 * hd + window)
    n_ctx, n_kv, code = 128, 2, KV_CODE["q8_0"]
    per = n_ctx * row_bytes(hd, "q8_0")
    kc, vc = np.zeros(n_kv * per, np.uint8), np.zeros(n_kv * per, np.uint8)
    K = (rng.standard_normal((n_ctx, n_kv, hd)) * 3).astype(np.float32)
    V = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float32)
    for p in range(n_ctx):
        nat.kv_store(kc, vc, K[p].reshape(-1).copy(), V[p].reshape(-1).copy(), p, n_kv, hd, n_ctx, code)
    Kd, Vd = q8_0_join(*q8_0_split(K)), q8_0_join(*q8_0_split(V))
    scale = float(np.float32(1 / np.sqrt(hd)))
    for head in range(n_kv):
        kh, vh = kc[head * per:(head + 1) * per].copy(), vc[head * per:(head + 1) * per].copy()  # exact, on their own
        for nq in range(1, 6):
            pos = np.empty(nq, np.int32)
            pos[:] = rng.choice(n_ctx, nq)
            pos[0] = n_ctx - 1
            q = np.empty((nq, hd), np.float32)
            q[:] = rng.standard_normal((nq, hd)) * 3
            out = np.empty((nq, hd), np.float32)
            nat.attend(q, pos, kh, vh, out, nq, hd, n_ctx, scale, code, window)
            for i, p in enumerate(pos):
                lo = max(0, p - window + 1) if window else 0
                s = (Kd[lo:p + 1, head].astype(np.float64) @ q[i].astype(np.float64)) * scale
                e = np.exp(s - s.max())
                np.testing.assert_allclose(out[i], (e / e.sum()) @ Vd[lo:p + 1, head], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("biases", [False, True], ids=["llama", "qwen2 biases"])
def test_q8_0_cache_in_the_executor(tmp_path, biases):
    """What the executor adds to a q8_0 cache (executor.c: each key minus the K bias, turned by bl_hadamard,
    stored head by head; each query turned in a scratch of its own), on a tiny model of head_dim 32, prompts
    of several chunks (blocks of several queries) and decode: the cache holds the NumPy codec's bits of the
    keys and values the rope op gave (kv_q8.q8_0_keys), the attention op gives the float64 attention over the
    keys turned and shifted back, and every SIMD tier present gives the same logits, bit for bit. Under
    AddressSanitizer this runs the executor's scratch buffers too."""
    from engine_support import load_config, open_source

    from barellm.arch.llama import attention
    from barellm.formats.kv_q8 import q8_0_keys, q8_0_keys_join, q8_0_round_trip
    from barellm.runtime.engine import NativeEngine

    from tiny_model import write_tiny_llama

    src = open_source(write_tiny_llama(tmp_path / "tiny.gguf", dim=128, heads=4, kv_heads=2, biases=biases))
    cfg = load_config(src)
    assert cfg.head_dim == 32 and cfg.attn_bias == biases
    ids = list(range(3, 43))
    e = NativeEngine(cfg, src, n_ctx=128, threads=2, chunk=16, kv_type="q8_0", adaptive_threads=False)
    seen: dict[str, list[np.ndarray]] = {}

    def observe(op, out, ctx):  # once a chunk
        if op.name.endswith((".rope", ".attn")):
            seen.setdefault(op.name, []).append(out[:ctx.T].copy())

    e.debug_forward(ids, 0, observe=observe)
    assert len(seen["blk.0.rope"]) == 3
    n, qd, kd, hd, nkv = len(ids), cfg.q_dim, cfg.kv_dim, cfg.head_dim, cfg.n_kv_heads
    for i in range(cfg.n_layers):
        qkv = np.concatenate(seen[f"blk.{i}.rope"])
        k, v = qkv[:, qd:qd + kd].reshape(n, nkv, hd), qkv[:, qd + kd:qd + 2 * kd].reshape(n, nkv, hd)
        bias = np.asarray(src.dequantize(f"blk.{i}.attn_k.bias"), np.float32).reshape(nkv, hd) if biases else None
        keys, values = e.kv(0, i, n)
        assert np.array_equal(keys, q8_0_keys_join(*q8_0_keys(k, bias), bias))
        assert np.array_equal(values, q8_0_round_trip(v))
        want = attention(qkv[:, :qd].reshape(n, cfg.n_heads, hd).astype(np.float64), keys.astype(np.float64),
                         values.astype(np.float64), 0, cfg.scale)
        np.testing.assert_allclose(np.concatenate(seen[f"blk.{i}.attn"]), want, rtol=0,
                                   atol=2e-5 * np.abs(values).max())

    def logits():
        first = e.forward(ids, 0, all_logits=True)
        steps = [e.forward([7 + t], n + t) for t in range(3)]
        return np.concatenate([first, *steps])

    tiers = [t for t in PRESENT if t != "scalar"]
    runs = {}
    for tier in tiers:
        with using(tier):
            runs[tier] = logits()
    assert all(np.array_equal(runs[tiers[0]], r) for r in runs.values())


@pytest.mark.parametrize("kv", KV_TYPES)
def test_attention_ignores_stale_cache(isa, kv):
    """Keys outside a query's range (stale entries, NaN even) never reach its result."""
    rng = np.random.default_rng(1)
    n_kv, n_ctx, hd = 1, 128, 64
    kc, vc, K, V = _cache(n_kv, n_ctx, hd, 10, rng, kv)
    q = rng.standard_normal((1, hd)).astype(np.float32)
    pos = np.array([9], np.int32)
    a = np.empty((1, hd), np.float32)
    code = KV_CODE[kv]
    nat.attend(q, pos, kc, vc, a, 1, hd, n_ctx, 0.125, code, 6)
    stale = [*range(0, 4), *range(10, 128)]
    for p in stale:
        nat.kv_store(kc, vc, np.full(hd, np.nan, np.float32), np.full(hd, np.nan, np.float32), p, 1, hd, n_ctx, code)
    if kv == "q8_0":  # int8 holds no NaN: make the stale entries' scales NaN and their values extreme
        kq, kd, vq, vd = q8_views(kc, vc, 1, n_ctx, hd)
        for p in stale:
            kq[0, p // TILE, :, p % TILE], kd[0, p // TILE, :, p % TILE] = -128, np.nan
            vq[0, p], vd[0, p] = -128, np.nan
    b = np.empty((1, hd), np.float32)
    nat.attend(q, pos, kc, vc, b, 1, hd, n_ctx, 0.125, code, 6)
    assert np.array_equal(a, b)


def test_bad_arguments():
    x = np.zeros(8, np.float32)
    with pytest.raises(ValueError):
        nat.rmsnorm(x, x, x, 2, 8, 1e-5)  # x too small for 2 rows
    with pytest.raises(ValueError):
        nat.rope(x, x, 1, 1, 8, 3, 0)  # odd rope_dim
    with pytest.raises(ValueError):
        nat.attend(x, np.zeros(1, np.int32), x, x, x, 1, 8, 100, 1.0)  # n_ctx not a tile multiple
    big = np.zeros(TILE * 64, np.float32)
    with pytest.raises(ValueError, match="head_dim"):
        nat.attend(x, np.zeros(1, np.int32), big, big, x, 1, 8, TILE, 1.0, KV_CODE["q8_0"])  # 8 % 32
    with pytest.raises(ValueError, match="head_dim"):
        nat.kv_store(big, big, x, x, 0, 1, 8, TILE, KV_CODE["q8_0"])
    with pytest.raises(ValueError, match="kv_type"):
        nat.kv_store(big, big, x, x, 0, 1, 8, TILE, 7)
