"""Writing barellm's own format (docs/format.md): the header with its metadata and tensor table, then each
tensor's data, page-aligned, in the layout asked for, with its CRC32; written through files.atomic_write, so
a file is either whole or absent. formats/blm.py reads what this writes.
"""

from __future__ import annotations

import os
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from barellm.errors import BarellmError, FormatError
from barellm.files import atomic_write, remove_stale_temps
from barellm.formats import quant
from barellm.formats.blm import (
    _ARRAY,
    _BOOL,
    _CRC_AT,
    _DTYPES,
    _ENTRY,
    _INT_RANGES,
    _PREAMBLE,
    _STRING,
    _STRUCTS,
    _TYPE_CODES,
    _TYPE_NAMES,
    _U8,
    _U16,
    _U32,
    _U64,
    DEFAULT_ALIGNMENT,
    LAYOUT_ROWS,
    LAYOUTS,
    MAGIC,
    MAJOR,
    MAX_ALIGNMENT,
    MAX_DIMS,
    MAX_NAME_BYTES,
    MIN_ALIGNMENT,
    MINOR,
    PAGE,
    PREAMBLE_BYTES,
    _round_up,
    _too_big,
)
from barellm.progress import Progress

__all__ = ["TensorSpec", "infer_type", "write_blm"]

# --- metadata values -------------------------------------------------------------------------------------

def infer_type(value: Any) -> str:
    """The value type a Python value is written as when none is given ("uint32", "array[string]", ...)."""
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, np.generic) and value.dtype in _DTYPES.values():
        return next(_TYPE_NAMES[t] for t, dt in _DTYPES.items() if dt == value.dtype.newbyteorder("<")
                    and t != _BOOL)
    if isinstance(value, int):
        if value < 0:
            return "int32" if value >= -(1 << 31) else "int64"
        return "uint32" if value < (1 << 32) else "uint64"
    if isinstance(value, float):
        return "float32"
    if isinstance(value, (str, bytes)):
        return "string"
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return f"array[{infer_type(value.dtype.type(0))}]" if value.dtype != np.bool_ else "array[bool]"
    if isinstance(value, (list, tuple)):
        if not value:
            return "array[uint8]"
        inner = infer_type(value[0])
        if inner == "float32" or any(isinstance(v, float) for v in value):
            return "array[float32]"
        if inner in ("int32", "uint32", "int64", "uint64"):
            lo, hi = min(value), max(value)
            if lo >= -(1 << 31) and hi < (1 << 31):
                return "array[int32]"
            return "array[int64]" if lo < 0 else "array[uint64]"
        return f"array[{inner}]"
    raise FormatError(f"cannot store a metadata value of type {type(value).__name__}")

def _parse_type_name(name: str, key: str) -> tuple[int, int | None]:
    """("array[string]") -> (9, 8); ("uint32") -> (4, None)."""
    if name.startswith("array[") and name.endswith("]"):
        inner = _TYPE_CODES.get(name[6:-1])
        if inner is None or inner == _ARRAY:
            raise FormatError(f"metadata {key!r}: value type {name!r} cannot be stored (arrays do not nest)")
        return _ARRAY, inner
    code = _TYPE_CODES.get(name)
    if code is None or code == _ARRAY:
        raise FormatError(f"metadata {key!r}: unknown value type {name!r}")
    return code, None

def _encode_str(s: str | bytes, what: str) -> bytes:
    b = s if isinstance(s, bytes) else s.encode("utf-8", "surrogateescape")
    if len(b) > 0xFFFFFFFF:
        raise FormatError(f"{what}: a string of {len(b)} bytes is too long")
    return b

def _encode_scalar(code: int, v: Any, key: str) -> bytes:
    if code == _STRING:
        if not isinstance(v, (str, bytes)):
            raise FormatError(f"metadata {key!r}: expected a string, got {type(v).__name__}")
        b = _encode_str(v, f"metadata {key!r}")
        return _U32.pack(len(b)) + b
    if code == _BOOL:
        if not isinstance(v, (bool, np.bool_)) and v not in (0, 1):
            raise FormatError(f"metadata {key!r}: expected a bool, got {v!r}")
        return _U8.pack(int(bool(v)))
    if code in _INT_RANGES:
        lo, hi = _INT_RANGES[code]
        if isinstance(v, (bool, float)) or not isinstance(v, (int, np.integer)) or not lo <= int(v) <= hi:
            raise FormatError(f"metadata {key!r}: {v!r} is not a {_TYPE_NAMES[code]}")
        return _STRUCTS[code].pack(int(v))
    if not isinstance(v, (int, float, np.floating, np.integer)) or isinstance(v, bool):
        raise FormatError(f"metadata {key!r}: {v!r} is not a {_TYPE_NAMES[code]}")
    return _STRUCTS[code].pack(float(v))

