"""The 8-bit KV cache's codec, the native cache's test oracle: ggml's q8_0 along the last axis as the cache
stores values (int8 values, f16 scales per 32), and its keys, first shifted by the K projection's bias and
turned by a Walsh-Hadamard transform (executor.c, store_q8_keys; ops.h, bl_hadamard)."""

from __future__ import annotations

import math

import numpy as np

from barellm.formats.ggml import F32, QK, inverse, roundf


def q8_0_split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's q8_0 along the last axis (a multiple of 32), as the 8-bit KV cache stores it: the int8 values
    [..., n] and the f16 scales [..., n / 32] (d = amax / 127, q = roundf(x * (1 / d)))."""
    x = np.asarray(x, dtype=F32)
    xb = x.reshape(*x.shape[:-1], -1, QK)
    d = np.abs(xb).max(axis=-1) / F32(127)
    q = roundf(xb * inverse(d)[..., None]).astype(np.int8)
    return q.reshape(x.shape), d.astype(np.float16)


def q8_0_join(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The float32 values of q8_0_split's (values, scales): each int8 times its block's f16 scale."""
    qb = np.asarray(q).reshape(*q.shape[:-1], -1, QK).astype(F32)
    return (qb * np.asarray(d).astype(F32)[..., None]).reshape(q.shape)


def q8_0_round_trip(x: np.ndarray) -> np.ndarray:
    """x as ggml's q8_0 blocks hold it (an 8-bit KV cache's values; its keys: q8_0_keys_round_trip)."""
    return q8_0_join(*q8_0_split(x))


def hadamard(x: np.ndarray, n: int) -> np.ndarray:
    """x turned by the orthonormal Walsh-Hadamard matrix of order n (a power of two) over each block of n values
    along the last axis: the native bl_hadamard's butterflies in its order, in float32, so the same bits. The
    matrix is its own inverse (up to rounding)."""
    x = np.asarray(x, dtype=F32)
    if n < 1 or n & (n - 1) or x.shape[-1] % n:
        raise ValueError(f"hadamard: n must be a power of two dividing {x.shape[-1]}, got {n}")
    v = x.reshape(-1, n)
    h = 1
    while h < n:
        pairs = v.reshape(len(v), n // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        v = np.stack([a + b, a - b], axis=2).reshape(len(v), n)
        h *= 2
    return (v * F32(1.0 / math.sqrt(n))).reshape(x.shape)


def kv_rotation(head_dim: int) -> int:
    """The order of the transform an 8-bit KV cache turns each key head by (ops.h, bl_kv_rotation): the largest
    power of two dividing head_dim."""
    return head_dim & -head_dim


def q8_0_keys(k: np.ndarray, shift: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Keys [..., head_dim] as an 8-bit KV cache stores them (executor.c, store_q8_keys): minus shift (the K
    projection's bias, broadcast against k; None: nothing), turned by hadamard() over kv_rotation(head_dim)
    values, then q8_0_split. The attention turns each query alike, so its scores change by a constant per
    query only, which the softmax cancels, and by the rounding."""
    k = np.asarray(k, dtype=F32)
    if shift is not None:
        k = k - np.asarray(shift, dtype=F32)
    return q8_0_split(hadamard(k, kv_rotation(k.shape[-1])))


def q8_0_keys_join(q: np.ndarray, d: np.ndarray, shift: np.ndarray | None = None) -> np.ndarray:
    """The keys q8_0_keys' (values, scales) stand for: turned back by hadamard(), plus shift."""
    k = hadamard(q8_0_join(q, d), kv_rotation(q.shape[-1]))
    return k + np.asarray(shift, dtype=F32) if shift is not None else k


def q8_0_keys_round_trip(k: np.ndarray, shift: np.ndarray | None = None) -> np.ndarray:
    """Keys as an 8-bit KV cache holds them."""
    return q8_0_keys_join(*q8_0_keys(k, shift), shift)
