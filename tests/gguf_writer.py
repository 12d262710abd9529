"""Writes small GGUF files for tests: synthetic models, every metadata value type, and the raw material
for deliberately broken files (the byte offset of every field is returned, so a test can corrupt exactly
the field it means to).

Metadata values are given as plain Python or NumPy values, whose GGUF type is inferred, or as `Value`
when the type must be exact:

    bool -> bool, int -> uint32 (int32 if negative, 64-bit if it does not fit), float -> float32,
    str -> string, bytes -> string (raw bytes, so invalid UTF-8 can be written), NumPy scalar -> its type,
    1-D NumPy array -> array of its type, list -> array typed by its first element (nested lists nest).

Tensors are `(name, values, ggml_type)`, with float values encoded by `barellm.formats.quant.quantize`, or
`(name, raw_bytes, ggml_type, shape)` with the encoding already done. Shapes are in NumPy order.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from barellm.formats import quant


class VT(IntEnum):
    """GGUF metadata value types (kept here so the writer does not lean on the reader it tests)."""

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


SCALAR_FORMATS = {
    VT.UINT8: "<B",
    VT.INT8: "<b",
    VT.UINT16: "<H",
    VT.INT16: "<h",
    VT.UINT32: "<I",
    VT.INT32: "<i",
    VT.FLOAT32: "<f",
    VT.BOOL: "<?",
    VT.UINT64: "<Q",
    VT.INT64: "<q",
    VT.FLOAT64: "<d",
}

_DTYPE_TO_VT = {
    np.dtype(np.uint8): VT.UINT8,
    np.dtype(np.int8): VT.INT8,
    np.dtype(np.uint16): VT.UINT16,
    np.dtype(np.int16): VT.INT16,
    np.dtype(np.uint32): VT.UINT32,
    np.dtype(np.int32): VT.INT32,
    np.dtype(np.float32): VT.FLOAT32,
    np.dtype(np.bool_): VT.BOOL,
    np.dtype(np.uint64): VT.UINT64,
    np.dtype(np.int64): VT.INT64,
    np.dtype(np.float64): VT.FLOAT64,
}


class Value(NamedTuple):
    """A metadata value with its GGUF type spelled out; `elem` is the element type of an array."""

    type: VT
    value: Any
    elem: VT | None = None


def array(elem: VT, values: Sequence[Any]) -> Value:
    return Value(VT.ARRAY, list(values), elem)


@dataclass
class Built:
    """A GGUF file's bytes and the offset of each of its fields.

    Field names: magic, version, tensor_count, kv_count; kv.<key>.key (the key's length), .type, .value
    (for arrays also .elem_type and .count); tensor.<name>.name, .n_dims, .dims, .type, .offset;
    tensor_infos_end; data (start of the data section); tensor.<name>.data.
    """

    data: bytes
    fields: dict[str, int] = field(default_factory=dict)
    alignment: int = 32

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_bytes(self.data)
        return path


def infer(value: Any) -> Value:
    """The GGUF type the writer gives a plain value."""
    if isinstance(value, Value):
        return value
    if isinstance(value, (bool, np.bool_)):
        return Value(VT.BOOL, bool(value))
    if isinstance(value, np.generic):
        return Value(_DTYPE_TO_VT[value.dtype], value.item())
    if isinstance(value, int):
        if 0 <= value < 1 << 32:
            return Value(VT.UINT32, value)
        if -(1 << 31) <= value < 0:
            return Value(VT.INT32, value)
        return Value(VT.UINT64 if value >= 0 else VT.INT64, value)
    if isinstance(value, float):
        return Value(VT.FLOAT32, value)
    if isinstance(value, (str, bytes)):
        return Value(VT.STRING, value)
    if isinstance(value, np.ndarray):
        return Value(VT.ARRAY, value.tolist(), _DTYPE_TO_VT[value.dtype])
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("an empty list has no element type: use array(VT.X, [])")
        return Value(VT.ARRAY, list(value), infer(value[0]).type)
    raise TypeError(f"no GGUF type for {type(value).__name__}")


class _Out:
    def __init__(self) -> None:
        self.buf = bytearray()
        self.fields: dict[str, int] = {}

    def mark(self, name: str) -> None:
        self.fields[name] = len(self.buf)

    def pack(self, fmt: str, *v: Any) -> None:
        self.buf += struct.pack(fmt, *v)

    def string(self, s: str | bytes) -> None:
        b = s.encode("utf-8", "surrogateescape") if isinstance(s, str) else s
        self.pack("<Q", len(b))
        self.buf += b

    def value(self, v: Value, prefix: str | None = None) -> None:
        if v.type == VT.STRING:
            self.string(v.value)
        elif v.type == VT.ARRAY:
            elem = v.elem if v.elem is not None else infer(v.value[0]).type
            if prefix:
                self.mark(prefix + ".elem_type")
            self.pack("<I", elem)
            if prefix:
                self.mark(prefix + ".count")
            self.pack("<Q", len(v.value))
            for item in v.value:
                self.value(infer(item) if elem == VT.ARRAY else Value(elem, item))
        else:
            self.pack(SCALAR_FORMATS[v.type], v.value)


def _tensor_bytes(spec: tuple) -> tuple[str, bytes, int, tuple[int, ...]]:
    if len(spec) == 4:
        name, raw, ttype, shape = spec
        return name, bytes(raw), int(ttype), tuple(shape)
    name, values, ttype = spec
    values = np.asarray(values, dtype=np.float32)
    return name, quant.quantize(values, int(ttype)).tobytes(), int(ttype), values.shape


def build_gguf(
    metadata: Mapping[str, Any],
    tensors: Sequence[tuple] = (),
    *,
    version: int = 3,
    alignment: int = 32,
) -> Built:
    """A GGUF file in memory. A non-default `alignment` is also written as general.alignment."""
    out = _Out()
    md = dict(metadata)
    if alignment != 32 and "general.alignment" not in md:
        md["general.alignment"] = Value(VT.UINT32, alignment)
    encoded = [_tensor_bytes(t) for t in tensors]

    out.mark("magic")
    out.buf += b"GGUF"
    out.mark("version")
    out.pack("<I", version)
    out.mark("tensor_count")
    out.pack("<Q", len(encoded))
    out.mark("kv_count")
    out.pack("<Q", len(md))
    for key, raw_value in md.items():
        v = infer(raw_value)
        out.mark(f"kv.{key}.key")
        out.string(key)
        out.mark(f"kv.{key}.type")
        out.pack("<I", v.type)
        out.mark(f"kv.{key}.value")
        out.value(v, prefix=f"kv.{key}")

    rel = 0
    placed = []
    for name, raw, ttype, shape in encoded:
        out.mark(f"tensor.{name}.name")
        out.string(name)
        out.mark(f"tensor.{name}.n_dims")
        out.pack("<I", len(shape))
        out.mark(f"tensor.{name}.dims")
        for d in reversed(shape):
            out.pack("<Q", d)
        out.mark(f"tensor.{name}.type")
        out.pack("<I", ttype)
        out.mark(f"tensor.{name}.offset")
        out.pack("<Q", rel)
        placed.append((name, rel, raw))
        rel += -(-len(raw) // alignment) * alignment
    out.mark("tensor_infos_end")

    out.buf += bytes(-len(out.buf) % alignment)
    out.mark("data")
    data_start = len(out.buf)
    for name, offset, raw in placed:
        out.buf += bytes(data_start + offset - len(out.buf))
        out.mark(f"tensor.{name}.data")
        out.buf += raw
    out.buf += bytes(-len(out.buf) % alignment)
    return Built(bytes(out.buf), out.fields, alignment)


def write_gguf(path: str | Path, metadata: Mapping[str, Any], tensors: Sequence[tuple] = (), **kw: Any) -> Built:
    """Write `build_gguf(metadata, tensors, **kw)` to `path` and return it."""
    built = build_gguf(metadata, tensors, **kw)
    built.write(path)
    return built
