"""The quantized matmul kernels (quant*.c) against NumPy, on every type x layout x ISA path.

What is checked:
- activation quantization: byte-exact against a NumPy model of it, for both activation types (Q8: d = amax/127,
  q = round-half-even(x/d); Q8X2: d = amax/32258, q split into 254 * hi + lo);
- matmul: against the exact product of the dequantized weights and the quantized activations, within a
  float32 rounding bound; against the float activations within the activation quantization bound;
- invariance: the result for one (t, r) is bit-identical for any T, any row split, and both ISA paths;
- repacking: every row read back from the interleaved layout equals the GGUF row;
- the error paths raise ValueError.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_tiers import using

from barellm import _native as nat

F32, F16, Q4_0, Q4_1, Q8_0, MXFP4 = 0, 1, 2, 3, 8, 39
ROWS, I8 = 0, 1
A8, A8X2 = 0, 1  # activation types (kernels.h enum bl_act)
Q8X2_MAX = 254 * 127
QK = 32
EPS = 2.0**-23  # float32 machine epsilon (twice the unit roundoff)

QUANT = (Q4_0, Q4_1, Q8_0, MXFP4)
CASES = ([(t, ROWS, A8) for t in (F32, F16)] + [(t, ROWS, a) for t in QUANT for a in (A8, A8X2)]
         + [(t, I8, a) for t in QUANT for a in (A8, A8X2)])

_BLOCK = {
    Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", (QK,))]),
    Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))]),
    Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (QK // 2,))]),
    MXFP4: np.dtype([("e", "u1"), ("qs", "u1", (QK // 2,))]),
}




# ---- NumPy models -------------------------------------------------------------------------------------


def make_weights(type_, rows, cols, rng):
    """Random GGUF-ordered rows (uint8 [rows, row_bytes]) covering the whole range of the quants."""
    if type_ == F32:
        return rng.standard_normal((rows, cols)).astype("<f4").view(np.uint8)
    if type_ == F16:
        return rng.standard_normal((rows, cols)).astype("<f2").view(np.uint8)
    b = np.zeros(rows * cols // QK, dtype=_BLOCK[type_])
    if type_ == MXFP4:  # scales 2^(e - 128) around 0.01..1, and now and then the subnormal ones (e < 2)
        b["e"] = np.where(rng.random(b.shape) < 0.05, rng.integers(0, 3, b.shape), rng.integers(118, 129, b.shape))
        b["qs"] = rng.integers(0, 256, b["qs"].shape)
        return b.view(np.uint8).reshape(rows, -1)
    b["d"] = rng.uniform(-0.05, 0.05, b.shape)
    if type_ == Q4_1:
        b["m"] = rng.uniform(-0.5, 0.5, b.shape)
    lo, hi = (-128, 128) if type_ == Q8_0 else (0, 256)
    b["qs"] = rng.integers(lo, hi, b["qs"].shape)
    return b.view(np.uint8).reshape(rows, -1)


def dequantize(raw, type_, rows, cols):
    """float64 W[rows, cols] from GGUF-ordered rows (barellm.formats.quant when present, else the same in place)."""
    try:
        from barellm.formats import quant

        return quant.dequantize(np.ascontiguousarray(raw).reshape(-1), type_, (rows, cols)).astype(np.float64)
    except ImportError:
        pass
    if type_ == F32:
        return raw.view("<f4").reshape(rows, cols).astype(np.float64)
    if type_ == F16:
        return raw.view("<f2").reshape(rows, cols).astype(np.float64)
    b = np.ascontiguousarray(raw).reshape(-1).view(_BLOCK[type_])
    d = b["d"].astype(np.float64)[:, None]
    if type_ == Q8_0:
        v = b["qs"] * d
    else:
        q = np.concatenate([b["qs"] & 15, b["qs"] >> 4], axis=1).astype(np.float64)
        v = (q - 8) * d if type_ == Q4_0 else q * d + b["m"].astype(np.float64)[:, None]
    return v.reshape(rows, cols)


def quantize_act_ref(x):
    """The activation quantization in float32 NumPy: (q int8 [T, nb, 32], d f32 [T, nb])."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, QK)
    d = np.abs(xb).max(axis=-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.rint(xb * inv[..., None]), -128, 127).astype(np.int8)
    return q, d


