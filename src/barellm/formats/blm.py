"""barellm's own model file (.blm): the memory-mapped reader and verify (the writer: blm_writer.py). docs/format.md
is the spec.

The reader trusts nothing it has not checked. The header's CRC-32 is compared before anything past the
64-byte preamble is parsed, which stops accidental corruption; but a file can also be hostile (or written
by a buggy tool with a valid checksum), so every count is then checked against the bytes that remain in
the header, and every offset, size and shape against the file size and the type's block size, before any
of it is used. Python integers do not overflow, so these checks are exact; the limits ggml and the C core
live with (int64 element counts, int32 matrix sides for repacked layouts) are checked on top.

Every problem raises `FormatError` with one line: "<path>: <field> at offset <n>: <what is wrong>".

Tensors are handed out as read-only NumPy views into the mapping (`raw`), so their addresses are stable
for as long as a view is alive, which is what the C core keeps pointers to.
"""

from __future__ import annotations

import math
import mmap
import os
import random
import struct
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from barellm.errors import FormatError
from barellm.formats import kernels, mapped, quant
from barellm.formats.mapped import MappedFile
from barellm.formats.reader import BoundedReader
from barellm.progress import Progress

__all__ = [
    "MAGIC", "MAJOR", "MINOR", "LAYOUTS", "LAYOUT_ROWS", "LAYOUT_INTERLEAVE8", "Layout", "TensorInfo",
    "BLMFile", "VerifyResult", "verify", "layout_by_name",
]

MAGIC = b"BARELLM\0"
MAJOR, MINOR = 1, 2
PAGE = 4096
DEFAULT_ALIGNMENT = 64
MIN_ALIGNMENT, MAX_ALIGNMENT = 64, PAGE
MAX_DIMS = 4
MAX_NAME_BYTES = 0xFFFF
INT64_MAX = (1 << 63) - 1
INT32_MAX = (1 << 31) - 1

# magic, major, minor, alignment, header_size, data_offset, data_size, n_metadata, n_provenance,
# n_tensors, header_crc32, reserved
_PREAMBLE = struct.Struct("<8sHHIQQQIIII8s")
PREAMBLE_BYTES = _PREAMBLE.size
_CRC_AT = 52
# type, layout, n_dims, crc32, dims[4], offset, nbytes
_ENTRY = struct.Struct("<IIII4QQQ")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
assert PREAMBLE_BYTES == 64 and _ENTRY.size == 64


_STRING_BATCH = 16384  # strings decoded at once (see _Cursor.strings)


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


# --- metadata value types (GGUF's codes) ------------------------------------------------------------------

_ARRAY = 9
_STRING = 8
_BOOL = 7
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32",
               7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
_TYPE_CODES = {v: k for k, v in _TYPE_NAMES.items()}
_DTYPES = {0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"), 4: np.dtype("<u4"),
           5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("<u1"), 10: np.dtype("<u8"), 11: np.dtype("<i8"),
           12: np.dtype("<f8")}
_STRUCTS = {t: struct.Struct("<" + c) for t, c in
            {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}.items()}
_INT_RANGES = {t: (int(np.iinfo(dt).min), int(np.iinfo(dt).max)) for t, dt in _DTYPES.items() if dt.kind in "iu"
               and t != _BOOL}
_MIN_VALUE_BYTES = {**{t: dt.itemsize for t, dt in _DTYPES.items()}, _STRING: 4, _ARRAY: 9}
_MIN_KV_BYTES = 2 + 1 + 1 + 1  # a one-byte key, the type, the smallest value
_MIN_TENSOR_BYTES = 2 + 1 + _ENTRY.size


# --- layouts ----------------------------------------------------------------------------------------------
# One row per layout tag: which tensors it can hold, how many bytes it takes, and how to turn it back into
# GGUF rows (dequantize needs that) and into it from rows (the converter needs that). The native kernels'
# traits table defines the byte layouts (barellm.formats.kernels); this table only names them for the file format.

