"""The type-traits table: one `QuantType` row per ggml tensor type.

The idea is ggml's `type_traits`: everything the rest of barellm needs to know about a storage type
(its id, block layout, how to turn its bytes into float32 and back) lives in one row, so supporting a new
type means adding a row here and nothing else in the Python layer.

Every ggml type id is listed so that a file using one we cannot decode fails with the type's name rather
than a bare number; rows without converters have `supported == False`. Rows for layouts ggml has removed
have `block_size == 0`.

Decoding matches ggml's `dequantize_row_*` (and the `gguf` package, which is our test oracle) bit for bit:
each value is computed with the same float32 operations in the same order. Encoding matches ggml's
`quantize_row_*_ref` for the types that have `from_float`, including its rounding rules (truncation of
`x + 0.5` where ggml truncates, round-half-away-from-zero where ggml calls `roundf`).

Each supported row with an encoder also carries `max_error`: a per-block bound on
|x - to_float(from_float(x))| that tests hold the encoders to. The bounds include the error of storing the
block scale (and minimum) as float16, so they are exact statements about the codec, not estimates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from barellm.errors import FormatError
from barellm.formats.ggml import F32 as _F32
from barellm.formats.ggml import QK, QK_K
from barellm.formats.ggml import inverse as _inverse
from barellm.formats.ggml import roundf as _roundf

__all__ = [
    "QuantType",
    "TYPES",
    "BY_NAME",
    "SUPPORTED",
    "get",
    "by_name",
    "type_name",
    "row_bytes",
    "nbytes",
    "dequantize",
    "quantize",
]

ToFloat = Callable[[np.ndarray], np.ndarray]
FromFloat = Callable[[np.ndarray], np.ndarray]
MaxError = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class QuantType:
    """One row of the table: a ggml type, its block layout and its codecs (None where barellm has none)."""

    id: int                                # ggml's type id (GGUF's)
    name: str                              # "q4_1"
    block_size: int                        # elements per block (0: a layout ggml has removed)
    block_bytes: int                       # bytes per block
    to_float: ToFloat | None = None        # uint8 [n_blocks * block_bytes] -> float32 [n_blocks * block_size]
    from_float: FromFloat | None = None    # float32 [n_blocks * block_size] -> uint8 [n_blocks * block_bytes]
    max_error: MaxError | None = None      # float32 blocks [n_blocks, block_size] -> the largest
                                           # |x - to_float(from_float(x))| allowed in each block

    @property
    def supported(self) -> bool:
        """Whether barellm can decode this type."""
        return self.to_float is not None

    @property
    def has_layout(self) -> bool:
        """Whether the block layout is known (false only for layouts ggml has removed)."""
        return self.block_size > 0

    def __str__(self) -> str:
        return self.name


# --- block layouts -------------------------------------------------------------------------------------
# NumPy structured dtypes mirroring ggml's block_* structs (all packed, little-endian). Viewing raw bytes
# through them gives zero-copy access to each field.

_BLOCK_Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", (QK,))])
_BLOCK_Q4_0 = np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))])
# MXFP4 (OCP microscaling, as gpt-oss files store their experts): an E8M0 exponent, then 32 FP4 (E2M1) codes.
_BLOCK_MXFP4 = np.dtype([("e", "u1"), ("qs", "u1", (QK // 2,))])
# The E2M1 values doubled (ggml's kvalues_mxfp4): the block's scale is then 2^(e - 128), half of 2^(e - 127).
_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
_BLOCK_Q4_1 = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (QK // 2,))])
# qh is a little-endian uint32 in ggml; as bytes it unpacks straight into per-element bits.
_BLOCK_Q5_0 = np.dtype([("d", "<f2"), ("qh", "u1", (4,)), ("qs", "u1", (QK // 2,))])
_BLOCK_Q5_1 = np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "u1", (4,)), ("qs", "u1", (QK // 2,))])
_BLOCK_Q4_K = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qs", "u1", (QK_K // 2,))])
_BLOCK_Q5_K = np.dtype(
    [("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qh", "u1", (QK_K // 8,)), ("qs", "u1", (QK_K // 2,))]
)
_BLOCK_Q3_K = np.dtype(
    [("hmask", "u1", (QK_K // 8,)), ("qs", "u1", (QK_K // 4,)), ("scales", "u1", (12,)), ("d", "<f2")]
)
_BLOCK_Q6_K = np.dtype(
    [("ql", "u1", (QK_K // 2,)), ("qh", "u1", (QK_K // 4,)), ("scales", "i1", (QK_K // 16,)), ("d", "<f2")]
)

# Work through large tensors this many output values at a time: the temporaries then stay in cache,
# which makes decoding several times faster than whole-array passes and bounds its extra memory.
_CHUNK_VALUES = 1 << 16


def _blocks(raw: np.ndarray, layout: np.dtype) -> np.ndarray:
    return raw.view(layout)


def _decode_blockwise(
    raw: np.ndarray, layout: np.dtype, block_size: int, decode: Callable[[np.ndarray, np.ndarray], None]
) -> np.ndarray:
    blocks = _blocks(raw, layout)
    out = np.empty((blocks.shape[0], block_size), dtype=_F32)
    step = max(1, _CHUNK_VALUES // block_size)
    for start in range(0, blocks.shape[0], step):
        decode(blocks[start : start + step], out[start : start + step])
    return out.reshape(-1)


def _f16(field: np.ndarray) -> np.ndarray:
    return field.astype(_F32)


# --- decoders ------------------------------------------------------------------------------------------


def _f32_to_float(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f4").astype(_F32)


def _f16_to_float(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f2").astype(_F32)


def _bf16_to_float(raw: np.ndarray) -> np.ndarray:
    # bf16 is the top half of an f32: widen and shift into place.
    return (raw.view("<u2").astype(np.uint32) << 16).view(_F32)


def _dec_q8_0(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(b["qs"], _f16(b["d"])[:, None], out=out, dtype=_F32)


def _split_nibbles(qs: np.ndarray, out: np.ndarray) -> None:
    """ggml packs element j in the low nibble and element j + half in the high nibble of byte j."""
    np.bitwise_and(qs, 0x0F, out=out[..., 0, :])
    np.right_shift(qs, 4, out=out[..., 1, :])


def _dec_q4_0(b: np.ndarray, out: np.ndarray) -> None:
    o = out.reshape(-1, 2, QK // 2)
    _split_nibbles(b["qs"], o)
    o -= 8
    o *= _f16(b["d"])[:, None, None]


def _dec_mxfp4(b: np.ndarray, out: np.ndarray) -> None:
    o = out.reshape(-1, 2, QK // 2)
    _split_nibbles(b["qs"], o)
    o[:] = _MXFP4_VALUES[o.astype(np.int64)]
    with np.errstate(over="ignore"):  # the largest exponents overflow float32 to inf, as ggml's decoder does
        o *= np.ldexp(np.float32(1), b["e"].astype(np.int32) - 128).astype(np.float32)[:, None, None]


def _dec_q4_1(b: np.ndarray, out: np.ndarray) -> None:
    o = out.reshape(-1, 2, QK // 2)
    _split_nibbles(b["qs"], o)
    o *= _f16(b["d"])[:, None, None]
    o += _f16(b["m"])[:, None, None]


def _q5_values(b: np.ndarray) -> np.ndarray:
    """The 5-bit values of Q5_0/Q5_1 blocks: nibbles as in Q4, the fifth bit of element j in qh bit j."""
    q = np.empty((b.shape[0], 2, QK // 2), dtype=np.uint8)
    np.bitwise_and(b["qs"], 0x0F, out=q[:, 0])
    np.right_shift(b["qs"], 4, out=q[:, 1])
    q = q.reshape(-1, QK)
    q |= np.unpackbits(b["qh"], axis=-1, bitorder="little") << 4
    return q


def _dec_q5_0(b: np.ndarray, out: np.ndarray) -> None:
    np.subtract(_q5_values(b), 16, out=out, dtype=_F32, casting="unsafe")
    out *= _f16(b["d"])[:, None]


def _dec_q5_1(b: np.ndarray, out: np.ndarray) -> None:
    out[...] = _q5_values(b)
    out *= _f16(b["d"])[:, None]
    out += _f16(b["m"])[:, None]


def _k4_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K super-block (ggml's get_scale_min_k4, vectorized).

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for the
    mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    """
    s = scales.reshape(-1, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def _dec_q4_k(b: np.ndarray, out: np.ndarray) -> None:
    sc, mn = _k4_scales_mins(b["scales"])
    # ggml computes d * sc and dmin * m in float32 first, then d1 * q - m1.
    d1 = (_f16(b["d"])[:, None] * sc).reshape(-1, 4, 2, 1)
    m1 = (_f16(b["dmin"])[:, None] * mn).reshape(-1, 4, 2, 1)
    o = out.reshape(-1, 4, 2, 32)
    _split_nibbles(b["qs"].reshape(-1, 4, 32), o)
    o *= d1
    o -= m1


_Q5_K_SHIFTS = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)