def quantize_act_x2_ref(x):
    """The Q8X2 activation quantization in float32 NumPy: (hi, lo int8 [T, nb, 32], q int32, d f32 [T, nb])."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, QK)
    d = np.abs(xb).max(axis=-1) / np.float32(Q8X2_MAX)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.rint(xb * inv[..., None]), -Q8X2_MAX, Q8X2_MAX).astype(np.int32)
    hi = np.rint(q.astype(np.float32) / np.float32(254)).astype(np.int32)
    lo = q - 254 * hi
    assert np.abs(hi).max() <= 127 and np.abs(lo).max() <= 127
    return hi.astype(np.int8), lo.astype(np.int8), q, d


def act_values_ref(x, act):
    """The activation values the kernels multiply: (q as integers [T, nb, 32], d [T, nb])."""
    if act == A8X2:
        _, _, q, d = quantize_act_x2_ref(x)
        return q, d
    q, d = quantize_act_ref(x)
    return q.astype(np.int32), d


def act_bytes_ref(x, row_bytes, act=A8):
    """The activation buffer quantize_act must produce, byte for byte (see quant_internal.h)."""
    if act == A8X2:
        hi, lo, q, d = quantize_act_x2_ref(x)
        planes = [hi, lo]
    else:
        q, d = quantize_act_ref(x)
        planes = [q]
    T, nb = d.shape
    sq = q.astype(np.int32).sum(axis=-1)
    s = d * sq.astype(np.float32)
    out = np.zeros((T, row_bytes), np.uint8)
    o = 0
    for plane in planes:
        out[:, o : o + nb * 32] = plane.reshape(T, -1).view(np.uint8)
        o += nb * 32
    out[:, o : o + nb * 4] = d.astype("<f4").view(np.uint8)
    out[:, o + nb * 4 : o + nb * 8] = s.astype("<f4").view(np.uint8)
    out[:, o + nb * 8 : o + nb * 12] = sq.astype("<i4").view(np.uint8)
    return out


def weights_for(type_, layout, rows, cols, raw):
    return raw.tobytes() if layout == ROWS else nat.repack(type_, layout, rows, cols, raw.tobytes())


def matmul(type_, layout, rows, cols, w, x, **kw):
    return np.asarray(nat.matmul(type_, layout, rows, cols, w, np.ascontiguousarray(x, np.float32), **kw))


# ---- activation quantization --------------------------------------------------------------------------


@pytest.mark.parametrize("cols", [32, 96, 576])
def test_quantize_act_exact(isa, cols):
    rng = np.random.default_rng(cols)
    x = rng.standard_normal((5, cols)).astype(np.float32) * rng.uniform(0.01, 100, (5, 1)).astype(np.float32)
    x[1, :32] = 0  # an all-zero block: d = 0, q = 0
    x[2, 5] = 0.5 * np.abs(x[2, :32]).max() / 127 * 255  # ties and near-ties exercise the rounding
    x[3, 7] = np.abs(x[3, :32]).max() / Q8X2_MAX * 254.5  # near a tie of hi = round(q / 254)
    for t in QUANT:
        for act in (A8, A8X2):
            rb = nat.act_row_bytes(t, ROWS, cols, act)
            got = np.frombuffer(nat.quantize_act(t, ROWS, cols, x, act), np.uint8).reshape(5, rb)
            np.testing.assert_array_equal(got, act_bytes_ref(x, rb, act))
    got = np.frombuffer(nat.quantize_act(F32, ROWS, cols, x), np.uint8).reshape(5, -1)
    np.testing.assert_array_equal(got[:, : cols * 4], x.view(np.uint8))


@pytest.mark.parametrize("cols", [32, 96, 200, 576, 8960])
def test_quantize_act_in_block_ranges(isa, cols):
    """A row converted in ranges of blocks, as threads sharing one decode token's row do, is the row the
    whole conversion makes, byte for byte; float rows whose last block is short included."""
    rng = np.random.default_rng(cols)
    x = rng.standard_normal((3, cols)).astype(np.float32) * rng.uniform(0.01, 100, (3, 1)).astype(np.float32)
    cases = [(F32, A8)] + ([(t, a) for t in QUANT for a in (A8, A8X2)] if cols % QK == 0 else [])
    for t, act in cases:
        whole = nat.quantize_act(t, ROWS, cols, x, act)
        for piece in (1, 3, 7, cols // QK + 1):
            assert nat.quantize_act(t, ROWS, cols, x, act, piece) == whole, (t, act, piece)
    with pytest.raises(ValueError, match="piece"):
        nat.quantize_act(F32, ROWS, cols, x, A8, -1)


# ---- correctness against NumPy ------------------------------------------------------------------------


@pytest.mark.parametrize("type_,layout,act", CASES)
@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 64), (8, 96), (13, 576), (40, 1536), (29, 160)])
def test_matmul_vs_numpy(isa, type_, layout, act, rows, cols):
    rng = np.random.default_rng(rows * 1000 + cols + type_)
    T = 3
    raw = make_weights(type_, rows, cols, rng)
    W = dequantize(raw, type_, rows, cols)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    got = matmul(type_, layout, rows, cols, weights_for(type_, layout, rows, cols, raw), x, act=act)
    assert got.shape == (T, rows) and got.dtype == np.float32

    if type_ in QUANT:
        q, d = act_values_ref(x, act)
        xhat = (q.astype(np.float64) * d[..., None].astype(np.float64)).reshape(T, cols)
        # vs dequantized W x quantized x: the block integer dots are exact; the float work is one rounded
        # scale product and one rounded FMA per block (Q4_1: also its min chain and the final add), each off
        # by at most 2^-24 of the running magnitude, bounded by S = |W| @ |xhat|.
        nb = cols // QK
        ref, S = xhat @ W.T, np.abs(xhat) @ np.abs(W).T
        np.testing.assert_array_less(np.abs(got - ref), (nb + 3) * EPS * S + 1e-30)
        # vs the float activations: |x - xhat| <= d/2 per element adds sum_b d_b / 2 * sum_i |W[r, i]|
        # (Q8X2's d is 254x smaller than Q8's, so is this term; the product x * (1 / d) is rounded before
        # round-half-even, which can move q by one more unit at the far end of a block: allow d, not d/2)
        half_d = np.repeat(d.astype(np.float64) / (1 if act == A8X2 else 2), QK, axis=1)
        bound = (nb + 3) * EPS * S + half_d @ np.abs(W).T
        np.testing.assert_array_less(np.abs(got - x.astype(np.float64) @ W.T), bound + 1e-30)
        if act == A8X2:  # and it is ~250x closer to the float product than Q8's
            q8 = matmul(type_, layout, rows, cols, weights_for(type_, layout, rows, cols, raw), x)
            exact = x.astype(np.float64) @ W.T
            assert np.abs(got - exact).max() * 50 < np.abs(q8 - exact).max()
    else:
        # FMA chains of cols / 8 per lane, then 3 adds: each step off by at most 2^-24 of |W| @ |x|
        ref, S = x.astype(np.float64) @ W.T, np.abs(x.astype(np.float64)) @ np.abs(W).T
        np.testing.assert_array_less(np.abs(got - ref), (cols // 8 + 5) * EPS * S + 1e-30)


@pytest.mark.parametrize("cols", [1, 7, 8, 13, 100])
def test_float_any_cols(isa, cols):
    rng = np.random.default_rng(cols)
    for type_ in (F32, F16):
        raw = make_weights(type_, 11, cols, rng)
        W = dequantize(raw, type_, 11, cols)
        x = rng.standard_normal((4, cols)).astype(np.float32)
        got = matmul(type_, ROWS, 11, cols, raw.tobytes(), x)
        S = np.abs(x.astype(np.float64)) @ np.abs(W).T
        np.testing.assert_array_less(np.abs(got - x @ W.T), (cols // 8 + 5) * EPS * S + 1e-30)


# ---- invariance ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_,layout,act", CASES)
@pytest.mark.parametrize("rows,cols", [(1, 32), (19, 64), (24, 576), (37, 96), (17, 1536)])
def test_invariance_T_and_splits(isa, type_, layout, act, rows, cols):
    """One (t, r) gives the same bits whatever T, the row range and the other rows/vectors are."""
    rng = np.random.default_rng(rows + cols + 31 * type_ + layout)
    raw = make_weights(type_, rows, cols, rng)
    w = weights_for(type_, layout, rows, cols, raw)
    T = 13
    x = rng.standard_normal((T, cols)).astype(np.float32)
    full = matmul(type_, layout, rows, cols, w, x, act=act)
    singles = np.concatenate([matmul(type_, layout, rows, cols, w, x[t : t + 1], act=act) for t in range(T)])
    assert np.array_equal(full, singles)
    for k in list(range(2, 10)) + [12]:
        assert np.array_equal(matmul(type_, layout, rows, cols, w, x[:k], act=act), full[:k]), k
        assert np.array_equal(matmul(type_, layout, rows, cols, w, x[T - k :], act=act), full[T - k :]), k
    # row splits on the alignment grid, as threads would take them
    align = nat.row_align(type_, layout)
    xq = nat.quantize_act(type_, layout, cols, x, act)
    xq1 = nat.quantize_act(type_, layout, cols, x[:1], act)  # T = 1 takes other tiles (decode kernels)
    for _ in range(6):
        cuts = sorted(set(int(c) for c in rng.integers(0, rows // align + 1, 3) * align) | {0, rows})
        out, out1 = np.zeros_like(full), np.zeros_like(full[:1])
        for r0, r1 in zip(cuts[:-1], cuts[1:], strict=True):
            part = np.asarray(nat.matmul_q(type_, layout, rows, cols, w, xq, T, r0=r0, r1=r1, act=act))
            assert not part[:, :r0].any() and not part[:, r1:].any()
            out[:, r0:r1] = part[:, r0:r1]
            out1[:, r0:r1] = np.asarray(nat.matmul_q(type_, layout, rows, cols, w, xq1, 1, r0=r0, r1=r1,
                                                     act=act))[:, r0:r1]
        assert np.array_equal(out, full), cuts
        assert np.array_equal(out1, full[:1]), cuts


@pytest.mark.parametrize("type_,layout,act", CASES)
@pytest.mark.parametrize("T", [1, 4, 7, 8, 9, 15, 16, 17, 33])
@pytest.mark.parametrize("rows", [45, 40])
def test_isa_paths_agree_bitwise(isa, type_, layout, act, T, rows):
    """Every tier against scalar: the same activation bytes and the same matmul bits. T covers the 8-token
    tiles of the prefill kernels and their tails; rows of 16 at a time end in a part of a second group of 8
    (45) or in a lone group (40)."""
    cols = 576
    rng = np.random.default_rng(T + type_ + rows)
    raw = make_weights(type_, rows, cols, rng)
    w = weights_for(type_, layout, rows, cols, raw)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    res = {}
    for name in ("scalar", isa):
        with using(name):
            res[name] = (bytes(nat.quantize_act(type_, layout, cols, x, act)),
                         matmul(type_, layout, rows, cols, w, x, act=act))
    assert res["scalar"][0] == res[isa][0]
    assert np.array_equal(res["scalar"][1], res[isa][1])


@pytest.mark.parametrize("act", [A8, A8X2])
def test_mxfp4_extreme_scales(isa, act):
    """MXFP4's whole exponent range: the subnormal scales (e < 2) and the largest, whose values and products
    overflow to inf (as ggml's decoder's do): the rows decode as NumPy's codec does, bit for bit, and every tier
    gives scalar's bits (inf and nan included), decode and prefill."""
    from barellm.formats import quant

    rows, cols = 24, 256
    rng = np.random.default_rng(act)
    raw = make_weights(MXFP4, rows, cols, rng)
    blocks = raw.reshape(-1, 17)
    blocks[:, 0] = rng.choice([0, 1, 2, 3, 100, 127, 128, 200, 253, 254, 255], len(blocks))
    w = nat.repack(MXFP4, I8, rows, cols, raw.tobytes())
    with np.errstate(over="ignore"):
        want = quant.TYPES[MXFP4].to_float(raw.reshape(-1)).reshape(rows, cols)
    for r in range(rows):
        assert np.array_equal(np.asarray(nat.dequantize_row(MXFP4, I8, rows, cols, w, r)), want[r])
    for T in (1, 3, 9):
        x = rng.standard_normal((T, cols)).astype(np.float32)
        res = {}
        for name in ("scalar", isa):
            with using(name):
                res[name] = matmul(MXFP4, I8, rows, cols, w, x, act=act)
        assert np.array_equal(res["scalar"], res[isa], equal_nan=True)
        assert np.isinf(res["scalar"]).any() or np.isnan(res["scalar"]).any()