LAYOUT_ROWS = kernels.LAYOUT_ROWS
LAYOUT_INTERLEAVE8 = kernels.LAYOUT_INTERLEAVE8


@dataclass(frozen=True)
class Layout:
    tag: int
    name: str
    # why (type, shape) cannot be held, or None if it can
    check: Callable[[int, tuple[int, ...]], str | None]
    nbytes: Callable[[int, tuple[int, ...]], int]
    to_rows: Callable[[np.ndarray, int, tuple[int, ...]], np.ndarray]
    from_rows: Callable[[np.ndarray, int, tuple[int, ...]], np.ndarray]


def _rows_check(type_id: int, shape: tuple[int, ...]) -> str | None:
    return None


def _rows_nbytes(type_id: int, shape: tuple[int, ...]) -> int:
    return quant.nbytes(type_id, shape)


def _identity(data: np.ndarray, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
    return data


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of a matrix, or of a 3-D stack of matrices (a mixture's experts) as the matrix of its rows, one
    matrix after another (as the engine's matmuls read a stack)."""
    return math.prod(shape[:-1]), shape[-1]


def _packed_layout(tag: int) -> Layout:
    """A layout of the kernels' table: only matrices (and stacks of them) of the types the table gives it."""

    def check(type_id: int, shape: tuple[int, ...]) -> str | None:
        if not kernels.has_layout(type_id, tag):
            holders = [t.name for t in quant.TYPES.values() if kernels.has_layout(t.id, tag)]
            return f"holds only {', '.join(holders)} tensors, not {quant.type_name(type_id)}"
        if len(shape) not in (2, 3):
            return f"holds only matrices and stacks of them, not a tensor of shape {shape}"
        if not all(0 < d <= INT32_MAX for d in (*shape, _matrix_shape(shape)[0])):
            return f"needs a matrix shape within 1..{INT32_MAX}, not {shape}"
        return None

    def nbytes(type_id: int, shape: tuple[int, ...]) -> int:
        return kernels.matrix_bytes(type_id, tag, *_matrix_shape(shape))

    def to_rows(data: np.ndarray, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
        return kernels.unrepack(type_id, tag, *_matrix_shape(shape), data)

    def from_rows(data: np.ndarray, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
        return kernels.repack(type_id, tag, *_matrix_shape(shape), data)

    return Layout(tag, kernels.layout_name(tag), check, nbytes, to_rows, from_rows)


LAYOUTS: dict[int, Layout] = {
    LAYOUT_ROWS: Layout(LAYOUT_ROWS, "rows", _rows_check, _rows_nbytes, _identity, _identity),
    LAYOUT_INTERLEAVE8: _packed_layout(LAYOUT_INTERLEAVE8),
}


def layout_by_name(name: str) -> Layout:
    for layout in LAYOUTS.values():
        if layout.name == name:
            return layout
    raise FormatError(f"unknown layout {name!r} (known: {', '.join(lt.name for lt in LAYOUTS.values())})")


def layout_name(tag: int) -> str:
    layout = LAYOUTS.get(tag)
    return layout.name if layout else f"layout {tag}"


# --- the reader -------------------------------------------------------------------------------------------


def _too_big(shape: tuple[int, ...]) -> bool:
    """Whether a shape could not be a NumPy array of float64 even when a zero dimension makes it empty
    (NumPy refuses those too: it checks the product of the non-zero dimensions)."""
    return math.prod(max(d, 1) for d in shape) > INT64_MAX // 8


@dataclass(frozen=True)
class TensorInfo(mapped.TensorInfo):
    """A tensor of a .blm file: where it lives and what it holds, in the layout its table names, with the CRC32
    of its bytes."""

    layout: int
    crc32: int

    @property
    def layout_name(self) -> str:
        return layout_name(self.layout)


class _Cursor(BoundedReader):
    """The header body's values on the bounds-checked cursor, up to the header's end."""

    def __init__(self, buf: mmap.mmap, pos: int, end: int, path: str) -> None:
        super().__init__(buf, pos, end, path, "header")

    def name(self, field: str) -> str:
        at = self.pos
        n = self.unpack(_U16, field)
        if n == 0:
            raise self.error(field, at, "empty name")
        self.need(n, field)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(field, at, f"name {raw!r} is not valid UTF-8") from None

    def string(self, field: str) -> str:
        at = self.pos
        return self.text(self.unpack(_U32, field), field, at)

    def value(self, field: str) -> tuple[Any, str]:
        at = self.pos
        code = self.unpack(_U8, f"{field} type")
        if code not in _TYPE_NAMES:
            raise self.error(f"{field} type", at, f"unknown value type {code}")
        if code != _ARRAY:
            return self.scalar(code, field), _TYPE_NAMES[code]
        at = self.pos
        inner = self.unpack(_U8, f"{field} element type")
        if inner not in _TYPE_NAMES or inner == _ARRAY:
            raise self.error(f"{field} element type", at, f"{inner} is not a type an array can hold")
        at = self.pos
        n = self.unpack(_U64, f"{field} count")
        self.fits(n, _MIN_VALUE_BYTES[inner], f"{field} count", at)
        type_name = f"array[{_TYPE_NAMES[inner]}]"
        if inner == _STRING:
            return self.strings(n, field), type_name
        dt = _DTYPES[inner]
        arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos) if n else np.zeros(0, dt)
        if inner == _BOOL:
            bad = np.flatnonzero(arr > 1)
            if bad.size:
                raise self.error(f"{field}[{int(bad[0])}]", self.pos + int(bad[0]), "bool value is not 0 or 1")
            self.pos += n
            return arr.astype(bool).tolist(), type_name
        self.pos += n * dt.itemsize
        # a view of the mapping, not a list: a 262,144-entry vocabulary's scores as Python floats took 10 MB
        return arr, type_name

    def scalar(self, code: int, field: str) -> Any:
        if code == _STRING:
            return self.string(field)
        at = self.pos
        v = self.unpack(_STRUCTS[code], field)
        if code == _BOOL:
            if v > 1:
                raise self.error(field, at, f"bool value is {v}, not 0 or 1")
            return bool(v)
        return v

    def strings(self, n: int, field: str) -> list[str]:
        # lengths first, then the bytes: a vocabulary is one vectorized sum and one loop of slices
        lens = np.frombuffer(self.buf, dtype="<u4", count=n, offset=self.pos) if n else np.zeros(0, "<u4")
        at = self.pos
        self.pos += 4 * n
        total = int(lens.sum(dtype=np.uint64))
        if total > self.end - self.pos:
            raise self.error(f"{field} lengths", at, f"{total} bytes of strings run past the end of the header")
        blob = self.buf[self.pos:self.pos + total]
        self.pos += total
        ends = np.cumsum(lens, dtype=np.int64)
        starts = ends - lens
        # Fast path, about 20x faster than one decode per string: when no string holds a NUL byte, put one
        # after each string, decode everything at once and split at the NULs. If that decode succeeds and no
        # string starts inside a multi-byte character, each string was whole characters on its own, so the
        # pieces are exactly what decoding each string would give.
        # Done in batches of strings, so that the copies a batch makes (bytes with NULs, the decoded text) stay
        # small: whole, a 262,144-token vocabulary's took 15 MB at once, at the height of a load's memory use.
        b = np.frombuffer(blob, dtype=np.uint8)
        first = starts[lens > 0]
        if n and not (b == 0).any() and ((b[first] & 0xC0) != 0x80).all():
            pieces: list[str] = []
            try:
                for i in range(0, n, _STRING_BATCH):
                    j = min(n, i + _STRING_BATCH)
                    lo = int(starts[i])
                    sep = np.insert(b[lo:int(ends[j - 1])], ends[i:j] - lo, 0)  # a NUL after each string
                    batch = sep.tobytes().decode("utf-8").split("\0")
                    del batch[j - i:]  # (the separator after the last string leaves an empty piece)
                    pieces += batch
            except UnicodeDecodeError:
                pass
            else:
                return pieces
        s, e = starts.tolist(), ends.tolist()
        return [blob[x:y].decode("utf-8", "surrogateescape") for x, y in zip(s, e, strict=True)]

    def kvs(self, n: int, section: str) -> tuple[dict[str, Any], dict[str, str]]:
        values: dict[str, Any] = {}
        types: dict[str, str] = {}
        for i in range(n):
            at = self.pos
            key = self.name(f"{section} key #{i}")
            if key in values:
                raise self.error(f"{section} key #{i}", at, f"duplicate key {key!r}")
            values[key], types[key] = self.value(f"{section} {key!r}")
        return values, types


class BLMFile(MappedFile):
    """An open .blm file: metadata, provenance, the tensor table, and zero-copy views of tensor data.

    Same interface as GGUFFile (.metadata, .tensors, .raw(), .dequantize()), plus each tensor's .layout
    and .crc32, .provenance, .stored() for a tensor's bytes as stored (in its layout) and .rows() for them
    in GGUF's row layout.
    The mapping stays alive as long as any view handed out does, even after close().
    """

    major: int
    minor: int
    provenance: dict[str, Any]
    provenance_types: dict[str, str]
    header_size: int
    header_crc32: int
    data_size: int

    def _data_start(self) -> int:
        if self._data is None or self._data.size < PREAMBLE_BYTES:
            return 0
        fields = _PREAMBLE.unpack_from(self._data, 0)
        offset = int(fields[5])
        return offset if fields[0] == MAGIC and 0 < offset <= self._data.size else 0

    def _check_size(self, size: int) -> None:
        if size < PREAMBLE_BYTES:
            raise FormatError(f"{self._name}: preamble at offset 0: the file has {size} bytes, "
                              f"fewer than the {PREAMBLE_BYTES} of a .blm preamble")

    @property
    def version(self) -> str:
        return f"{self.major}.{self.minor}"

    # --- parsing -----------------------------------------------------------------------------------------

    def _error(self, field: str, offset: int, what: str) -> FormatError:
        return FormatError(f"{self._name}: {field} at offset {offset}: {what}")

    def _parse(self, buf: mmap.mmap) -> None:
        (magic, major, minor, alignment, header_size, data_offset, data_size, n_md, n_prov, n_tensors,
         crc, _reserved) = _PREAMBLE.unpack_from(buf, 0)
        if magic != MAGIC:
            raise self._error("magic", 0, f"not a barellm .blm file (it starts with {magic!r})")
        if major != MAJOR:
            if major > MAJOR:
                raise self._error("version", 8, f"format version {major}.{minor} is newer than this barellm reads "
                                  f"({MAJOR}.x): upgrade barellm, or convert the model again with this one")
            raise self._error("version", 8, f"format version {major}.{minor} is older than this barellm reads "
                              f"({MAJOR}.x): convert the model again from its source with `barellm convert`")
        self.major, self.minor = major, minor
        header_end = PREAMBLE_BYTES + header_size
        if header_size > self.file_size - PREAMBLE_BYTES:
            raise self._error("header_size", 16, f"a header of {header_size} bytes runs past the end of the file "
                              f"({self.file_size} bytes): the file is truncated or corrupt")
        # Checked before anything past the preamble is read: a flipped byte anywhere in the metadata or the
        # tensor table is refused here, not misread.
        computed = zlib.crc32(buf[_CRC_AT + 4:header_end], zlib.crc32(buf[:_CRC_AT] + b"\0\0\0\0"))
        if computed != crc:
            raise self._error("header_crc32", _CRC_AT, f"header checksum mismatch (stored {crc:#010x}, computed "
                              f"{computed:#010x}): the header or the tensor table is corrupt")
        if alignment & (alignment - 1) or not MIN_ALIGNMENT <= alignment <= MAX_ALIGNMENT:
            raise self._error("alignment", 12, f"{alignment} is not a power of two in {MIN_ALIGNMENT}..{MAX_ALIGNMENT}")
        if data_offset % PAGE or data_offset < header_end:
            raise self._error("data_offset", 24, f"{data_offset} is not a multiple of {PAGE} at or after the end "
                              f"of the header ({header_end})")
        if data_offset > self.file_size or data_size != self.file_size - data_offset:
            raise self._error("data_size", 32, f"the data section [{data_offset}, {data_offset + data_size}) does "
                              f"not end where the file does ({self.file_size} bytes): the file is truncated or "
                              "has bytes appended")
        self.alignment, self.header_size, self.header_crc32 = alignment, header_size, crc
        self.data_offset, self.data_size = data_offset, data_size

        cur = _Cursor(buf, PREAMBLE_BYTES, header_end, self._name)
        cur.fits(n_md, _MIN_KV_BYTES, "n_metadata", 40)
        self.metadata, self.metadata_types = cur.kvs(n_md, "metadata")
        cur.fits(n_prov, _MIN_KV_BYTES, "n_provenance", 44)
        self.provenance, self.provenance_types = cur.kvs(n_prov, "provenance")
        cur.fits(n_tensors, _MIN_TENSOR_BYTES, "n_tensors", 48)
        tensors: dict[str, TensorInfo] = {}
        for i in range(n_tensors):
            info = self._tensor(cur, i)
            if info.name in tensors:
                raise cur.error(f"tensor #{i} name", cur.pos - _ENTRY.size, f"duplicate tensor name {info.name!r}")
            tensors[info.name] = info
        if cur.pos != header_end:
            raise cur.error("header", cur.pos, f"{header_end - cur.pos} bytes left over after the tensor table")
        # disjoint ranges: overlapping tensors are never written, so they mean corruption or a crafted file
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
        for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:], strict=False):
            if start_b < end_a:
                raise self._error(f"tensor {b!r} offset", 0, f"data overlaps that of tensor {a!r}")
        self.tensors = tensors

    def _tensor(self, cur: _Cursor, i: int) -> TensorInfo:
        name = cur.name(f"tensor #{i} name")
        label = f"tensor {name!r}"
        at = cur.pos
        type_id, layout_tag, n_dims, crc, *dims, rel, nbytes = cur.unpack(_ENTRY, label)
        if n_dims > MAX_DIMS:
            raise cur.error(f"{label} n_dims", at + 8, f"{n_dims} dimensions (at most {MAX_DIMS})")
        if any(dims[n_dims:]):
            raise cur.error(f"{label} dims", at + 16, f"dimensions past n_dims = {n_dims} are not zero")
        shape = tuple(dims[:n_dims])
        if _too_big(shape):
            raise cur.error(f"{label} dims", at + 16, f"dimensions {shape} overflow int64 bytes")
        qt = quant.TYPES.get(type_id)
        if qt is None or not qt.has_layout:
            what = "was removed from ggml and has no layout" if qt else "is unknown to this barellm"
            raise cur.error(f"{label} type", at, f"ggml type {quant.type_name(type_id)} ({type_id}) {what}")
        row = shape[-1] if shape else 1
        if row % qt.block_size:
            raise cur.error(f"{label} dims", at + 16,
                            f"row length {row} is not a multiple of the {qt.name} block size {qt.block_size}")
        layout = LAYOUTS.get(layout_tag)
        if layout is None:
            raise cur.error(f"{label} layout", at + 4, f"unknown layout tag {layout_tag} (this barellm knows "
                            f"{', '.join(f'{t} {lt.name}' for t, lt in LAYOUTS.items())}); the file needs a newer "
                            "barellm, or convert it again with --layout rows")
        why = layout.check(type_id, shape)
        if why is not None:
            raise cur.error(f"{label} layout", at + 4, f"layout {layout.name} {why}")
        expected = layout.nbytes(type_id, shape)
        if nbytes != expected:
            raise cur.error(f"{label} nbytes", at + 56, f"{nbytes} bytes, but a {qt.name} tensor of shape {shape} "
                            f"in layout {layout.name} takes {expected}")
        if rel % self.alignment:
            raise cur.error(f"{label} offset", at + 48, f"{rel} is not a multiple of the alignment {self.alignment}")
        if rel > self.data_size or nbytes > self.data_size - rel:
            raise cur.error(f"{label} offset", at + 48, f"data [{rel}, {rel + nbytes}) runs past the end of the "
                            f"data section ({self.data_size} bytes)")
        return TensorInfo(name, shape, type_id, self.data_offset + rel, nbytes, layout=layout_tag, crc32=crc)

    # --- access ------------------------------------------------------------------------------------------

    def stored(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored, in layout `.layout`: a read-only uint8 view of the mapping (no copy)."""
        return self._bytes(name)

    def span(self, names: Iterable[str]) -> np.ndarray | None:
        """The bytes of several tensors as one read-only view (no copy), when the file stores them back to back
        in that order with nothing between: how a writer stores a fused group (Q|K|V, gate|up) as one matrix.
        None otherwise."""
        infos = [self._info(n) for n in names]
        if not infos or any(a.offset + a.nbytes != b.offset for a, b in zip(infos, infos[1:], strict=False)):
            return None
        if self._data is None:
            raise ValueError(f"{self._name}: the file is closed")
        return self._data[infos[0].offset:infos[-1].offset + infos[-1].nbytes]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes in GGUF's row layout, as GGUFFile.raw gives them: a read-only view (no copy).

        A tensor stored repacked is refused rather than handed out as rows it is not: callers that know
        layouts read it with stored() and its .layout, others with rows() (a converted copy).
        """
        info = self._info(name)
        if info.layout != LAYOUT_ROWS:
            raise FormatError(f"{self._name}: tensor {name!r} is stored in layout {info.layout_name}, not in rows; "
                              "read it with stored() and its .layout, or with rows()")
        return self.stored(name)

    def rows(self, name: str) -> np.ndarray:
        """The tensor's bytes in GGUF's row layout: the stored view itself for `rows`, else a new array."""
        info = self._info(name)
        data = self.stored(name)
        if info.layout == LAYOUT_ROWS:
            return data
        return LAYOUTS[info.layout].to_rows(data, info.type, info.shape)

    def __repr__(self) -> str:
        state = "closed" if self._data is None else f"{len(self.tensors)} tensors"
        return f"<BLMFile {self._name!r} v{getattr(self, 'major', '?')}.{getattr(self, 'minor', '?')} {state}>"

    # --- inspection --------------------------------------------------------------------------------------

    def header_lines(self) -> list[str]:
        """Header facts beyond the version, one line each, for `barellm inspect`."""
        p = self.provenance
        layouts = Counter(t.layout_name for t in self.tensors.values())
        lines = [
            f"tensors: {len(self.tensors)}, metadata keys: {len(self.metadata)}, header {self.header_size:,} B "
            f"(crc32 {self.header_crc32:#010x})",
            f"alignment: {self.alignment}, data section at offset {self.data_offset} ({self.data_size:,} B)",
            "layouts: " + ", ".join(f"{name} {n}" for name, n in layouts.most_common()),
        ]
        if p:
            src = f"source: {p.get('source.name', '?')} ({p.get('source.format', '?')}"
            if "source.size" in p:
                src += f", {p['source.size'] / 1e6:.1f} MB"
            lines.append(src + f", sha256 {p.get('source.sha256', '?')})")
            lines.append(f"converter: {p.get('converter.name', '?')} {p.get('converter.version', '?')} "
                         f"(revision {p.get('converter.revision', '?')}), type {p.get('convert.type', '?')}, "
                         f"layout {p.get('convert.layout', '?')}")
            extra = [k for k in p if not k.startswith(("source.", "converter.", "convert."))]
            lines += [f"provenance {k}: {p[k]!r}" for k in extra]
        return lines


# --- verify -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerifyResult:
    path: Path
    n_tensors: int
    nbytes: int
    seconds: float


def _mismatches(f: BLMFile, infos: Sequence[TensorInfo], progress: Progress | None = None) -> list[str]:
    """Each of infos whose data does not match its CRC-32, described."""
    def crc(info: TensorInfo) -> int:
        return zlib.crc32(f.stored(info.name))

    if sum(i.nbytes for i in infos) < 16 << 20:
        computed = list(map(crc, infos))
    else:  # zlib releases the GIL on large buffers: a few threads overlap the page faults and the sums
        from concurrent.futures import ThreadPoolExecutor  # (not imported by a load: 4 ms)

        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            computed = list(pool.map(crc, infos))
    if progress:
        progress.advance(sum(i.nbytes for i in infos))
    return [f"{i.name!r} (stored {i.crc32:#010x}, computed {c:#010x})"
            for i, c in zip(infos, computed, strict=True) if c != i.crc32]


def _mismatch_error(f: BLMFile, bad: list[str], n: int, how: str) -> FormatError:
    shown = "; ".join(bad[:8]) + (f"; and {len(bad) - 8} more" if len(bad) > 8 else "")
    return FormatError(f"{f.path}: tensor data checksum mismatch in {len(bad)} of {n} tensors{how}: {shown}")


def check_all(f: BLMFile, progress: Progress | None = None) -> None:
    """Checks every tensor's CRC-32; FormatError names every failure."""
    infos = list(f.tensors.values())
    bad = _mismatches(f, infos, progress)
    if bad:
        raise _mismatch_error(f, bad, len(infos), "")


SAMPLE_ALWAYS = 1 << 16  # tensors this small are checked at every load (norms, biases: a few hundred KB in all)
SAMPLE_BUDGET = 4 << 20  # bytes of larger tensors checked at a load, a different pick each time


def check_sample(f: BLMFile, budget: int | None = None, rng: random.Random | None = None) -> None:
    """Checks the CRC-32 of a sample of the tensors, cheap enough for every load: all the small ones, and
    larger ones picked at random up to `budget` bytes, so that successive loads cover different tensors
    (SmolLM2: 2 to 6 ms for 4 MB of its 97 MB). FormatError names a tensor whose data is corrupt; `check_all`
    (`barellm verify`, `--verify`) checks them all."""
    rng = rng or random.Random()
    budget = SAMPLE_BUDGET if budget is None else budget
    infos = list(f.tensors.values())
    sample = [i for i in infos if i.nbytes <= SAMPLE_ALWAYS]
    larger = [i for i in infos if SAMPLE_ALWAYS < i.nbytes <= budget]
    rng.shuffle(larger)
    left = budget
    for i in larger:
        if i.nbytes <= left:
            sample.append(i)
            left -= i.nbytes
    bad = _mismatches(f, sample)
    if bad:
        raise _mismatch_error(f, bad, len(sample), " checked at load (of a sample; `barellm verify` checks all)")


def verify(path: str | os.PathLike[str], progress: Progress | None = None) -> VerifyResult:
    """Checks the header (by opening the file) and every tensor's CRC-32; FormatError names every failure."""
    t0 = time.perf_counter()
    with BLMFile(path) as f:
        check_all(f, progress)
        n, total = len(f.tensors), sum(i.nbytes for i in f.tensors.values())
    return VerifyResult(Path(path), n, total, time.perf_counter() - t0)