def _name_bytes(name: str, what: str) -> bytes:
    """A key's or tensor's name as UTF-8 (a name read from a file with invalid UTF-8 has none)."""
    try:
        return name.encode("utf-8")
    except UnicodeEncodeError:
        raise FormatError(f"{what} {name!r}: not valid UTF-8") from None

def _encode_kv(out: bytearray, key: str, value: Any, type_name: str) -> None:
    kb = _name_bytes(key, "metadata key")
    if not 0 < len(kb) <= MAX_NAME_BYTES:
        raise FormatError(f"metadata key {key!r}: must be 1 to {MAX_NAME_BYTES} bytes of UTF-8")
    code, inner = _parse_type_name(type_name, key)
    out += _U16.pack(len(kb)) + kb + _U8.pack(code)
    if inner is None:
        out += _encode_scalar(code, value, key)
        return
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise FormatError(f"metadata {key!r}: expected a list for {type_name}, got {type(value).__name__}")
    out += _U8.pack(inner) + _U64.pack(len(value))
    if inner == _STRING:
        try:
            parts = [_encode_str(s, f"metadata {key!r}") for s in value]
        except (AttributeError, TypeError):
            raise FormatError(f"metadata {key!r}: every element of {type_name} must be a string") from None
        out += np.array([len(p) for p in parts], dtype="<u4").tobytes()
        out += b"".join(parts)
    elif inner in _INT_RANGES or inner == _BOOL:
        for v in value:  # range-checks each element with the scalar rules (and clear messages)
            _encode_scalar(inner, v, key)
        out += np.asarray([int(v) for v in value], dtype=_DTYPES[inner]).tobytes()
    else:
        out += np.asarray(value, dtype=_DTYPES[inner]).tobytes()


# --- tensors and the file --------------------------------------------------------------------------------

@dataclass
class TensorSpec:
    """A tensor to write. `data` holds its bytes in `layout` (any dtype; its bytes are taken), or is a
    function that returns them, called once when the tensor is written (so a converter holds one tensor
    in memory at a time)."""

    name: str
    type: int
    shape: tuple[int, ...]
    data: np.ndarray | bytes | Callable[[], np.ndarray | bytes]
    layout: int = LAYOUT_ROWS

def _check_spec(spec: TensorSpec) -> int:
    """The spec's byte size, after checking it is something a reader will accept."""
    nb = _name_bytes(spec.name, "tensor name")
    if not 0 < len(nb) <= MAX_NAME_BYTES:
        raise FormatError(f"tensor name {spec.name!r}: must be 1 to {MAX_NAME_BYTES} bytes of UTF-8")
    shape = tuple(int(d) for d in spec.shape)
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape) or _too_big(shape):
        raise FormatError(f"tensor {spec.name!r}: shape {shape} (at most {MAX_DIMS} non-negative dimensions, "
                          "fewer than 2^63 bytes as float64)")
    qt = quant.TYPES.get(spec.type)
    if qt is None or not qt.has_layout:
        raise FormatError(f"tensor {spec.name!r}: ggml type {spec.type} cannot be stored")
    if (shape[-1] if shape else 1) % qt.block_size:
        raise FormatError(f"tensor {spec.name!r}: row length {shape[-1]} is not a multiple of the {qt.name} block "
                          f"size {qt.block_size}")
    layout = LAYOUTS.get(spec.layout)
    if layout is None:
        raise FormatError(f"tensor {spec.name!r}: unknown layout tag {spec.layout}")
    why = layout.check(spec.type, shape)
    if why is not None:
        raise FormatError(f"tensor {spec.name!r}: layout {layout.name} {why}")
    return layout.nbytes(spec.type, shape)

def _as_bytes(data: np.ndarray | bytes) -> np.ndarray:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)

