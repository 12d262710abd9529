"""A validating reader for GGUF files (versions 2 and 3, little-endian).

GGUF files come from anywhere, so the reader treats every number in them as hostile: each count, length,
dimension and offset is checked against the bytes that remain in the file (and against fixed sanity
limits) before anything is allocated or looped over on its behalf. A claim of 2^60 array elements
therefore fails at once on the size check instead of trying to build the array. Python integers cannot
overflow, but ggml's own limits on tensors are checked too (at most 4 dimensions, none negative, an
element count that fits int64, whole blocks per row, aligned offsets), so a tensor table accepted here
describes tensors ggml could hold.

Every problem raises `FormatError` with one line: "<path>: <field> at offset <n>: <what is wrong>".

Layout (all little-endian):
    magic "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata: key (string), value type (u32), value              -- repeated
    tensor infos: name (string), n_dims (u32), ne[n_dims] (u64), type (u32), offset (u64) -- repeated
    padding to `general.alignment` (default 32), then the data section; tensor offsets are relative to it
where a string is a u64 byte length followed by UTF-8 bytes, and an array value is an element type (u32),
a count (u64) and the elements (arrays may nest).
"""

from __future__ import annotations

import math
import mmap
import struct
from collections import Counter
from enum import IntEnum
from typing import Any

import numpy as np

from barellm.errors import FormatError
from barellm.formats import quant
from barellm.formats.mapped import MappedFile, TensorInfo, TensorNotFound
from barellm.formats.reader import BoundedReader

__all__ = ["GGUFFile", "TensorInfo", "TensorNotFound", "ValueType"]

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 24  # far above any real file's; keeps padding arithmetic meaningful
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_NAME_BYTES = 1 << 16  # keys and tensor names; real ones are tens of bytes
MAX_ARRAY_DEPTH = 8  # arrays of arrays are legal but never deep; bounds the recursion
INT64_MAX = (1 << 63) - 1

_HEADER_BYTES = 24


