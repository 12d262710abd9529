"""What the native kernels take: the Python face of the C core's type-and-layout traits table.

The table (`_native/kernels.h`, `bl_type_traits`, one row per weight type) holds everything the core knows
about a type: its block geometry, its one row dequantizer, the activation types its matmuls take, the
layouts it can be stored in and how to repack into them and back, its kernels per ISA. The engine, the .blm
reader and writer and the converter ask this module, and only this module, about those facts: which layout
a weight matrix is stored in for the matmul kernels, how many bytes that takes, how to repack it, which
activation precision the kernels are fed. `barellm.formats.quant` stays the NumPy oracle the tests hold the table to.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from barellm import _native as nat

LAYOUT_ROWS, LAYOUT_INTERLEAVE8 = 0, 1
LAYOUT_NAMES = {LAYOUT_ROWS: "rows", LAYOUT_INTERLEAVE8: "interleave8"}
ACT_Q8, ACT_Q8X2 = 0, 1
# The activation precisions of the quantized matmuls (kernels.h): "q8x2" keeps ~15 bits per value (two int8
# planes, twice the integer multiplies), "q8" ~8 bits (the int8 blocks llama.cpp also uses).
ACTIVATIONS = {"q8x2": ACT_Q8X2, "q8": ACT_Q8}

# Rows of a matrix above which repacking is split over threads (the native call releases the GIL).
_THREADED_ROWS = 4096


@dataclass(frozen=True)
class TypeTraits:
    """One row of the native table."""

    id: int
    name: str
    block_size: int              # values per block
    block_bytes: int             # bytes per block in GGUF rows
    acts: tuple[int, ...]        # activation types the matmul kernels take (empty: no kernels)
    int_acts: bool               # the kernels take integer activation blocks (else the f32 vector)
    layout: int                  # the layout the kernels read fastest
    layouts: tuple[int, ...]     # the layouts the type can be stored in

    @property
    def has_kernels(self) -> bool:
        return bool(self.acts)


@functools.cache
def traits(type_id: int) -> TypeTraits | None:
    """The table's row for a ggml type id, or None for a type the native core does not know."""
    info = nat.type_info(int(type_id))
    if info is None:
        return None
    return TypeTraits(int(type_id), info["name"], info["block_size"], info["block_bytes"], tuple(info["acts"]),
                      bool(info["int_acts"]), info["layout"], tuple(info["layouts"]))


def layout_name(layout: int) -> str:
    return LAYOUT_NAMES.get(layout, f"layout {layout}")


def layout_rows(layout: int) -> int:
    """Rows per group of a layout: a matmul's row ranges, and the parts of a fused matrix, start on them."""
    return nat.layout_rows(layout)


def row_bytes(type_id: int, cols: int) -> int:
    """Bytes of one GGUF row of `cols` values; 0 if the table does not know the type or cols is not whole blocks."""
    return nat.row_bytes(type_id, cols)


def group_bytes(type_id: int, layout: int, cols: int) -> int:
    """Bytes of one group (layout_rows(layout) rows) of a matrix; 0 if the type has no such layout."""
    return nat.group_bytes(type_id, layout, cols)


def matrix_bytes(type_id: int, layout: int, rows: int, cols: int) -> int:
    """Bytes of a [rows, cols] matrix of a type in a layout; 0 if the table does not take that combination."""
    if rows <= 0 or cols <= 0 or rows > 2**31 - 1 or cols > 2**31 - 1:
        return 0
    try:
        return nat.matrix_bytes(type_id, layout, rows, cols)
    except (ValueError, OverflowError):  # a type or layout the table does not have
        return 0


def has_layout(type_id: int, layout: int) -> bool:
    t = traits(type_id)
    return t is not None and layout in t.layouts


def matmul_supported(type_id: int, rows: int, cols: int) -> bool:
    """Whether the matmul kernels take a [rows, cols] matrix of this type."""
    t = traits(type_id)
    return t is not None and t.has_kernels and matrix_bytes(type_id, LAYOUT_ROWS, rows, cols) > 0


def matrix_layout(type_id: int, rows: int, cols: int) -> int:
    """The layout the matmul kernels want for a matrix (the weights' storage decision, in one place).

    The table's layout for the type where the kernels have one, else GGUF's rows. A .blm file stores
    matrices already in the layout this returns, tagged, so loading it needs no repacking.
    """
    t = traits(type_id)
    if t is not None and t.has_kernels and matrix_bytes(type_id, t.layout, rows, cols) > 0:
        return t.layout
    return LAYOUT_ROWS


