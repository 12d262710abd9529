"""The Q5_0, Q3_K, Q4_K, Q5_K and Q6_K matmul kernels (quant_kq*.c) against NumPy, on every type x layout x ISA path.

What is checked:
- row access: every row read back from either layout equals barellm.formats.quant's decoding, bit for bit;
- matmul: against the exact product of the decoded weights and the quantized activations, within a float32
  rounding bound; against the float activations within the activation quantization bound;
- invariance: the result for one (t, r) is bit-identical for any T, any row split, both layouts and both
  ISA paths (the float work per output is fixed by quant_kq.h);
- extremes: the largest integer sums the formats allow (no int16 overflow in the SIMD paths);
- the real Gemma 3 270M tensors of these types.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from kernel_tiers import PRESENT, using

from barellm import _native as nat
from barellm.formats import quant

Q5_0, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K = 6, 8, 11, 12, 13, 14
ROWS, I8 = 0, 1
QK = 32
EPS = 2.0**-23  # float32 machine epsilon (twice the unit roundoff)

TYPES = (Q5_0, Q3_K, Q4_K, Q5_K, Q6_K)
UNIT = {Q5_0: 32, Q3_K: 256, Q4_K: 256, Q5_K: 256, Q6_K: 256}
UNIT_BYTES = {Q5_0: 22, Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210}
CASES = [(t, lay) for t in TYPES for lay in (ROWS, I8)]




# ---- weights ------------------------------------------------------------------------------------------


def _f16_bytes(v):
    return np.asarray(v, "<f2").view(np.uint8).reshape(-1, 2)


def make_weights(type_, rows, cols, rng, codec=False):
    """GGUF-ordered rows (uint8 [rows, row_bytes]): random bytes for the quants and scales (covering their
    whole range), finite f16 scales; codec=True: Q5_0 from barellm.formats.quant's encoder instead."""
    if codec and type_ == Q5_0:
        x = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 2, (rows, 1)).astype(np.float32)
        return quant.quantize(x, Q5_0)
    nu = rows * cols // UNIT[type_]
    b = rng.integers(0, 256, (nu, UNIT_BYTES[type_]), dtype=np.uint8)
    if type_ == Q5_0:
        b[:, 0:2] = _f16_bytes(rng.uniform(-0.05, 0.05, nu))
    elif type_ in (Q4_K, Q5_K):
        b[:, 0:2] = _f16_bytes(rng.uniform(0, 0.01, nu) * rng.choice([-1, 1], nu))
        b[:, 2:4] = _f16_bytes(rng.uniform(0, 0.02, nu))
    elif type_ == Q3_K:
        b[:, 108:110] = _f16_bytes(rng.uniform(-0.01, 0.01, nu))
    else:
        b[:, 208:210] = _f16_bytes(rng.uniform(-0.003, 0.003, nu))
    return b.reshape(rows, -1)


