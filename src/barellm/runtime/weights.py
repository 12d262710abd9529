"""A model's weights as the native engine uses them: each matrix in the layout its kernel reads, taken from the
file's mapping as it is where the file stores that layout already (the model store's .blm files), else
repacked once at load (a GGUF file's rows), Q|K|V and gate|up fused where their types agree; norms and
biases as float32; the embedding table as the lookups read it; float32 copies for the per-op debugger.

`Weights` does this for NativeEngine (runtime/engine.py), which has one; `matrix_layout` (formats/kernels.py)
is the one place a matrix's layout is decided.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from barellm.formats import kernels
from barellm.formats.kernels import ACT_Q8, LAYOUT_ROWS, matmul_supported, matrix_layout

F32 = 0  # ggml type id of float32


def aligned_zeros(shape: tuple[int, ...] | int, dtype: Any = np.float32, align: int = 64) -> np.ndarray:
    """A zeroed C-contiguous array whose data starts on an `align`-byte boundary."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def _release_pages(views: list[np.ndarray]) -> None:
    """Drops this process's mapping of the file pages under views (read-only mmap views of the model
    file that were copied into repacked matrices): they would otherwise stay resident for nothing. The
    kernel reads them back from the file if anything touches them again."""
    try:
        import ctypes
        import mmap

        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    def file_mapped(v: Any) -> bool:  # a read-only view whose memory is an mmap (of the model file)
        if v.flags.writeable:
            return False
        b = v
        while b is not None and not isinstance(b, mmap.mmap):
            b = b.obj if isinstance(b, memoryview) else getattr(b, "base", None)
        return b is not None

    page = mmap.PAGESIZE
    for v in views:
        if not file_mapped(v):  # anonymous memory would come back as zeros
            continue
        lo = -(-v.ctypes.data // page) * page
        hi = (v.ctypes.data + v.nbytes) // page * page
        if hi > lo:
            libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED


class Weights:
    """The weights of one engine, read from `source` (the opened model file) as its plan asks for them and kept:
    the matmuls' parts (`matrices`), norms and biases (`norms`), float32 copies (`dequantized`)."""

    def __init__(self, source: Any, threads: int) -> None:
        self.source = source
        self.threads = threads   # repacking's
        self.matrices: dict[tuple[str, ...], list[tuple[int, int, int, int, np.ndarray]]] = {}
        self.norms: dict[str, np.ndarray] = {}
        self.dequantized: dict[str, np.ndarray] = {}

    def _stored(self, name: str) -> tuple[int, int, np.ndarray]:
        """A tensor's (type, layout, bytes) as the file stores them: a read-only view of the mapping, no copy.
        A GGUF file stores rows; a .blm file the layout its table names (the model cache: the kernels')."""
        info = self.source.tensors[name]
        layout = int(getattr(info, "layout", LAYOUT_ROWS))
        data = self.source.stored(name) if hasattr(self.source, "stored") else self.source.raw(name)
        return int(info.type), layout, np.asarray(data).view(np.uint8).reshape(-1)

    def _shape2(self, name: str) -> tuple[int, int]:
        shape = tuple(self.source.tensors[name].shape)
        cols = int(shape[-1]) if shape else 1
        return (int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1), cols

    def _stored_as(self, group: tuple[str, ...], type_id: int, layout: int, rows: int, cols: int) -> np.ndarray | None:
        """The group's matrix straight from the file when the file stores it in `layout` already: a view of the
        mapping when its parts lie back to back there (the model cache writes fused groups so: no copy, no
        repacking), else one concatenation of the parts' views; None when the file stores them otherwise."""
        nbytes = kernels.matrix_bytes(type_id, layout, rows, cols)
        infos = [self.source.tensors[n] for n in group]
        if layout == LAYOUT_ROWS and len(group) == 1:  # GGUF rows used as they are
            data = self._stored(group[0])[2]
            return data if data.ctypes.data % 32 == 0 and data.size == nbytes else None
        if any(int(getattr(i, "layout", LAYOUT_ROWS)) != layout for i in infos):
            return None
        if any(self._shape2(n)[0] % kernels.layout_rows(layout) for n in group[:-1]):  # parts end on whole groups
            return None
        span = self.source.span(group) if hasattr(self.source, "span") else None
        if span is not None and span.size == nbytes:
            return span
        views = [self._stored(n)[2] for n in group]
        if sum(v.size for v in views) != nbytes:
            return None
        if len(views) == 1:
            return views[0]
        data = aligned_zeros(nbytes, np.uint8)
        np.concatenate(views, out=data)
        return data

    def dequant(self, name: str) -> np.ndarray:
        """float32 copy of a tensor (debug path and types the kernels lack)."""
        if name not in self.dequantized:
            shape = tuple(self.source.tensors[name].shape)
            rows, cols = self._shape2(name)
            type_id, layout, data = self._stored(name)
            out = aligned_zeros((rows, cols))
            if kernels.matrix_bytes(type_id, layout, rows, cols) == data.size and kernels.row_bytes(type_id, cols):
                kernels.dequantize_rows(type_id, layout, rows, cols, data, out=out)
            else:  # a type the native table does not know: the NumPy codec
                out[:] = np.asarray(self.source.dequantize(name), dtype=np.float32).reshape(rows, cols)
            self.dequantized[name] = out.reshape(shape)
        return self.dequantized[name]

    def table_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """float32 rows of a matrix (embedding lookups on the debug path, without dequantizing it all)."""
        if name in self.dequantized:
            return self.dequantized[name][rows]
        type_id, layout, n, cols, data = self.table(name)
        return kernels.dequantize_rows(type_id, layout, n, cols, data, which=rows)

    def norm(self, name: str) -> np.ndarray:
        if name not in self.norms:
            type_id, layout, data = self._stored(name)
            w = data.view(np.float32) if type_id == F32 and layout == LAYOUT_ROWS else self.dequant(name).reshape(-1)
            self.norms[name] = np.ascontiguousarray(w, dtype=np.float32)
        return self.norms[name]

    def bias(self, names: tuple[str, ...]) -> np.ndarray:
        """The biases of a fused matmul, concatenated as its rows are (float32, read once at load)."""
        key = "|".join(names)
        if key not in self.norms:
            self.norms[key] = np.ascontiguousarray(np.concatenate([self.norm(n) for n in names]), np.float32)
        return self.norms[key]

    def matrix(self, names: tuple[str, ...]) -> list[tuple[int, int, int, int, np.ndarray]]:
        """The matmul parts for the row-concatenation of `names`: one fused matrix when their types agree,
        else one part per tensor. Each part is (type, layout, rows, cols, data). A 3-D tensor (a stack of experts'
        matrices) is the matrix of its rows, one expert after another."""
        if names in self.matrices:
            return self.matrices[names]
        cols = self._shape2(names[0])[1]
        groups: list[tuple[str, ...]] = []  # runs of consecutive tensors of one type are fused
        for n in names:
            if groups and self.source.tensors[groups[-1][0]].type == self.source.tensors[n].type:
                groups[-1] = (*groups[-1], n)
            else:
                groups.append((n,))
        parts = []
        for group in groups:
            type_id = int(self.source.tensors[group[0]].type)
            rows = sum(self._shape2(n)[0] for n in group)
            if matmul_supported(type_id, rows, cols):
                layout = matrix_layout(type_id, rows, cols)
                stored = self._stored_as(group, type_id, layout, rows, cols)
                if stored is not None:
                    parts.append((type_id, layout, rows, cols, stored))
                    continue
                raw = [self._rows_of(n) for n in group]
                src = raw[0] if len(raw) == 1 else np.concatenate(raw)
            else:  # a type the kernels lack: exact float32 rows
                type_id = F32
                src = np.concatenate([self.dequant(n).reshape(-1, cols) for n in group]).view(np.uint8)
            layout = matrix_layout(type_id, rows, cols)
            data = aligned_zeros(kernels.matrix_bytes(type_id, layout, rows, cols), np.uint8)
            kernels.repack(type_id, layout, rows, cols, src, out=data, threads=self.threads)
            _release_pages([self._stored(n)[2] for n in group])  # (embedding lookups fault rows back in)
            parts.append((type_id, layout, rows, cols, data))
        self.matrices[names] = parts
        return parts

    def _rows_of(self, name: str) -> np.ndarray:
        """A tensor's bytes in GGUF rows: the file's view, or a converted copy of another stored layout."""
        type_id, layout, data = self._stored(name)
        if layout == LAYOUT_ROWS:
            return data
        rows, cols = self._shape2(name)
        return kernels.unrepack(type_id, layout, rows, cols, data, threads=self.threads)

    def table(self, name: str) -> tuple[int, int, int, int, np.ndarray]:
        """The embedding table as the embed op reads it: the matrix as stored (any layout the kernels know,
        so a tied table stored in the kernels' layout serves the lookups and the output matmul from one
        mapping), or exact float32 rows for a type without kernels."""
        rows, cols = self._shape2(name)
        type_id, layout, data = self._stored(name)
        readable = kernels.matrix_bytes(type_id, layout, rows, cols) == data.size
        if not (kernels.act_supported(type_id, ACT_Q8) and readable):
            type_id, layout, data = F32, LAYOUT_ROWS, self.dequant(name).reshape(-1).view(np.uint8)
        return type_id, layout, rows, cols, data