def _dec_q5_k(b: np.ndarray, out: np.ndarray) -> None:
    # As Q4_K, plus a fifth bit: value l of sub-block s (32 values each) takes bit s of qh[l].
    n = b.shape[0]
    sc, mn = _k4_scales_mins(b["scales"])
    d1 = (_f16(b["d"])[:, None] * sc).reshape(n, 4, 2, 1)
    m1 = (_f16(b["dmin"])[:, None] * mn).reshape(n, 4, 2, 1)
    q = np.empty((n, 4, 2, 32), dtype=np.uint8)
    qs = b["qs"].reshape(n, 4, 32)
    np.bitwise_and(qs, 0x0F, out=q[:, :, 0])
    np.right_shift(qs, 4, out=q[:, :, 1])
    q |= (((b["qh"][:, None, :] >> _Q5_K_SHIFTS) & 1) << 4).reshape(n, 4, 2, 32)
    o = out.reshape(n, 4, 2, 32)
    o[...] = q
    o *= d1
    o -= m1


def _q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """The 16 six-bit scales of Q3_K super-blocks, minus 32: scale i takes its low 4 bits from byte i % 8
    (the low nibble for i < 8, the high one after) and its top 2 from bits 2 (i / 4), +1 of byte 8 + i % 4."""
    s = scales.astype(np.int16)
    lo = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=-1)
    hi = np.concatenate([(s[:, 8:12] >> (2 * k)) & 3 for k in range(4)], axis=-1)
    return (lo | (hi << 4)) - 32