# ---- layouts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_", QUANT)
@pytest.mark.parametrize("rows", [1, 8, 21])
def test_repack_roundtrip(type_, rows):
    cols = 96
    raw = make_weights(type_, rows, cols, np.random.default_rng(rows))
    W = dequantize(raw, type_, rows, cols).astype(np.float32)
    packed = nat.repack(type_, I8, rows, cols, raw.tobytes())
    assert len(packed) == nat.matrix_bytes(type_, I8, rows, cols)
    assert len(packed) % 64 == 0 and len(packed) >= raw.size
    for layout, w in ((ROWS, raw.tobytes()), (I8, packed)):
        for r in range(rows):
            np.testing.assert_array_equal(np.asarray(nat.dequantize_row(type_, layout, rows, cols, w, r)), W[r])


def test_sizes():
    assert nat.matrix_bytes(Q4_1, ROWS, 576, 576) == 576 * 18 * 20
    assert nat.matrix_bytes(Q8_0, ROWS, 49152, 576) == 49152 * 18 * 34
    assert nat.matrix_bytes(Q4_1, I8, 576, 576) == 576 * 18 * 20  # 8 * row bytes is a multiple of 64 here
    assert nat.row_align(Q4_1, I8) == 8 and nat.row_align(Q4_1, ROWS) == 1
    assert nat.act_row_bytes(Q8_0, ROWS, 576) % 64 == 0
    assert nat.act_row_bytes(Q4_1, I8, 576, A8X2) == 1408  # 18 blocks x (64 + 12) bytes, to 64
    assert nat.act_supported(Q4_1, A8X2) and nat.act_supported(Q8_0, A8X2) and nat.act_supported(F32, A8)
    assert not nat.act_supported(F32, A8X2) and not nat.act_supported(12, A8X2) and not nat.act_supported(Q4_1, 2)