class ValueType(IntEnum):
    """GGUF metadata value types."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR_DTYPES: dict[ValueType, np.dtype] = {
    ValueType.UINT8: np.dtype("<u1"),
    ValueType.INT8: np.dtype("<i1"),
    ValueType.UINT16: np.dtype("<u2"),
    ValueType.INT16: np.dtype("<i2"),
    ValueType.UINT32: np.dtype("<u4"),
    ValueType.INT32: np.dtype("<i4"),
    ValueType.FLOAT32: np.dtype("<f4"),
    ValueType.BOOL: np.dtype("<u1"),
    ValueType.UINT64: np.dtype("<u8"),
    ValueType.INT64: np.dtype("<i8"),
    ValueType.FLOAT64: np.dtype("<f8"),
}
# Spelled out rather than derived from the dtypes: NumPy's type chars are platform C types ("L" is
# uint64 on Linux), while struct's "<" formats have fixed standard sizes ("<L" is 4 bytes).
_SCALAR_STRUCTS = {
    t: struct.Struct(fmt)
    for t, fmt in {
        ValueType.UINT8: "<B",
        ValueType.INT8: "<b",
        ValueType.UINT16: "<H",
        ValueType.INT16: "<h",
        ValueType.UINT32: "<I",
        ValueType.INT32: "<i",
        ValueType.FLOAT32: "<f",
        ValueType.BOOL: "<B",
        ValueType.UINT64: "<Q",
        ValueType.INT64: "<q",
        ValueType.FLOAT64: "<d",
    }.items()
}
assert all(_SCALAR_STRUCTS[t].size == dt.itemsize for t, dt in _SCALAR_DTYPES.items())
# The spec says uint32; any integer type is accepted since the value is checked anyway.
_INTEGER_TYPE_NAMES = frozenset(
    t.name.lower() for t in _SCALAR_DTYPES if t not in (ValueType.FLOAT32, ValueType.FLOAT64, ValueType.BOOL)
)
# The fewest bytes one element of each type can take; an array's count is checked against the bytes left
# using these before a single element is read.
_MIN_ELEMENT_BYTES = {
    **{t: dt.itemsize for t, dt in _SCALAR_DTYPES.items()},
    ValueType.STRING: 8,
    ValueType.ARRAY: 12,
}
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims = 0, type, offset

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


class _Parser(BoundedReader):
    """The GGUF header's values on the bounds-checked cursor, over the whole file."""

    def __init__(self, buf: mmap.mmap, size: int, path: str) -> None:
        super().__init__(buf, 0, size, path)

    def u32(self, field: str) -> int:
        return self.unpack(_U32, field)

    def u64(self, field: str) -> int:
        return self.unpack(_U64, field)

    def i64(self, field: str) -> int:
        return self.unpack(_I64, field)

    def count(self, field: str, min_item_bytes: int, what: str) -> int:
        """A u64 count of items, each at least `min_item_bytes` long, that must fit in what is left."""
        at = self.pos
        n = self.u64(field)
        self.fits(n, min_item_bytes, field, at, what)
        return n

    def string(self, field: str, limit: int | None = None) -> str:
        at = self.pos
        n = self.u64(field)
        if limit is not None and n > limit and n <= self.left():
            raise self.error(field, at, f"string length {n} exceeds the limit of {limit} bytes")
        return self.text(n, field, at)

    def value_type(self, field: str) -> ValueType:
        at = self.pos
        t = self.u32(field)
        try:
            return ValueType(t)
        except ValueError:
            raise self.error(field, at, f"unknown value type {t}") from None

    def scalar(self, vtype: ValueType, field: str) -> Any:
        if vtype is ValueType.STRING:
            return self.string(field)
        st = _SCALAR_STRUCTS[vtype]
        self.need(st.size, field)
        (v,) = st.unpack_from(self.buf, self.pos)
        if vtype is ValueType.BOOL:
            if v > 1:
                raise self.error(field, self.pos, f"bool value is {v}, not 0 or 1")
            v = bool(v)
        self.pos += st.size
        return v

    def value(self, vtype: ValueType, field: str, depth: int = 0) -> tuple[Any, str]:
        """A value and a description of its type ("uint32", "array[string]")."""
        if vtype is not ValueType.ARRAY:
            return self.scalar(vtype, field), vtype.name.lower()
        if depth >= MAX_ARRAY_DEPTH:
            raise self.error(field, self.pos, f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
        etype = self.value_type(f"{field} array type")
        n = self.count(f"{field} array count", _MIN_ELEMENT_BYTES[etype], f"{etype.name.lower()} elements")
        if etype is ValueType.STRING:
            return self.string_array(n, field), "array[string]"
        if etype is ValueType.ARRAY:
            items = []
            inner = "array"
            for i in range(n):
                item, inner = self.value(ValueType.ARRAY, f"{field}[{i}]", depth + 1)
                items.append(item)
            return items, f"array[{inner}]"
        if n == 0:
            return [], f"array[{etype.name.lower()}]"
        dt = _SCALAR_DTYPES[etype]
        at = self.pos
        arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=at)  # in bounds: count() checked n * size
        self.pos += n * dt.itemsize
        if etype is ValueType.BOOL:
            bad = np.flatnonzero(arr > 1)
            if bad.size:
                i = int(bad[0])
                raise self.error(f"{field}[{i}]", at + i, f"bool value is {arr[i]}, not 0 or 1")
            return arr.astype(bool).tolist(), "array[bool]"
        return arr.tolist(), f"array[{etype.name.lower()}]"

    def string_array(self, n: int, field: str) -> list[str]:
        # Vocabularies run to hundreds of thousands of strings: this loop is the hot path of opening a
        # file, hence the local names.
        buf, size, pos = self.buf, self.end, self.pos
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for i in range(n):
            if size - pos < 8:
                self.pos = pos
                self.need(8, f"{field}[{i}] length")
            (length,) = unpack(buf, pos)
            pos += 8
            if length > size - pos:
                raise self.error(
                    f"{field}[{i}] length",
                    pos - 8,
                    f"string length {length} runs past the end of the {self.region} ({size - pos} bytes left)",
                )
            append(buf[pos : pos + length].decode("utf-8", "surrogateescape"))
            pos += length
        self.pos = pos
        return out