_Q3_K_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
_Q3_K_HBITS = (4 * np.arange(2).reshape(1, 2, 1, 1) + np.arange(4).reshape(1, 1, 4, 1)).astype(np.uint8)


def _dec_q3_k(b: np.ndarray, out: np.ndarray) -> None:
    # Value 128 h + 32 k + l: 2 bits at 2k of qs[32 h + l], minus 4 unless bit 4h + k of hmask[l] is set;
    # ggml computes dl = d * (sc - 32) first, then dl * q.
    n = b.shape[0]
    low = (b["qs"].reshape(n, 2, 1, 32) >> _Q3_K_SHIFTS) & 3
    high = (b["hmask"].reshape(n, 1, 1, 32) >> _Q3_K_HBITS) & 1
    q = low.astype(np.int8) - ((1 - high) * 4).astype(np.int8)
    dl = _f16(b["d"])[:, None] * _q3_k_scales(b["scales"]).astype(_F32)
    o = out.reshape(n, 16, 16)
    o[...] = q.reshape(n, 16, 16)
    o *= dl[:, :, None]


_Q6_K_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


def _dec_q6_k(b: np.ndarray, out: np.ndarray) -> None:
    # Each 128-value half takes 64 bytes of ql and 32 of qh. Values l, l+32 use the low nibbles of ql[l]
    # and ql[l+32], values l+64, l+96 their high nibbles; qh[l] holds the top two bits of all four.
    n = b.shape[0]
    ql = b["ql"].reshape(n, 2, 2, 32)
    q = np.empty((n, 2, 4, 32), dtype=np.uint8)
    np.bitwise_and(ql, 0x0F, out=q[:, :, 0:2])
    np.right_shift(ql, 4, out=q[:, :, 2:4])
    high = (b["qh"].reshape(n, 2, 1, 32) >> _Q6_K_SHIFTS) & 0x03
    q |= high << 4
    o = out.reshape(n, 2, 4, 2, 16)
    np.subtract(q.reshape(n, 2, 4, 2, 16), 32, out=o, dtype=_F32, casting="unsafe")
    o *= (_f16(b["d"])[:, None] * b["scales"]).reshape(n, 2, 4, 2, 1)


def _dequantizer(layout: np.dtype, block_size: int, decode: Callable[[np.ndarray, np.ndarray], None]) -> ToFloat:
    def to_float(raw: np.ndarray) -> np.ndarray:
        return _decode_blockwise(raw, layout, block_size, decode)

    to_float.__name__ = f"to_float_{decode.__name__.removeprefix('_dec_')}"
    return to_float


# --- encoders (ggml's quantize_row_*_ref) --------------------------------------------------------------


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The value of largest magnitude in each block, keeping its sign; the first one on ties, as ggml."""
    i = np.abs(x).argmax(axis=-1)[:, None]
    return np.take_along_axis(x, i, axis=-1)[:, 0]


def _as_blocks(x: np.ndarray, block_size: int) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=_F32).reshape(-1, block_size)


def _quantizer(layout: np.dtype, block_size: int, encode: Callable[[np.ndarray], np.ndarray]) -> FromFloat:
    """An encoder working through the blocks a chunk at a time, as decoding does (the searches' temporaries
    stay in cache)."""
    def from_float(x: np.ndarray) -> np.ndarray:
        xb = _as_blocks(x, block_size)
        step = max(1, _CHUNK_VALUES // block_size)
        out = np.empty(xb.shape[0], dtype=layout)
        for start in range(0, xb.shape[0], step):
            out[start:start + step] = encode(xb[start:start + step])
        return out.view(np.uint8)

    from_float.__name__ = f"from_float_{encode.__name__.strip('_').removesuffix('_encode')}"
    return from_float


def _f32_from_float(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype="<f4").view(np.uint8).reshape(-1)


def _f16_from_float(x: np.ndarray) -> np.ndarray:
    # NumPy converts with round-to-nearest-even, as ggml's GGML_FP32_TO_FP16 does.
    return np.asarray(x, dtype=_F32).astype("<f2").view(np.uint8).reshape(-1)


def _bf16_from_float(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16: round to nearest even; NaNs stay NaN (quieted) instead of rounding."""
    u = np.ascontiguousarray(x, dtype="<f4").view(np.uint32).reshape(-1)
    rounded = (u.astype(np.uint64) + (0x7FFF + ((u >> 16) & 1))) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    out = np.where(nan, (u >> 16) | 64, rounded).astype("<u2")
    return out.view(np.uint8)


