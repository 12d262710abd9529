"""What ggml's NumPy codecs share (the weight types' table, quant, and the 8-bit KV cache's, kv_q8): the block
sizes and ggml's float32 rounding, so that both round as the C code does."""

from __future__ import annotations

import numpy as np

QK = 32  # elements per block of the simple quants
QK_K = 256  # elements per super-block of the K-quants

F32 = np.float32


def roundf(x: np.ndarray) -> np.ndarray:
    """C's roundf: halves go away from zero (np.rint would send them to even)."""
    a = np.abs(x)
    r = np.floor(a)
    r += (a - r) >= 0.5  # a - floor(a) is exact in float arithmetic, so the tie test is too
    return np.copysign(r, x)


def inverse(d: np.ndarray) -> np.ndarray:
    """ggml's `id = d ? 1.0f/d : 0.0f`."""
    return np.divide(F32(1), d, out=np.zeros_like(d), where=d != 0)