class GGUFFile(MappedFile):
    """An open GGUF file: its metadata, its tensor table, and zero-copy views of tensor data.

    `metadata` holds plain Python values (int, float, bool, str; arrays as lists, nested arrays as nested
    lists) in file order; `metadata_types` gives each key's GGUF type ("uint32", "array[string]").
    `tensors` is in file order, shapes in NumPy order.

    The file is memory-mapped; `raw()` views stay valid as long as they are referenced, even after
    `close()` (the mapping is released when the last view goes).
    """

    version: int

    def _check_size(self, size: int) -> None:
        if size == 0:
            raise FormatError(f"{self._name}: magic at offset 0: the file is empty, not a GGUF file")

    # --- parsing ---------------------------------------------------------------------------------------

    def _parse(self, buf: mmap.mmap) -> None:
        p = _Parser(buf, self.file_size, self._name)
        head = buf[:4]
        if head != MAGIC[: len(head)]:
            raise p.error("magic", 0, f"not a GGUF file (it starts with {head!r})")
        p.need(4, "magic")
        p.pos = 4
        version = p.u32("version")
        if version not in SUPPORTED_VERSIONS:
            if version & 0xFFFF == 0 and (version >> 24) in SUPPORTED_VERSIONS:
                raise p.error("version", 4, "big-endian GGUF files are not supported")
            raise p.error("version", 4, f"GGUF version {version} is not supported (only 2 and 3 are)")
        self.version = version

        n_tensors = p.count("tensor count", _MIN_TENSOR_INFO_BYTES, "tensor infos")
        n_kv = p.count("metadata count", _MIN_KV_BYTES, "metadata entries")

        metadata: dict[str, Any] = {}
        types: dict[str, str] = {}
        value_at: dict[str, int] = {}
        for i in range(n_kv):
            at = p.pos
            key = p.string(f"metadata key #{i}", MAX_NAME_BYTES)
            if key in metadata:
                raise p.error(f"metadata key #{i}", at, f"duplicate key {key!r}")
            vtype = p.value_type(f"metadata {key!r} type")
            value_at[key] = p.pos
            metadata[key], types[key] = p.value(vtype, f"metadata {key!r}")
        self.metadata = metadata
        self.metadata_types = types
        self.alignment = self._alignment(p, value_at.get("general.alignment"))

        # Tensor offsets are relative to the data section, which starts after the last tensor info: all
        # infos are read before any tensor can be placed.
        infos = {}
        for i in range(n_tensors):
            at = p.pos
            info = self._tensor_info(p, i)
            if info[0] in infos:
                raise p.error(f"tensor #{i} name", at, f"duplicate tensor name {info[0]!r}")
            infos[info[0]] = info
        self.data_offset = -(-p.pos // self.alignment) * self.alignment
        self.tensors = {name: self._place(p, *info) for name, info in infos.items()}
        # disjoint data: tensors that share bytes mean a corrupt or crafted file, whose weights are garbage
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values() if t.nbytes)
        for (start_a, end_a, a), (start_b, end_b, b) in zip(spans, spans[1:], strict=False):
            if start_b < end_a:
                raise p.error(f"tensor {b!r} offset", infos[b][4],
                              f"its data [{start_b}, {end_b}) overlaps that of tensor {a!r} [{start_a}, {end_a})")

    def _alignment(self, p: _Parser, at: int | None) -> int:
        if at is None:
            return DEFAULT_ALIGNMENT
        value, vtype = self.metadata["general.alignment"], self.metadata_types["general.alignment"]
        field = "metadata 'general.alignment'"
        if vtype not in _INTEGER_TYPE_NAMES:
            raise p.error(field, at, f"must be an integer, not {vtype}")
        if value <= 0 or value & (value - 1) or value > MAX_ALIGNMENT:
            raise p.error(field, at, f"{value} is not a power of two between 1 and {MAX_ALIGNMENT}")
        return value

    def _tensor_info(self, p: _Parser, i: int) -> tuple[str, tuple[int, ...], int, int, int]:
        name_at = p.pos
        name = p.string(f"tensor #{i} name", MAX_NAME_BYTES)
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:   # surrogateescape kept its bad bytes: no loader could ask for this name
            raw = name.encode("utf-8", "surrogateescape")
            raise p.error(f"tensor #{i} name", name_at, f"name {raw[:100]!r} is not valid UTF-8") from None
        label = f"tensor {name!r}"
        at = p.pos
        n_dims = p.u32(f"{label} n_dims")
        if n_dims > MAX_DIMS:
            raise p.error(f"{label} n_dims", at, f"{n_dims} dimensions (at most {MAX_DIMS})")
        dims_at = p.pos
        ne = []
        for j in range(n_dims):
            at = p.pos
            d = p.i64(f"{label} dims")
            if d < 0:
                raise p.error(f"{label} dims", at, f"dimension {j} is {d}")
            ne.append(d)
        at = p.pos
        ttype = p.u32(f"{label} type")
        qt = quant.TYPES.get(ttype)
        if qt is None:
            raise p.error(f"{label} type", at, f"unknown ggml type {ttype}")
        if not qt.has_layout:
            raise p.error(f"{label} type", at, f"ggml type {qt.name} ({ttype}) was removed and has no layout")
        if math.prod(ne) > INT64_MAX:  # at most 4 factors below 2^63: exact in Python, cheap
            raise p.error(f"{label} dims", dims_at, f"element count of {ne} overflows int64")
        row = ne[0] if ne else 1
        if row % qt.block_size:
            raise p.error(
                f"{label} dims",
                dims_at,
                f"row length {row} is not a multiple of the {qt.name} block size {qt.block_size}",
            )
        offset_at = p.pos
        rel = p.u64(f"{label} offset")
        return name, tuple(reversed(ne)), ttype, rel, offset_at

    def _place(self, p: _Parser, name: str, shape: tuple[int, ...], ttype: int, rel: int, offset_at: int) -> TensorInfo:
        field = f"tensor {name!r} offset"
        if rel % self.alignment:
            raise p.error(field, offset_at, f"data offset {rel} is not a multiple of the alignment {self.alignment}")
        size = quant.nbytes(ttype, shape)
        start = self.data_offset + rel
        if start + size > self.file_size:
            raise p.error(
                field,
                offset_at,
                f"data [{start}, {start + size}) runs past the end of the file ({self.file_size} bytes)",
            )
        return TensorInfo(name, shape, ttype, start, size)

    # --- access ----------------------------------------------------------------------------------------

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes: a read-only uint8 view into the mapped file (no copy)."""
        return self._bytes(name)

    def __repr__(self) -> str:
        state = "closed" if self._data is None else f"{len(self.tensors)} tensors"
        return f"<GGUFFile {self._name!r} v{getattr(self, 'version', '?')} {state}>"

    # --- inspection ------------------------------------------------------------------------------------

    def header_lines(self) -> list[str]:
        """Header facts beyond the version, one line each, for `barellm inspect`."""
        return [
            f"tensors: {len(self.tensors)}, metadata keys: {len(self.metadata)}",
            f"alignment: {self.alignment}, data section at offset {self.data_offset}",
        ]

    def summary(self, preview_chars: int = 60, preview_items: int = 4) -> dict[str, Any]:
        """What `barellm inspect` shows, as plain data: header facts, metadata previews, the tensor table."""
        return {
            "path": self._name,
            "version": self.version,
            "file_size": self.file_size,
            "alignment": self.alignment,
            "data_offset": self.data_offset,
            "n_tensors": len(self.tensors),
            "n_elements": sum(t.n_elements for t in self.tensors.values()),
            "tensor_types": dict(Counter(t.type_name for t in self.tensors.values())),
            "metadata": [
                {
                    "key": k,
                    "type": self.metadata_types[k],
                    "value": _preview(v, preview_chars, preview_items),
                }
                for k, v in self.metadata.items()
            ],
            "tensors": [
                {"name": t.name, "type": t.type_name, "shape": t.shape, "nbytes": t.nbytes, "offset": t.offset}
                for t in self.tensors.values()
            ],
        }


def _preview(value: Any, chars: int, items: int) -> str:
    """A one-line rendering of a metadata value, long strings cut and long arrays abbreviated."""
    if isinstance(value, list):
        shown = ", ".join(_preview(v, max(12, chars // max(items, 1)), items) for v in value[:items])
        if len(value) > items:
            return f"[{shown}, ... ({len(value)} items)]"
        return f"[{shown}]"
    if isinstance(value, str):
        text = repr(value)
        return text if len(text) <= chars else text[: max(chars - 3, 1)] + "..."
    return repr(value)