# ---- errors -------------------------------------------------------------------------------------------


def test_errors():
    x = np.zeros((2, 64), np.float32)
    w = make_weights(Q4_1, 8, 64, np.random.default_rng(0)).tobytes()
    with pytest.raises(ValueError, match="multiple of the block size"):
        nat.matmul(Q4_1, ROWS, 8, 48, w, np.zeros(48, np.float32))
    with pytest.raises(ValueError, match="bytes"):
        nat.matmul(Q4_1, ROWS, 8, 64, w[:-1], x)
    with pytest.raises(ValueError, match="multiple of cols"):
        nat.matmul(Q4_1, ROWS, 8, 64, w, np.zeros(65, np.float32))
    with pytest.raises(ValueError, match="float32"):
        nat.matmul(Q4_1, ROWS, 8, 64, w, np.zeros(64, np.float64))
    with pytest.raises(ValueError, match="not supported"):
        nat.matmul(7, ROWS, 8, 64, b"\0" * 8 * 48, np.zeros(64, np.float32))  # Q5_1: no kernel
    with pytest.raises(ValueError, match="not supported"):
        nat.repack(F32, I8, 8, 64, b"\0" * 8 * 64 * 4)
    with pytest.raises(ValueError, match="row range"):
        nat.matmul(Q4_1, ROWS, 8, 64, w, x, r0=0, r1=9)
    wi = nat.repack(Q4_1, I8, 8, 64, w)
    with pytest.raises(ValueError, match="alignment"):
        nat.matmul(Q4_1, I8, 8, 64, wi, x, r0=3, r1=8)
    with pytest.raises(ValueError, match="xq"):
        nat.matmul_q(Q4_1, ROWS, 8, 64, w, b"\0" * 10, 1)
    with pytest.raises(ValueError):
        nat.dequantize_row(Q4_1, ROWS, 8, 64, w, 8)
    with pytest.raises(ValueError, match="activation type"):
        nat.matmul(F32, ROWS, 8, 64, b"\0" * 8 * 64 * 4, x, act=A8X2)
    with pytest.raises(ValueError, match="activation type"):
        nat.quantize_act(Q4_1, ROWS, 64, x, 7)
    with pytest.raises(ValueError, match="xq"):  # Q8 activations handed to a Q8X2 matmul
        nat.matmul_q(Q4_1, ROWS, 8, 64, w, nat.quantize_act(Q4_1, ROWS, 64, x), 2, act=A8X2)