def matrix_act(type_id: int, activations: str) -> int:
    """The activation type a matrix's kernel takes (the precision choice, in one place).

    "q8x2" wherever the kernels have it (Q4_0, Q4_1, Q8_0, MXFP4), else 8-bit blocks. Why it is the default: with
    8-bit activations SmolLM2's teacher-forced logits differ from the float reference by a mean top-10 KL
    of 0.0027 (top-1 196/199); with q8x2 by under 1e-5 (199/199). With the output matrix left at 8 bits
    the KL is 0.0002 but a top-2 margin of 0.005 flips (198/199), so it takes q8x2 too. Decoding reads each
    weight once, so the extra multiplies mostly hide behind the memory reads; prefill pays for them
    (docs/engine.md, docs/benchmarks.md).
    """
    act = ACTIVATIONS[activations]
    return act if act == ACT_Q8 or act_supported(type_id, act) else ACT_Q8


def act_supported(type_id: int, act: int) -> bool:
    return bool(nat.act_supported(type_id, act))


def act_row_bytes(type_id: int, layout: int, cols: int, act: int = ACT_Q8) -> int:
    """Bytes of one activation vector of `cols` values converted for such a matrix's kernel."""
    return nat.act_row_bytes(type_id, layout, cols, act)


def _flat(a: np.ndarray | bytes | memoryview) -> np.ndarray:
    arr = np.frombuffer(a, np.uint8) if not isinstance(a, np.ndarray) else a
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off:off + nbytes]


def _convert(back: bool, type_id: int, layout: int, rows: int, cols: int, src: np.ndarray, dst: np.ndarray,
             threads: int) -> None:
    """GGUF rows into `layout` (or back), split over threads in whole groups for big matrices: repacked layouts
    hold rows in independent groups, so row ranges starting on a group convert on their own (the native call
    releases the GIL)."""
    fn = nat.unrepack_into if back else nat.repack_into
    g = layout_rows(layout)
    parts = min(threads, rows // _THREADED_ROWS) if g > 1 else 1
    if parts < 2:
        fn(type_id, layout, rows, cols, src, dst)
        return
    from concurrent.futures import ThreadPoolExecutor

    plain, packed = row_bytes(type_id, cols), group_bytes(type_id, layout, cols)
    cuts = [rows * k // parts // g * g for k in range(parts)] + [rows]

    def one(k: int) -> None:
        r0, r1 = cuts[k], cuts[k + 1]
        rows_part = slice(r0 * plain, r1 * plain)
        packed_part = slice(r0 // g * packed, r0 // g * packed + matrix_bytes(type_id, layout, r1 - r0, cols))
        a, b = (src[packed_part], dst[rows_part]) if back else (src[rows_part], dst[packed_part])
        fn(type_id, layout, r1 - r0, cols, a, b)

    with ThreadPoolExecutor(parts) as pool:
        list(pool.map(one, range(parts)))


def repack(type_id: int, layout: int, rows: int, cols: int, src: np.ndarray | bytes, out: np.ndarray | None = None,
           threads: int = 1) -> np.ndarray:
    """GGUF rows of a matrix in `layout` (the kernels' own repacking): a new 64-byte-aligned uint8 array, or out."""
    n = matrix_bytes(type_id, layout, rows, cols)
    if n == 0:
        raise ValueError(f"type {type_id} has no layout {layout_name(layout)} for a ({rows}, {cols}) matrix")
    dst = _aligned(n) if out is None else out
    _convert(False, type_id, layout, rows, cols, _flat(src), dst, threads)
    return dst


def unrepack(type_id: int, layout: int, rows: int, cols: int, src: np.ndarray | bytes,
             out: np.ndarray | None = None, threads: int = 1) -> np.ndarray:
    """A matrix stored in `layout` back in GGUF rows: a new uint8 array, or out."""
    n = matrix_bytes(type_id, LAYOUT_ROWS, rows, cols)
    if n == 0 or matrix_bytes(type_id, layout, rows, cols) == 0:
        raise ValueError(f"type {type_id} has no layout {layout_name(layout)} for a ({rows}, {cols}) matrix")
    dst = np.empty(n, np.uint8) if out is None else out
    _convert(True, type_id, layout, rows, cols, _flat(src), dst, threads)
    return dst


def dequantize_rows(type_id: int, layout: int, rows: int, cols: int, w: np.ndarray | bytes,
                    which: Sequence[int] | np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """float32 rows of a matrix stored in any layout, by the type's one native dequantizer: all rows, or the
    rows `which` (in that order), as [len, cols]."""
    data = _flat(w)
    if which is None:
        res = np.empty((rows, cols), np.float32) if out is None else out
        nat.dequantize_rows(type_id, layout, rows, cols, data, res)
        return res
    idx = np.asarray(which, dtype=np.int64).reshape(-1)
    res = np.empty((len(idx), cols), np.float32) if out is None else out
    for i, r in enumerate(idx.tolist()):
        nat.dequantize_rows(type_id, layout, rows, cols, data, res[i], r, r + 1)
    return res