def decode_exact(raw, type_, rows, cols):
    """float64 (W, P): the weights computed exactly from their fields, and P = the magnitude the float32
    decoding rounds against (Q4_K: |d sc q| + |dmin m| per value; else |W|)."""
    nu = rows * cols // UNIT[type_]
    b = np.ascontiguousarray(raw).reshape(nu, UNIT_BYTES[type_])
    if type_ == Q5_0:
        d = b[:, 0:2].copy().view("<f2").astype(np.float64)
        qh = np.unpackbits(b[:, 2:6], axis=1, bitorder="little").astype(np.int64)
        qs = b[:, 6:22].astype(np.int64)
        q = np.concatenate([qs & 15, qs >> 4], axis=1) | (qh << 4)
        W = (q - 16) * d
        return W.reshape(rows, cols), np.abs(W).reshape(rows, cols)
    if type_ in (Q4_K, Q5_K):
        d = b[:, 0:2].copy().view("<f2").astype(np.float64)
        dmin = b[:, 2:4].copy().view("<f2").astype(np.float64)
        s = b[:, 4:16].astype(np.int64)
        sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], axis=1)
        m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
        off = 48 if type_ == Q5_K else 16
        qs = b[:, off:off + 128].astype(np.int64).reshape(nu, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=2).reshape(nu, 8, 32)
        if type_ == Q5_K:  # the fifth bit of sub-block j's value e: bit j of qh[e]
            qh = b[:, 16:48].astype(np.int64).reshape(nu, 1, 32)
            q = q | (((qh >> np.arange(8).reshape(1, 8, 1)) & 1) << 4)
        pos, neg = (d * sc)[:, :, None] * q, (dmin * m)[:, :, None] * np.ones_like(q)
        return (pos - neg).reshape(rows, cols), (np.abs(pos) + np.abs(neg)).reshape(rows, cols)
    if type_ == Q3_K:
        hm = b[:, 0:32].astype(np.int64).reshape(nu, 1, 1, 32)
        qs = b[:, 32:96].astype(np.int64).reshape(nu, 2, 1, 32)
        s = b[:, 96:108].astype(np.int64)
        i = np.arange(16)
        lo = np.where(i < 8, s[:, i % 8] & 15, s[:, i % 8] >> 4)
        sc = (lo | ((s[:, 8 + i % 4] >> (2 * (i // 4))) & 3) << 4) - 32
        d = b[:, 108:110].copy().view("<f2").astype(np.float64)
        k = np.arange(4).reshape(1, 1, 4, 1)
        q = ((qs >> (2 * k)) & 3) - 4 * (1 - ((hm >> (4 * np.arange(2).reshape(1, 2, 1, 1) + k)) & 1))
        W = q.reshape(nu, 16, 16) * (d * sc)[:, :, None]
        return W.reshape(rows, cols), np.abs(W).reshape(rows, cols)
    ql = b[:, 0:128].astype(np.int64).reshape(nu, 2, 2, 32)
    qh = b[:, 128:192].astype(np.int64).reshape(nu, 2, 1, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.int64)
    d = b[:, 208:210].copy().view("<f2").astype(np.float64)
    nib = np.concatenate([ql & 15, ql >> 4], axis=2)  # [nu, 2, 4, 32]: k = 0, 1 low; 2, 3 high
    q = nib | (((qh >> (2 * np.arange(4).reshape(1, 1, 4, 1))) & 3) << 4)
    W = (q.reshape(nu, 16, 16) - 32) * (d * sc)[:, :, None]
    return W.reshape(rows, cols), np.abs(W).reshape(rows, cols)


def weights_for(type_, layout, rows, cols, raw):
    raw = np.ascontiguousarray(raw).tobytes()
    return raw if layout == ROWS else nat.repack(type_, layout, rows, cols, raw)


# ---- activations --------------------------------------------------------------------------------------


def quantize_act_ref(x):
    """The 8-bit activation blocks in NumPy: (q int8 [T, nb, 32], d f32 [T, nb])."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, QK)
    d = np.abs(xb).max(axis=-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.rint(xb * inv[..., None]), -128, 127).astype(np.int8)
    return q, d


def matmul(type_, layout, rows, cols, w, x, **kw):
    return np.asarray(nat.matmul(type_, layout, rows, cols, w, np.ascontiguousarray(x, np.float32), **kw))


def n_terms(type_, cols):
    """float operations in one output's chain (see quant_kq.h)"""
    return cols // QK * (2 if type_ in (Q4_K, Q5_K) else 1)


def check_vs_numpy(got, raw, type_, rows, cols, x):
    W, P = decode_exact(raw, type_, rows, cols)
    T = x.shape[0]
    q, d = quantize_act_ref(x)
    xhat = (q.astype(np.float64) * d[..., None].astype(np.float64)).reshape(T, cols)
    # the integer sums are exact; each term takes one rounded scale product, each step of the chain one
    # rounding: at most (terms + 2) roundings of the magnitude S
    S = np.abs(xhat) @ P.T
    bound = (n_terms(type_, cols) + 2) * EPS * S + 1e-30
    np.testing.assert_array_less(np.abs(got - xhat @ W.T), bound)
    # vs the float activations: |x - xhat| <= d / 2 per value
    half_d = np.repeat(d.astype(np.float64) / 2, QK, axis=1)
    np.testing.assert_array_less(np.abs(got - x.astype(np.float64) @ W.T), bound + half_d @ np.abs(W).T)


# ---- tests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_", TYPES)
@pytest.mark.parametrize("rows", [1, 8, 13])
def test_rows_match_codec(type_, rows):
    """dequantize_row from GGUF rows and from the interleaved layout = barellm.formats.quant.dequantize, bitwise;
    and the exact decoding used as the oracle here agrees with it."""
    cols = 2 * UNIT[type_] if type_ != Q5_0 else 96
    rng = np.random.default_rng(rows + type_)
    raw = make_weights(type_, rows, cols, rng)
    ref = quant.dequantize(raw.reshape(-1), type_, (rows, cols))
    W, P = decode_exact(raw, type_, rows, cols)
    assert np.all(np.abs(ref - W) <= P * 2.0**-24)
    packed = nat.repack(type_, I8, rows, cols, raw.tobytes())
    assert len(packed) == nat.matrix_bytes(type_, I8, rows, cols) and len(packed) % 64 == 0
    for layout, w in ((ROWS, raw.tobytes()), (I8, packed)):
        for r in range(rows):
            got = np.asarray(nat.dequantize_row(type_, layout, rows, cols, w, r))
            np.testing.assert_array_equal(got, ref[r])


K_SHAPES = [(1, 256), (7, 512), (8, 256), (13, 1024), (29, 768), (40, 2048)]
SHAPES = {Q5_0: [(1, 32), (7, 64), (8, 96), (13, 640), (29, 160), (40, 1024)], Q3_K: K_SHAPES, Q4_K: K_SHAPES,
          Q5_K: K_SHAPES, Q6_K: K_SHAPES}


@pytest.mark.parametrize("type_,layout", CASES)
@pytest.mark.parametrize("shape", range(6))
def test_matmul_vs_numpy(isa, type_, layout, shape):
    rows, cols = SHAPES[type_][shape]
    rng = np.random.default_rng(rows * 1000 + cols + type_)
    raw = make_weights(type_, rows, cols, rng, codec=shape % 2 == 1)
    T = (1, 3, 5, 2, 9, 4)[shape]
    x = rng.standard_normal((T, cols)).astype(np.float32) * rng.uniform(0.1, 10, (T, 1)).astype(np.float32)
    got = matmul(type_, layout, rows, cols, weights_for(type_, layout, rows, cols, raw), x)
    assert got.shape == (T, rows) and got.dtype == np.float32
    check_vs_numpy(got, raw, type_, rows, cols, x)


@pytest.mark.parametrize("type_,layout", CASES)
@pytest.mark.parametrize("rows", [1, 16, 19, 24, 37, 45])
def test_invariance_T_and_splits(isa, type_, layout, rows):
    """One (t, r) gives the same bits whatever T, the row range and the other rows/vectors are."""
    cols = 512 if type_ != Q5_0 else 160
    rng = np.random.default_rng(rows + 31 * type_ + layout)
    raw = make_weights(type_, rows, cols, rng)
    w = weights_for(type_, layout, rows, cols, raw)
    T = 13
    x = rng.standard_normal((T, cols)).astype(np.float32)
    full = matmul(type_, layout, rows, cols, w, x)
    singles = np.concatenate([matmul(type_, layout, rows, cols, w, x[t : t + 1]) for t in range(T)])
    assert np.array_equal(full, singles)
    for k in list(range(2, 10)) + [12]:
        assert np.array_equal(matmul(type_, layout, rows, cols, w, x[:k]), full[:k]), k
        assert np.array_equal(matmul(type_, layout, rows, cols, w, x[T - k :]), full[T - k :]), k
    align = nat.row_align(type_, layout)
    xq = nat.quantize_act(type_, layout, cols, x)
    xq1 = nat.quantize_act(type_, layout, cols, x[:1])  # T = 1: the decode path (groups from two streams)
    for _ in range(6):
        cuts = sorted(set(int(c) for c in rng.integers(0, rows // align + 1, 3) * align) | {0, rows})
        out, out1 = np.zeros_like(full), np.zeros_like(full[:1])
        for r0, r1 in zip(cuts[:-1], cuts[1:], strict=True):
            part = np.asarray(nat.matmul_q(type_, layout, rows, cols, w, xq, T, r0=r0, r1=r1))
            assert not part[:, :r0].any() and not part[:, r1:].any()
            out[:, r0:r1] = part[:, r0:r1]
            out1[:, r0:r1] = np.asarray(nat.matmul_q(type_, layout, rows, cols, w, xq1, 1, r0=r0, r1=r1))[:, r0:r1]
        assert np.array_equal(out, full), cuts
        assert np.array_equal(out1, full[:1]), cuts


@pytest.mark.parametrize("type_", TYPES)
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 7, 8, 9, 16, 33])
@pytest.mark.parametrize("rows", [45, 64])
def test_paths_agree_bitwise(isa, type_, T, rows):
    """Every tier against scalar, GGUF rows and interleaved: the same bits for every output (the lean prefill
    paths from T = 8, tails of tokens and of row groups included)."""
    cols = 1024 if type_ != Q5_0 else 640
    rng = np.random.default_rng(T + type_ + rows)
    raw = make_weights(type_, rows, cols, rng)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    res = []
    for name in ("scalar", isa):
        with using(name):
            for layout in (ROWS, I8):
                res.append(matmul(type_, layout, rows, cols, weights_for(type_, layout, rows, cols, raw), x))
    for r in res[1:]:
        assert np.array_equal(res[0], r)


@pytest.mark.parametrize("type_,layout", CASES)
@pytest.mark.parametrize("T", [1, 4, 11])
def test_extremes(isa, type_, layout, T):
    """The largest integer sums the formats allow: every quant and scale at either end of its range, with
    activations at +-127 (no overflow in the SIMD paths' 16-bit sums); T = 1 takes the decode path (at one
    thread: groups from two streams at once), T = 11 the prefill path (values unpacked once per group, 16
    rows at a time), with a leftover group of 8."""
    rows, cols = 24, 2 * UNIT[type_] if type_ != Q5_0 else 64
    nu = rows * cols // UNIT[type_]
    n = max(T, 5)
    x = np.ones((n, cols), np.float32)
    x[1] = -1
    x[2, ::2] = -1
    x[3] = np.where(np.arange(cols) % 3 == 0, -1.0, 1.0)
    x[4:] = np.where(np.arange(cols) % 2 == 0, 1.0, -1.0) * np.arange(4, n)[:, None] % 3 - 1
    xs = [x[i : i + 1] for i in range(n)] if T == 1 else [x]   # one token: each pattern in its own call
    for fill in (0x00, 0xFF, 0x55):
        b = np.full((nu, UNIT_BYTES[type_]), fill, np.uint8)
        if type_ == Q5_0:
            b[:, 0:2] = _f16_bytes(np.full(nu, 0.5))
        elif type_ in (Q4_K, Q5_K):
            b[:, 0:4] = _f16_bytes(np.full(2 * nu, 0.25)).reshape(nu, 4)
        elif type_ == Q3_K:
            b[:, 108:110] = _f16_bytes(np.full(nu, 0.125))
        else:
            b[:, 208:210] = _f16_bytes(np.full(nu, -0.125))
        raw = b.reshape(rows, -1)
        for xt in xs:
            got = matmul(type_, layout, rows, cols, weights_for(type_, layout, rows, cols, raw), xt)
            check_vs_numpy(got, raw, type_, rows, cols, xt)


def test_sizes_and_errors():
    assert nat.matrix_bytes(Q4_K, ROWS, 640, 1024) == 640 * 4 * 144
    assert nat.matrix_bytes(Q6_K, I8, 640, 2048) == 640 * 8 * 210  # 8 * row bytes is a multiple of 64
    assert nat.matrix_bytes(Q5_0, I8, 1024, 640) == 1024 * 20 * 22
    assert nat.matrix_bytes(Q5_0, I8, 3, 32) == 192
    for t in TYPES:
        assert nat.row_align(t, I8) == 8 and nat.row_align(t, ROWS) == 1
        assert nat.act_row_bytes(t, ROWS, 1024) == nat.act_row_bytes(Q8_0, ROWS, 1024)
    with pytest.raises(ValueError, match="multiple of the block size 256"):
        nat.matmul(Q4_K, ROWS, 8, 640, b"\0" * 8 * 360, np.zeros(640, np.float32))
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        nat.matmul(Q5_0, ROWS, 8, 48, b"\0" * 8 * 33, np.zeros(48, np.float32))
    with pytest.raises(ValueError, match="bytes"):
        nat.matmul(Q6_K, ROWS, 8, 256, b"\0" * (8 * 210 - 1), np.zeros(256, np.float32))


# ---- the real model -----------------------------------------------------------------------------------


def gguf_tensor_table(path):
    """(data offset, {name: (type, dims innermost first, offset)}) of a GGUF v2/v3 file: a small reader of
    the header alone (the metadata is skipped, not decoded)."""
    import struct

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    with open(path, "rb") as f:
        def rd(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))

        def skip(vtype):
            if vtype == 8:
                f.seek(rd("Q")[0], 1)
            elif vtype == 9:
                etype, n = rd("IQ")
                if etype in sizes:
                    f.seek(n * sizes[etype], 1)
                else:
                    for _ in range(n):
                        skip(etype)
            else:
                f.seek(sizes[vtype], 1)

        magic, version, n_tensors, n_kv = rd("4sIQQ")
        assert magic == b"GGUF" and version in (2, 3)
        align = 32
        for _ in range(n_kv):
            key = f.read(rd("Q")[0])
            vtype = rd("I")[0]
            if key == b"general.alignment":
                align = rd("I")[0]
            else:
                skip(vtype)
        table = {}
        for _ in range(n_tensors):
            name = f.read(rd("Q")[0]).decode()
            dims = rd(f"{rd('I')[0]}Q")
            type_, off = rd("IQ")
            table[name] = (type_, dims, off)
        return -(-f.tell() // align) * align, table


@pytest.fixture(scope="module")
def gemma_tensors(gemma_gguf):
    """One tensor of each type and shape of these kernels from Gemma 3 270M: name -> (type, raw rows)."""
    if not os.path.exists(gemma_gguf):
        pytest.skip(f"{gemma_gguf} not found")
    start, table = gguf_tensor_table(gemma_gguf)
    seen, out = set(), {}
    for name, (type_, dims, off) in table.items():
        if type_ in TYPES and (type_, dims) not in seen:
            seen.add((type_, dims))
            rows, cols = dims[1], dims[0]
            n = rows * cols // UNIT[type_] * UNIT_BYTES[type_]
            raw = np.fromfile(gemma_gguf, np.uint8, n, offset=start + off)
            out[name] = (type_, raw.reshape(rows, -1))
    return out


@pytest.mark.model
def test_gemma_tensors(gemma_tensors):
    assert {t for t, _ in gemma_tensors.values()} == {Q5_0, Q4_K, Q6_K}
    rng = np.random.default_rng(0)
    for name, (type_, raw) in gemma_tensors.items():
        rows, cols = raw.shape[0], raw.shape[1] // UNIT_BYTES[type_] * UNIT[type_]
        x = rng.standard_normal((11, cols)).astype(np.float32) * 3
        res = []
        for tier in PRESENT:
            with using(tier):
                for layout in (ROWS, I8):
                    w = weights_for(type_, layout, rows, cols, raw)
                    full = matmul(type_, layout, rows, cols, w, x)
                    assert np.array_equal(full[:1], matmul(type_, layout, rows, cols, w, x[:1])), name
                    res.append(full)
        for r in res[1:]:
            assert np.array_equal(res[0], r), name
        check_vs_numpy(res[0], raw, type_, rows, cols, x)
        W = quant.dequantize(raw.reshape(-1), type_, (rows, cols))
        w = weights_for(type_, I8, rows, cols, raw)
        for r in (0, rows // 2 + 3, rows - 1):
            np.testing.assert_array_equal(np.asarray(nat.dequantize_row(type_, I8, rows, cols, w, r)), W[r])
