"""The native engine's KV cache: the element types it may hold, what a position takes in it, and its memory
(mapped so that only the positions written become resident). NativeEngine (runtime/engine.py) lays it out."""

from __future__ import annotations

from typing import Any

import numpy as np

from barellm import _native as nat
from barellm.arch.config import ModelConfig
from barellm.errors import InvalidRequest

KV_TYPES: dict[str, int] = {"f32": 0, "f16": 1, "q8_0": nat.KV_Q8_0}  # the cache element types (ops.h, bl_kv_type)
KV_QK = 32  # values per block of a q8_0 cache


def lazy_zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zeroed array in its own anonymous mapping of small pages, resident only where it has been written.

    For the KV cache: it is sized for the whole context, but a conversation fills it from position 0 on. NumPy
    asks for transparent huge pages on big arrays, and a 2 MB page becomes resident at its first write: a
    cache whose every (layer, head) region had one token written would then be resident whole (SmolLM2 at
    context 2048: 44 of its 47 MB after a 36-token chat), and the first forward pass would have the kernel
    zero (and, on a fragmented machine, compact memory for) those 2 MB pages: 10-100 ms of the first token.
    """
    import mmap

    nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            m.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(m, dtype=np.uint8, count=nbytes).view(dtype).reshape(shape)


def check_kv_type(kv_type: str, cfg: ModelConfig) -> None:
    if kv_type not in KV_TYPES:
        raise InvalidRequest(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
    if kv_type == "q8_0" and cfg.head_dim % KV_QK:
        raise InvalidRequest(f"kv_type q8_0 needs a head_dim that is a multiple of {KV_QK}; this model's is "
                             f"{cfg.head_dim}")


def kv_bytes_per_token(cfg: ModelConfig, kv_type: str) -> int:
    """Bytes a position takes in one slot's cache, K and V of every layer (q8_0: 34 bytes per 32 values)."""
    hd = cfg.head_dim
    per_head = {"f32": 4 * hd, "f16": 2 * hd, "q8_0": hd + hd // KV_QK * 2}[kv_type]
    return 2 * cfg.n_layers * cfg.n_kv_heads * per_head