def _q8_0_from_float(x: np.ndarray) -> np.ndarray:
    xb = _as_blocks(x, QK)
    d = np.abs(xb).max(axis=-1) / _F32(127)
    out = np.empty(xb.shape[0], dtype=_BLOCK_Q8_0)
    out["d"] = d
    out["qs"] = _roundf(xb * _inverse(d)[:, None])
    return out.view(np.uint8)


def _symmetric_quants(xb: np.ndarray, half: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0's and Q5_0's rounding (half = 8, 16): the scale d = -signed_absmax / half and each value's
    MIN(2 half - 1, (int8_t)(x*id + half + 0.5f)), i.e. truncation; the sum is never negative."""
    d = _signed_absmax(xb) / _F32(-half)
    q = np.minimum(np.trunc(xb * _inverse(d)[:, None] + _F32(half + 0.5)), 2 * half - 1).astype(np.uint8)
    return d, q


def _offset_quants(xb: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1's and Q5_1's rounding (nmax = 15, 31): the minimum, the scale d = (max - min) / nmax and each value's
    (int)((x - min)*id + 0.5f). ggml clamps only Q4_1's; (max - min) * id + 0.5 cannot pass nmax, so the clamp
    only guards NaN."""
    lo = xb.min(axis=-1)
    d = (xb.max(axis=-1) - lo) / _F32(nmax)
    q = np.minimum(np.trunc((xb - lo[:, None]) * _inverse(d)[:, None] + _F32(0.5)), nmax).astype(np.uint8)
    return lo, d, q


def _q4_0_from_float(x: np.ndarray) -> np.ndarray:
    xb = _as_blocks(x, QK)
    out = np.empty(xb.shape[0], dtype=_BLOCK_Q4_0)
    out["d"], q = _symmetric_quants(xb, 8)
    out["qs"] = q[:, : QK // 2] | (q[:, QK // 2 :] << 4)
    return out.view(np.uint8)


def _q4_1_from_float(x: np.ndarray) -> np.ndarray:
    xb = _as_blocks(x, QK)
    out = np.empty(xb.shape[0], dtype=_BLOCK_Q4_1)
    out["m"], out["d"], q = _offset_quants(xb, 15)
    out["qs"] = q[:, : QK // 2] | (q[:, QK // 2 :] << 4)
    return out.view(np.uint8)


def _q5_0_from_float(x: np.ndarray) -> np.ndarray:
    xb = _as_blocks(x, QK)
    out = np.empty(xb.shape[0], dtype=_BLOCK_Q5_0)
    out["d"], q = _symmetric_quants(xb, 16)
    _pack_q5(out, q)
    return out.view(np.uint8)


def _q5_1_from_float(x: np.ndarray) -> np.ndarray:
    xb = _as_blocks(x, QK)
    out = np.empty(xb.shape[0], dtype=_BLOCK_Q5_1)
    out["m"], out["d"], q = _offset_quants(xb, 31)
    _pack_q5(out, q)
    return out.view(np.uint8)


def _pack_q5(out: np.ndarray, q: np.ndarray) -> None:
    out["qh"] = np.packbits(q >> 4, axis=-1, bitorder="little")
    out["qs"] = (q[:, : QK // 2] & 0x0F) | ((q[:, QK // 2 :] & 0x0F) << 4)


# --- Q5_K (ggml's quantize_row_q5_K_ref) ---------------------------------------------------------------
# The same search as ggml's, evaluated in float32 with each C expression's operations in its order (no fused
# multiply-adds); the loops over a sub-block's 32 values stay sequential (the sums are order-dependent) and
# run over all sub-blocks at once.


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even (it adds 1.5 * 2^23), as np.rint does on float32. ggml asserts
    |v| <= 4194303; every caller clamps the result to a few bits, so larger values are clamped here first."""
    return np.rint(np.clip(v, -4194303, 4194303)).astype(np.int32)


def _make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
                      nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's make_qkx2_quants (use_mad false) on rows of x: (scale, the_min, L) per row."""
    n = x.shape[1]
    mn, mx = x.min(axis=1), x.max(axis=1)
    sum_w, sum_x = w[:, 0].copy(), w[:, 0] * x[:, 0]
    for i in range(1, n):
        sum_w += w[:, i]
        sum_x += w[:, i] * x[:, i]
    mn = np.minimum(mn, _F32(0))
    flat = mx == mn
    rng_ = np.where(flat, _F32(1), mx - mn)
    iscale = _F32(nmax) / rng_
    scale = _F32(1) / iscale
    L = np.clip(_nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    best = np.zeros_like(sum_w)
    for i in range(n):
        diff = scale * L[:, i].astype(_F32) + mn - x[:, i]
        best += w[:, i] * (diff * diff)
    for step in range(nstep + 1):
        iscale = (_F32(rmin) + _F32(rdelta) * _F32(step) + _F32(nmax)) / rng_
        Laux = np.clip(_nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
        lf = Laux.astype(_F32)
        sum_l = np.zeros_like(sum_w)
        sum_l2 = np.zeros_like(sum_w)
        sum_xl = np.zeros_like(sum_w)
        for i in range(n):
            wl = w[:, i] * lf[:, i]
            sum_l += wl
            sum_l2 += wl * lf[:, i]
            sum_xl += wl * x[:, i]
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = np.where(ok, D, _F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / Ds
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        pos = this_min > 0
        this_min = np.where(pos, _F32(0), this_min)
        this_scale = np.where(pos, sum_xl / np.where(sum_l2 != 0, sum_l2, _F32(1)), this_scale)
        cur = np.zeros_like(sum_w)
        for i in range(n):
            diff = this_scale * lf[:, i] + this_min - x[:, i]
            cur += w[:, i] * (diff * diff)
        better = ok & (cur < best) & ~flat
        L = np.where(better[:, None], Laux, L)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    scale = np.where(flat, _F32(0), scale)
    L = np.where(flat[:, None], 0, L)
    return scale.astype(_F32), (-mn).astype(_F32), L


def _pack_k4_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block into Q4_K/Q5_K's 12 bytes (the inverse of _k4_scales_mins)."""
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0x0F) | ((lm[:, 4:8] & 0x0F) << 4)
    return out


def _q5_k_encode(xb: np.ndarray) -> np.ndarray:
    n = xb.shape[0]
    xs = xb.reshape(n * 8, 32)
    sum_x2 = np.zeros(n * 8, _F32)
    for i in range(32):
        sum_x2 += xs[:, i] * xs[:, i]
    av_x = np.sqrt(sum_x2 / _F32(32))
    weights = av_x[:, None] + np.abs(xs)
    scales, mins, L = _make_qkx2_quants(xs, weights, 31, -0.5, 0.1, 15)
    scales, mins, L = scales.reshape(n, 8), mins.reshape(n, 8), L.reshape(n, 8, 32)
    max_scale = np.maximum(scales.max(axis=1), _F32(0))
    max_min = np.maximum(mins.max(axis=1), _F32(0))
    inv_scale = np.where(max_scale > 0, _F32(63) / np.where(max_scale > 0, max_scale, _F32(1)), _F32(0))
    inv_min = np.where(max_min > 0, _F32(63) / np.where(max_min > 0, max_min, _F32(1)), _F32(0))
    # nearest_int's int is stored in a uint8 (wrapping), then capped at 63
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales).astype(np.uint8), 63)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins).astype(np.uint8), 63)
    out = np.zeros(n, dtype=_BLOCK_Q5_K)
    out["scales"] = _pack_k4_scales(ls, lm)
    out["d"] = max_scale / _F32(63)
    out["dmin"] = max_min / _F32(63)
    sc, m = _k4_scales_mins(out["scales"])
    d = _f16(out["d"])[:, None] * sc.astype(_F32)
    dm = _f16(out["dmin"])[:, None] * m.astype(_F32)
    requant = np.clip(_nearest_int((xb.reshape(n, 8, 32) + dm[:, :, None]) / np.where(d != 0, d, _F32(1))[:, :, None]),
                      0, 31)
    L = np.where((d != 0)[:, :, None], requant, L).astype(np.uint8)  # a zero scale keeps the search's values
    out["qh"] = np.bitwise_or.reduce((L >> 4) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1), axis=1)
    lq = (L & 0x0F).reshape(n, 4, 2, 32)
    out["qs"] = (lq[:, :, 0] | (lq[:, :, 1] << 4)).reshape(n, 128)
    return out


_q5_k_from_float = _quantizer(_BLOCK_Q5_K, QK_K, _q5_k_encode)


# --- Q3_K (ggml's quantize_row_q3_K_ref) ---------------------------------------------------------------

_GROUP_MAX_EPS = _F32(1e-15)


def _make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_q3_quants with do_rmse on rows of x: (scale, L in 0..2 nmax - 1) per row. Each pass over a
    row's values updates its sums as it goes (sequential); a pass that changes nothing leaves the state as
    it was, so running all five passes equals ggml's early exit."""
    n = x.shape[1]
    i_max = np.abs(x).argmax(axis=1)  # the first of equal magnitudes, as ggml's strict >
    mx = x[np.arange(x.shape[0]), i_max]
    zero = np.abs(mx) < _GROUP_MAX_EPS
    iscale = _F32(-nmax) / np.where(zero, _F32(1), mx)
    L = np.clip(_nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
    sumlx = np.zeros(x.shape[0], _F32)
    suml2 = np.zeros(x.shape[0], _F32)
    for i in range(n):
        w = x[:, i] * x[:, i]
        lf = L[:, i].astype(_F32)
        sumlx += w * x[:, i] * lf
        suml2 += w * lf * lf
    for _ in range(5):
        for i in range(n):
            w = x[:, i] * x[:, i]
            li = L[:, i].astype(_F32)
            slx = sumlx - w * x[:, i] * li
            pos = slx > 0
            sl2 = suml2 - w * li * li
            new_l = np.clip(_nearest_int(x[:, i] * sl2 / np.where(pos, slx, _F32(1))), -nmax, nmax - 1)
            nf = new_l.astype(_F32)
            slx2 = slx + w * x[:, i] * nf
            sl22 = sl2 + w * nf * nf
            take = pos & (new_l != L[:, i]) & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[:, i] = np.where(take, new_l, L[:, i])
            sumlx = np.where(take, slx2, sumlx)
            suml2 = np.where(take, sl22, suml2)
    scale = np.where(zero, _F32(0), sumlx / np.where(suml2 != 0, suml2, _F32(1)))
    return scale.astype(_F32), np.where(zero[:, None], 0, L + nmax)


def _q3_k_encode(xb: np.ndarray) -> np.ndarray:
    n = xb.shape[0]
    scales, L = _make_q3_quants(xb.reshape(n * 16, 16), 4)
    scales, L = scales.reshape(n, 16), L.reshape(n, 16, 16)
    j_max = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(n), j_max]
    has = max_scale != 0
    iscale = _F32(-32) / np.where(has, max_scale, _F32(1))
    ls = (np.clip(_nearest_int(iscale[:, None] * scales), -32, 31) + 32).astype(np.uint8)
    packed = np.zeros((n, 12), np.uint8)
    packed[:, 0:8] = (ls[:, 0:8] & 0x0F) | ((ls[:, 8:16] & 0x0F) << 4)
    for j in range(16):
        packed[:, 8 + j % 4] |= (ls[:, j] >> 4) << (2 * (j // 4))
    packed[~has] = 0
    out = np.zeros(n, dtype=_BLOCK_Q3_K)
    out["scales"] = packed
    out["d"] = np.where(has, _F32(1) / iscale, _F32(0))
    d = _f16(out["d"])[:, None] * _q3_k_scales(packed).astype(_F32)
    requant = np.clip(_nearest_int(xb.reshape(n, 16, 16) / np.where(d != 0, d, _F32(1))[:, :, None]), -4, 3) + 4
    L = np.where((d != 0)[:, :, None], requant, L).reshape(n, 256)  # a zero scale keeps the search's values
    high = L > 3
    L = np.where(high, L - 4, L).astype(np.uint8)
    out["hmask"] = np.bitwise_or.reduce(high.reshape(n, 8, 32).astype(np.uint8) << np.arange(8, dtype=np.uint8)
                                        .reshape(1, 8, 1), axis=1)
    lq = L.reshape(n, 2, 4, 32)
    out["qs"] = (lq[:, :, 0] | (lq[:, :, 1] << 2) | (lq[:, :, 2] << 4) | (lq[:, :, 3] << 6)).reshape(n, 64)
    return out


_q3_k_from_float = _quantizer(_BLOCK_Q3_K, QK_K, _q3_k_encode)


# --- error bounds --------------------------------------------------------------------------------------
# Each bound is the codec's rounding step plus what storing the scale (and minimum) in float16 costs:
# with d the exact float32 scale and dh its float16, a value q*d is decoded as q*dh, off by |q|*|d - dh|.
# The last term covers the float32 arithmetic on the way (a few ulps of the block's magnitude).


def _fp16_error(v: np.ndarray) -> np.ndarray:
    return np.abs(v - v.astype(np.float16).astype(_F32))


def _slack(xb: np.ndarray) -> np.ndarray:
    return np.abs(xb).max(axis=-1) * _F32(2.0**-20)


def _f16_max_error(xb: np.ndarray) -> np.ndarray:
    # half an ulp: 2^-11 relative for normal halves, 2^-25 absolute in the subnormal range
    return (np.abs(xb) * _F32(2.0**-11) + _F32(2.0**-25)).max(axis=-1)


def _bf16_max_error(xb: np.ndarray) -> np.ndarray:
    return (np.abs(xb) * _F32(2.0**-8)).max(axis=-1)


def _q8_0_max_error(xb: np.ndarray) -> np.ndarray:
    d = np.abs(xb).max(axis=-1) / _F32(127)
    return d / 2 + 127 * _fp16_error(d) + _slack(xb)


def _symmetric_max_error(xb: np.ndarray, half: int) -> np.ndarray:
    # Values can reach half |d| on the side opposite the block's extreme, but only half - 1 is encodable
    # there: those clip, so the step is a whole |d|, not half of it.
    d = _signed_absmax(xb) / _F32(-half)
    return np.abs(d) + half * _fp16_error(d) + _slack(xb)


def _offset_max_error(xb: np.ndarray, nmax: int) -> np.ndarray:
    lo = xb.min(axis=-1)
    d = (xb.max(axis=-1) - lo) / _F32(nmax)
    return d / 2 + nmax * _fp16_error(d) + _fp16_error(lo) + _slack(xb)


_q4_0_max_error = partial(_symmetric_max_error, half=8)
_q4_1_max_error = partial(_offset_max_error, nmax=15)
_q5_0_max_error = partial(_symmetric_max_error, half=16)
_q5_1_max_error = partial(_offset_max_error, nmax=31)


def _grid_max_error(xb: np.ndarray, x: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                    half_step: np.ndarray) -> np.ndarray:
    """The K-quants' bound per block: each group of x (axis 2) within half_step of its grid [lo, hi], or
    clipped to the grid's ends."""
    clip = np.maximum(np.maximum(lo - x.min(axis=2), x.max(axis=2) - hi), 0)
    return (np.maximum(half_step, clip) * (1 + 2.0**-20) + _slack(xb)[:, None]).max(axis=1).astype(_F32)


def _q5_k_max_error(xb: np.ndarray) -> np.ndarray:
    """Q5_K's last step, exactly: each value is within half a step of its sub-block's grid
    {d_j q - dm_j : q = 0..31} (d_j = d sc_j, dm_j = dmin m_j, as stored), or clipped to the grid's ends. The
    grid itself is what ggml's scale search (and the 6-bit scales) make of the block; this bound takes it as
    encoded."""
    n = xb.shape[0]
    enc = _q5_k_encode(np.ascontiguousarray(xb, dtype=_F32))
    sc, m = _k4_scales_mins(enc["scales"])
    d = (_f16(enc["d"])[:, None] * sc.astype(_F32)).astype(np.float64)
    dm = (_f16(enc["dmin"])[:, None] * m.astype(_F32)).astype(np.float64)
    return _grid_max_error(xb, xb.reshape(n, 8, 32).astype(np.float64), -dm, 31 * d - dm, d / 2)


def _q3_k_max_error(xb: np.ndarray) -> np.ndarray:
    """Q3_K's last step, exactly (as Q5_K's): each value within half a step of its 16-value group's grid
    {d_j q : q = -4..3} (d_j = d (sc_j - 32), as stored), or clipped to the grid's ends."""
    n = xb.shape[0]
    enc = _q3_k_encode(np.ascontiguousarray(xb, dtype=_F32))
    d = (_f16(enc["d"])[:, None] * _q3_k_scales(enc["scales"]).astype(_F32)).astype(np.float64)
    x = xb.reshape(n, 16, 16).astype(np.float64)
    return _grid_max_error(xb, x, np.minimum(-4 * d, 3 * d), np.maximum(-4 * d, 3 * d), np.abs(d) / 2)


def _exact(xb: np.ndarray) -> np.ndarray:
    return np.zeros(xb.shape[0], dtype=_F32)


# --- the table -----------------------------------------------------------------------------------------

_ROWS: list[QuantType] = [
    QuantType(0, "f32", 1, 4, _f32_to_float, _f32_from_float, _exact),
    QuantType(1, "f16", 1, 2, _f16_to_float, _f16_from_float, _f16_max_error),
    QuantType(2, "q4_0", QK, 18, _dequantizer(_BLOCK_Q4_0, QK, _dec_q4_0), _q4_0_from_float, _q4_0_max_error),
    QuantType(3, "q4_1", QK, 20, _dequantizer(_BLOCK_Q4_1, QK, _dec_q4_1), _q4_1_from_float, _q4_1_max_error),
    QuantType(4, "q4_2", 0, 0),  # removed from ggml
    QuantType(5, "q4_3", 0, 0),  # removed from ggml
    QuantType(6, "q5_0", QK, 22, _dequantizer(_BLOCK_Q5_0, QK, _dec_q5_0), _q5_0_from_float, _q5_0_max_error),
    QuantType(7, "q5_1", QK, 24, _dequantizer(_BLOCK_Q5_1, QK, _dec_q5_1), _q5_1_from_float, _q5_1_max_error),
    QuantType(8, "q8_0", QK, 34, _dequantizer(_BLOCK_Q8_0, QK, _dec_q8_0), _q8_0_from_float, _q8_0_max_error),
    QuantType(9, "q8_1", QK, 36),
    QuantType(10, "q2_k", QK_K, 84),
    QuantType(11, "q3_k", QK_K, 110, _dequantizer(_BLOCK_Q3_K, QK_K, _dec_q3_k), _q3_k_from_float, _q3_k_max_error),
    QuantType(12, "q4_k", QK_K, 144, _dequantizer(_BLOCK_Q4_K, QK_K, _dec_q4_k)),
    QuantType(13, "q5_k", QK_K, 176, _dequantizer(_BLOCK_Q5_K, QK_K, _dec_q5_k), _q5_k_from_float, _q5_k_max_error),
    QuantType(14, "q6_k", QK_K, 210, _dequantizer(_BLOCK_Q6_K, QK_K, _dec_q6_k)),
    QuantType(15, "q8_k", QK_K, 292),
    QuantType(16, "iq2_xxs", QK_K, 66),
    QuantType(17, "iq2_xs", QK_K, 74),
    QuantType(18, "iq3_xxs", QK_K, 98),
    QuantType(19, "iq1_s", QK_K, 50),
    QuantType(20, "iq4_nl", QK, 18),
    QuantType(21, "iq3_s", QK_K, 110),
    QuantType(22, "iq2_s", QK_K, 82),
    QuantType(23, "iq4_xs", QK_K, 136),
    QuantType(24, "i8", 1, 1),
    QuantType(25, "i16", 1, 2),
    QuantType(26, "i32", 1, 4),
    QuantType(27, "i64", 1, 8),
    QuantType(28, "f64", 1, 8),
    QuantType(29, "iq1_m", QK_K, 56),
    QuantType(30, "bf16", 1, 2, _bf16_to_float, _bf16_from_float, _bf16_max_error),
    QuantType(31, "q4_0_4_4", 0, 0),  # removed from ggml (repacking moved into its CPU backend)
    QuantType(32, "q4_0_4_8", 0, 0),  # removed
    QuantType(33, "q4_0_8_8", 0, 0),  # removed
    QuantType(34, "tq1_0", QK_K, 54),
    QuantType(35, "tq2_0", QK_K, 66),
    QuantType(36, "iq4_nl_4_4", 0, 0),  # removed
    QuantType(37, "iq4_nl_4_8", 0, 0),  # removed
    QuantType(38, "iq4_nl_8_8", 0, 0),  # removed
    QuantType(39, "mxfp4", QK, 17, _dequantizer(_BLOCK_MXFP4, QK, _dec_mxfp4)),
    QuantType(40, "nvfp4", 64, 36),
    QuantType(41, "q1_0", 128, 18),
]

TYPES: dict[int, QuantType] = {t.id: t for t in _ROWS}
"""Every ggml type id we know of, supported or not."""

BY_NAME: dict[str, QuantType] = {t.name: t for t in _ROWS}
"""The same rows keyed by lowercase name ("q4_k")."""

SUPPORTED: dict[int, QuantType] = {t.id: t for t in _ROWS if t.supported}
"""The rows barellm can decode."""


# --- lookups and whole-tensor helpers ------------------------------------------------------------------


def type_name(type_id: int) -> str:
    """A type's name for messages; unknown ids read as "type 99"."""
    t = TYPES.get(type_id)
    return t.name if t is not None else f"type {type_id}"


def _known(type_id: int) -> QuantType:
    t = TYPES.get(type_id)
    if t is None:
        raise FormatError(f"unknown ggml type id {type_id}")
    return t


def get(type_id: int) -> QuantType:
    """The row of a type barellm can decode; FormatError naming the type otherwise."""
    t = _known(type_id)
    if not t.supported:
        raise FormatError(f"ggml type {t.name} (id {t.id}) is not supported")
    return t


def by_name(name: str) -> QuantType:
    """The row for a type name, case-insensitively ("Q4_K" works)."""
    t = BY_NAME.get(name.lower())
    if t is None:
        raise FormatError(f"unknown ggml type {name!r}")
    return t


def row_bytes(type_id: int, n: int) -> int:
    """Bytes taken by a row of `n` values; `n` must be a whole number of blocks.

    Works for every type whose layout is known, decodable or not, so readers can size tensors they will
    only list.
    """
    t = _known(type_id)
    if not t.has_layout:
        raise FormatError(f"ggml type {t.name} (id {t.id}) was removed from ggml and has no known layout")
    if n < 0 or n % t.block_size:
        raise FormatError(f"a row of {n} values is not a whole number of {t.name} blocks ({t.block_size})")
    return n // t.block_size * t.block_bytes


def nbytes(type_id: int, shape: tuple[int, ...]) -> int:
    """Bytes taken by a tensor of NumPy `shape` (rows along the last axis)."""
    if any(s < 0 for s in shape):
        raise FormatError(f"negative dimension in shape {shape}")
    n_rows = math.prod(shape[:-1])
    return n_rows * row_bytes(type_id, shape[-1] if shape else 1)


def dequantize(raw: np.ndarray | bytes | memoryview, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
    """Decode a tensor's bytes into a new float32 array of NumPy `shape`."""
    t = get(type_id)
    shape = tuple(int(s) for s in shape)
    data = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
    if data.dtype != np.uint8:
        data = data.view(np.uint8)
    data = data.reshape(-1)
    expected = nbytes(type_id, shape)
    if data.size != expected:
        raise FormatError(f"{t.name} tensor of shape {shape} needs {expected} bytes, got {data.size}")
    if expected == 0:
        return np.zeros(shape, dtype=_F32)
    out = t.to_float(data)  # type: ignore[misc]  # get() guarantees a decoder
    return out.reshape(shape)


def quantize(x: np.ndarray, type_id: int) -> np.ndarray:
    """Encode `x` (rows along its last axis) as uint8 of shape `x.shape[:-1] + (row bytes,)`."""
    t = get(type_id)
    if t.from_float is None:
        raise FormatError(f"encoding to ggml type {t.name} is not supported")
    x = np.asarray(x, dtype=_F32)
    if x.ndim == 0:
        x = x.reshape(1)
    row = row_bytes(type_id, x.shape[-1])
    if x.size == 0:
        return np.zeros((*x.shape[:-1], row), dtype=np.uint8)
    return t.from_float(x.reshape(-1)).reshape(*x.shape[:-1], row)