def _kv_section(values: Mapping[str, Any], types: Mapping[str, str] | None) -> bytes:
    out = bytearray()
    for key, value in values.items():
        _encode_kv(out, key, value, (types or {}).get(key) or infer_type(value))
    return bytes(out)

def write_blm(path: str | os.PathLike[str], metadata: Mapping[str, Any], tensors: Iterable[TensorSpec], *,
              metadata_types: Mapping[str, str] | None = None, provenance: Mapping[str, Any] | None = None,
              provenance_types: Mapping[str, str] | None = None, alignment: int = DEFAULT_ALIGNMENT,
              progress: Progress | None = None) -> Path:
    """Writes a .blm file atomically (temp file, fsync, rename); an error leaves nothing at `path` that is new.

    Value types come from `metadata_types` ("uint32", "array[string]", ...) where given, else `infer_type`.
    """
    path = Path(path)
    if alignment & (alignment - 1) or not MIN_ALIGNMENT <= alignment <= MAX_ALIGNMENT:
        raise FormatError(f"alignment {alignment} is not a power of two in {MIN_ALIGNMENT}..{MAX_ALIGNMENT}")
    specs = list(tensors)
    sizes = [_check_spec(s) for s in specs]
    names = Counter(s.name for s in specs)
    dup = [n for n, c in names.items() if c > 1]
    if dup:
        raise FormatError(f"tensor {dup[0]!r} is given twice")
    offsets = []
    end = 0
    for n in sizes:
        start = _round_up(end, alignment)
        offsets.append(start)
        end = start + n
    data_size = end
    md = _kv_section(metadata, metadata_types)
    prov = _kv_section(provenance or {}, provenance_types)

    def table(crcs: list[int]) -> bytes:
        out = bytearray()
        for spec, off, n, crc in zip(specs, offsets, sizes, crcs, strict=True):
            nb = spec.name.encode("utf-8")
            shape = tuple(int(d) for d in spec.shape)
            dims = list(shape) + [0] * (MAX_DIMS - len(shape))
            out += _U16.pack(len(nb)) + nb
            out += _ENTRY.pack(spec.type, spec.layout, len(shape), crc, *dims, off, n)
        return bytes(out)

    body_size = len(md) + len(prov) + len(table([0] * len(specs)))
    data_offset = _round_up(PREAMBLE_BYTES + body_size, PAGE)
    if len(metadata) > 0xFFFFFFFF or len(provenance or {}) > 0xFFFFFFFF or len(specs) > 0xFFFFFFFF:
        raise FormatError("too many metadata entries or tensors for one file")

    remove_stale_temps(Path(path).parent, ".blm")  # what writers killed part-way left in that directory
    try:
        with atomic_write(path, drop_cache=True) as f:
            # Zeros where the header goes: until the very end the file has no magic, so a writer killed
            # part-way leaves a temp file that no reader mistakes for a model.
            f.write(b"\0" * data_offset)
            crcs = []
            pos = 0
            for spec, off, n in zip(specs, offsets, sizes, strict=True):
                data = spec.data() if callable(spec.data) else spec.data
                arr = _as_bytes(data)
                if arr.size != n:
                    raise FormatError(f"tensor {spec.name!r}: {arr.size} bytes of data given, but its type, shape "
                                      f"and layout take {n}")
                if off > pos:
                    f.write(b"\0" * (off - pos))
                f.write(memoryview(arr))
                crcs.append(zlib.crc32(arr))
                pos = off + n
                del data, arr
                if progress:
                    progress.advance(n)
            f.flush()
            os.fsync(f.fileno())
            body = md + prov + table(crcs)
            assert len(body) == body_size
            pre = _PREAMBLE.pack(MAGIC, MAJOR, MINOR, alignment, body_size, data_offset, data_size, len(metadata),
                                 len(provenance or {}), len(specs), 0, b"\0" * 8)
            crc = zlib.crc32(body, zlib.crc32(pre))  # the crc field is still zero in `pre`
            pre = pre[:_CRC_AT] + _U32.pack(crc) + pre[_CRC_AT + 4:]
            f.seek(PREAMBLE_BYTES)
            f.write(body)
            f.flush()
            f.seek(0)
            f.write(pre)  # the magic goes in last
    except OSError as e:
        raise BarellmError(f"{path}: cannot write: {e.strerror or e}") from e
    return path
