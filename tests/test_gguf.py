"""The GGUF reader: agreement with the `gguf` package on real files, every value type on synthetic files,
and refusal (FormatError only, fast, without big allocations) of malformed and fuzzed files."""

from __future__ import annotations

import os
import re
import struct
import time
import tracemalloc
from pathlib import Path

import gguf as oracle
import numpy as np
import pytest

from barellm.errors import FormatError, ModelNotFound
from barellm.formats import quant
from barellm.formats.gguf import GGUFFile, TensorInfo, TensorNotFound

from gguf_writer import VT, Built, Value, array, build_gguf

U64_MAX = (1 << 64) - 1

# --- against the gguf package on the real models ----------------------------------------------------------


# Reading Gemma's 262k-token vocabulary takes the package tens of seconds, so that comparison is `slow`.
REAL = ["smollm_gguf", pytest.param("gemma_gguf", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=REAL)
def real(request):
    """(our reading, the package's reading) of each real model file."""
    path = request.getfixturevalue(request.param)
    with GGUFFile(path) as ours:
        yield ours, oracle.GGUFReader(path)


@pytest.fixture(scope="module", params=["smollm_gguf", "gemma_gguf"])
def ours(request):
    with GGUFFile(request.getfixturevalue(request.param)) as f:
        yield f


def oracle_type(types: list) -> str:
    """The package's list of nested types ([ARRAY, STRING]) in our spelling ("array[string]")."""
    names = [oracle.GGUFValueType(t).name.lower() for t in types]
    out = names[-1]
    for outer in reversed(names[:-1]):
        out = f"{outer}[{out}]"
    return out


def test_real_metadata_matches_reference(real):
    ours, ref = real
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, f in fields.items():
        assert ours.metadata[key] == f.contents(), key
        assert ours.metadata_types[key] == oracle_type(f.types), key
    assert ours.version == ref.fields["GGUF.version"].contents()


def test_real_tensor_table_matches_reference(real):
    ours, ref = real
    assert ours.alignment == ref.alignment
    assert ours.data_offset == ref.data_offset
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape)), t.name
        assert info.ne == tuple(int(d) for d in t.shape)
        assert info.type == int(t.tensor_type)
        assert info.offset == t.data_offset
        assert info.nbytes == t.n_bytes
        assert info.n_elements == t.n_elements


def test_real_raw_is_a_zero_copy_view_of_the_right_bytes(real):
    ours, ref = real
    with open(ours.path, "rb") as fh:
        for t in ref.tensors[:3] + ref.tensors[-3:]:
            raw = ours.raw(t.name)
            assert raw.dtype == np.uint8 and raw.size == t.n_bytes
            assert not raw.flags.writeable and not raw.flags.owndata
            assert np.array_equal(raw, np.asarray(t.data).view(np.uint8).reshape(-1))
            fh.seek(ours.tensors[t.name].offset)
            assert raw[:64].tobytes() == fh.read(min(64, t.n_bytes))
    first = ref.tensors[0].name
    assert np.shares_memory(ours.raw(first), ours.raw(first))


def test_summary_and_header_lines(ours: GGUFFile):
    s = ours.summary()
    assert s["version"] == ours.version and s["n_tensors"] == len(ours.tensors)
    assert s["n_elements"] == sum(t.n_elements for t in ours.tensors.values())
    assert sum(s["tensor_types"].values()) == len(ours.tensors)
    tokens = next(m for m in s["metadata"] if m["key"] == "tokenizer.ggml.tokens")
    assert tokens["type"] == "array[string]"
    assert tokens["value"].endswith(f"... ({len(ours.metadata['tokenizer.ggml.tokens'])} items)]")
    assert all(len(m["value"]) < 200 for m in s["metadata"])
    row = s["tensors"][0]
    info = next(iter(ours.tensors.values()))
    assert row == {
        "name": info.name,
        "type": info.type_name,
        "shape": info.shape,
        "nbytes": info.nbytes,
        "offset": info.offset,
    }
    assert any(str(ours.data_offset) in line for line in ours.header_lines())


# --- synthetic files: every value type, both versions -----------------------------------------------------

ALL_VALUES = {
    "u8": (np.uint8(255), 255, "uint8"),
    "i8": (np.int8(-128), -128, "int8"),
    "u16": (np.uint16(65535), 65535, "uint16"),
    "i16": (np.int16(-32768), -32768, "int16"),
    "u32": (np.uint32(U64_MAX >> 32), U64_MAX >> 32, "uint32"),
    "i32": (np.int32(-(1 << 31)), -(1 << 31), "int32"),
    "f32": (np.float32(1.5), 1.5, "float32"),
    "f32_inexact": (np.float32(0.1), float(np.float32(0.1)), "float32"),
    "bool_true": (True, True, "bool"),
    "bool_false": (False, False, "bool"),
    "str": ("héllo ✓ \n\0 end", "héllo ✓ \n\0 end", "string"),
    "str_empty": ("", "", "string"),
    "u64": (np.uint64(U64_MAX), U64_MAX, "uint64"),
    "i64": (np.int64(-(1 << 63)), -(1 << 63), "int64"),
    "f64": (np.float64(-1e300), -1e300, "float64"),
    "arr_u8": (np.array([0, 7, 255], np.uint8), [0, 7, 255], "array[uint8]"),
    "arr_i8": (np.array([-128, 127], np.int8), [-128, 127], "array[int8]"),
    "arr_u16": (np.array([1, 65535], np.uint16), [1, 65535], "array[uint16]"),
    "arr_i16": (np.array([-2, 2], np.int16), [-2, 2], "array[int16]"),
    "arr_u32": (np.array([3, 4], np.uint32), [3, 4], "array[uint32]"),
    "arr_i32": (np.array([-5, 5], np.int32), [-5, 5], "array[int32]"),
    "arr_f32": (np.array([0.25, -2.0], np.float32), [0.25, -2.0], "array[float32]"),
    "arr_bool": (array(VT.BOOL, [True, False, True]), [True, False, True], "array[bool]"),
    "arr_str": (["a", "", "ünï", "x" * 300], ["a", "", "ünï", "x" * 300], "array[string]"),
    "arr_u64": (np.array([U64_MAX, 0], np.uint64), [U64_MAX, 0], "array[uint64]"),
    "arr_i64": (np.array([-(1 << 63), 1], np.int64), [-(1 << 63), 1], "array[int64]"),
    "arr_f64": (np.array([1e-300, 2.5], np.float64), [1e-300, 2.5], "array[float64]"),
    "arr_empty": (array(VT.INT32, []), [], "array[int32]"),
    "arr_nested": ([[1, 2], [3]], [[1, 2], [3]], "array[array[uint32]]"),
    "arr_nested_str": (
        array(VT.ARRAY, [array(VT.STRING, ["p", "q"]), array(VT.STRING, [])]),
        [["p", "q"], []],
        "array[array[string]]",
    ),
    "arr_deep": (
        array(VT.ARRAY, [array(VT.ARRAY, [array(VT.INT16, [-1])]), array(VT.ARRAY, [array(VT.INT16, [])])]),
        [[[-1]], [[]]],
        "array[array[array[int16]]]",
    ),
}


def deep_array(levels: int) -> Value:
    v = array(VT.UINT8, [1])
    for _ in range(levels - 1):
        v = array(VT.ARRAY, [v])
    return v


def synthetic_tensors(rng: np.random.Generator) -> list[tuple]:
    def k_quant_block(nbytes: int) -> bytes:
        raw = bytearray(rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes())
        return bytes(raw)

    q4k = bytearray(k_quant_block(2 * 144))
    for b in range(2):  # keep the float16 scales finite so the values are comparable
        struct.pack_into("<ee", q4k, b * 144, 0.01, 0.002)
    q6k = bytearray(k_quant_block(210))
    struct.pack_into("<e", q6k, 208, 0.003)
    return [
        ("f32_vec", rng.standard_normal(7), quant.BY_NAME["f32"].id),
        ("f16_mat", rng.standard_normal((3, 5)), quant.BY_NAME["f16"].id),
        ("bf16_3d", rng.standard_normal((2, 3, 4)), quant.BY_NAME["bf16"].id),
        ("q8_0_4d", rng.standard_normal((2, 1, 3, 64)), quant.BY_NAME["q8_0"].id),
        ("q4_0", rng.standard_normal((4, 32)), quant.BY_NAME["q4_0"].id),
        ("q4_1", rng.standard_normal((1, 96)), quant.BY_NAME["q4_1"].id),
        ("q5_0", rng.standard_normal((2, 32)), quant.BY_NAME["q5_0"].id),
        ("q4_k", bytes(q4k), quant.BY_NAME["q4_k"].id, (1, 512)),
        ("q6_k", bytes(q6k), quant.BY_NAME["q6_k"].id, (256,)),
        ("q2_k_raw", bytes(range(84)), quant.BY_NAME["q2_k"].id, (256,)),
        ("empty", b"", quant.BY_NAME["q8_0"].id, (0, 32)),
    ]


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("alignment", [32, 1, 64, 4096])
def test_every_value_type_and_tensor_layout(tmp_path: Path, version: int, alignment: int):
    rng = np.random.default_rng(version * 10 + alignment)
    md = {k: v for k, (v, _, _) in ALL_VALUES.items()}
    tensors = synthetic_tensors(rng)
    built = build_gguf(md, tensors, version=version, alignment=alignment)
    path = built.write(tmp_path / "all.gguf")
    with GGUFFile(path) as f:
        assert f.version == version and f.alignment == alignment
        assert f.data_offset == built.fields["data"] and f.data_offset % alignment == 0
        expected = {k: want for k, (_, want, _) in ALL_VALUES.items()}
        expected_types = {k: t for k, (_, _, t) in ALL_VALUES.items()}
        if alignment != 32:
            expected["general.alignment"] = alignment
            expected_types["general.alignment"] = "uint32"
        assert f.metadata == expected
        assert f.metadata_types == expected_types
        assert list(f.tensors) == [t[0] for t in tensors]
        for spec in tensors:
            name, ttype = spec[0], spec[2]
            info = f.tensors[name]
            if len(spec) == 4:
                raw, shape = spec[1], spec[3]
            else:
                shape = np.shape(spec[1])
                raw = quant.quantize(np.asarray(spec[1], np.float32), ttype).tobytes()
            assert info == TensorInfo(name, shape, ttype, built.fields[f"tensor.{name}.data"], len(raw))
            assert f.raw(name).tobytes() == raw
            assert info.offset % alignment == 0
            if quant.TYPES[ttype].supported:
                got = f.dequantize(name)
                assert got.shape == shape and got.dtype == np.float32
                assert np.array_equal(got, quant.dequantize(raw, ttype, shape))
                assert np.isfinite(got).all()
        with pytest.raises(FormatError, match=r"all\.gguf: tensor 'q2_k_raw': .*q2_k.*not supported"):
            f.dequantize("q2_k_raw")


def test_synthetic_file_agrees_with_reference_reader(tmp_path: Path):
    md = {k: v for k, (v, _, _) in ALL_VALUES.items()}
    built = build_gguf(md, synthetic_tensors(np.random.default_rng(0)))
    path = built.write(tmp_path / "all.gguf")
    ref = oracle.GGUFReader(path)
    with GGUFFile(path) as f:
        for key, field in ref.fields.items():
            if key.startswith("GGUF."):
                continue
            want = f.metadata[key]
            if f.metadata_types[key].startswith("array[array"):
                want = list(flatten(want))  # the package flattens nested arrays
            assert field.contents() == want, key
        for t in ref.tensors:
            assert f.tensors[t.name].offset == t.data_offset and f.tensors[t.name].nbytes == t.n_bytes


def flatten(v):
    for x in v:
        if isinstance(x, list):
            yield from flatten(x)
        else:
            yield x


def test_invalid_utf8_is_kept_byte_exact(tmp_path: Path):
    raw = b"ok \xff\xfe \xc3"
    path = build_gguf({"bytes": raw, "tokens": [b"\x80", "fine"]}).write(tmp_path / "u.gguf")
    with GGUFFile(path) as f:
        assert f.metadata["bytes"].encode("utf-8", "surrogateescape") == raw
        assert f.metadata["tokens"][0].encode("utf-8", "surrogateescape") == b"\x80"
        assert f.metadata["tokens"][1] == "fine"


def test_file_without_tensors_may_end_before_the_data_section(tmp_path: Path):
    built = build_gguf({"general.name": "vocab only", "x": np.uint8(1)})
    path = tmp_path / "v.gguf"
    path.write_bytes(built.data[: built.fields["tensor_infos_end"]])
    with GGUFFile(path) as f:
        assert f.tensors == {} and f.metadata["general.name"] == "vocab only"


def test_close_and_views(tmp_path: Path):
    path = build_gguf({}, [("w", np.arange(64, dtype=np.float32), 0)]).write(tmp_path / "c.gguf")
    f = GGUFFile(path)
    view = f.raw("w")
    f.close()
    f.close()  # idempotent
    assert view.view(np.float32)[5] == 5.0  # a view taken before close stays valid
    with pytest.raises(ValueError, match="closed"):
        f.raw("w")
    assert "closed" in repr(f)
    with GGUFFile(path) as g:
        with pytest.raises(TensorNotFound, match=r"c\.gguf: no tensor named 'nope'") as e:
            g.raw("nope")
        assert isinstance(e.value, KeyError) and isinstance(e.value, FormatError)
    with pytest.raises(KeyError):
        g.dequantize("nope")


def test_missing_path_and_directory(tmp_path: Path):
    with pytest.raises(ModelNotFound, match="no such file"):
        GGUFFile(tmp_path / "missing.gguf")
    with pytest.raises(FormatError, match="not a regular file"):
        GGUFFile(tmp_path)


# --- malformed files --------------------------------------------------------------------------------------


def base_file(version: int = 3) -> Built:
    """A small valid file whose fields the malformed cases corrupt one at a time."""
    rng = np.random.default_rng(1)
    return build_gguf(
        {
            "general.architecture": "llama",
            "general.name": "tiny",
            "llama.block_count": 2,
            "key_a": np.uint8(1),
            "key_b": np.uint8(2),
            "flag": True,
            "tokens": ["<s>", "</s>", "a", "b"],
            "scores": np.array([0.0, -1.0, -2.0, -3.0], np.float32),
            "nested": [[1, 2], [3]],
        },
        [
            ("w_up", rng.standard_normal((4, 64)), quant.BY_NAME["q8_0"].id),
            ("norm", rng.standard_normal(64), quant.BY_NAME["f32"].id),
            ("w_dn", rng.standard_normal((2, 32)), quant.BY_NAME["q4_1"].id),
        ],
        version=version,
    )


BASE = base_file()
MESSAGE = re.compile(r"^(?P<path>.+?): (?P<field>.+) at offset (?P<offset>\d+): (?P<what>[^\n]+)$")


def patched(built: Built, field: str, fmt: str, *values, delta: int = 0) -> bytes:
    """The file with `values` packed over one field (or `delta` bytes into it)."""
    data = bytearray(built.data)
    struct.pack_into(fmt, data, built.fields[field] + delta, *values)
    return bytes(data)


def open_bad(
    tmp_path: Path, data: bytes, match: str | None = None, *, max_alloc: int | None = 8 << 20, max_seconds: float = 2.0
) -> str:
    """Open bytes that must be refused: FormatError, one well-formed line, fast, no big allocation.

    `max_alloc=None` skips the allocation check (tracing slows parsing several times over)."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    if max_alloc:
        tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(FormatError) as err:
            GGUFFile(path)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1] if max_alloc else 0
    finally:
        tracemalloc.stop()
    msg = str(err.value)
    assert type(err.value) is FormatError
    m = MESSAGE.match(msg)
    assert m and m["path"] == str(path), msg
    assert int(m["offset"]) <= max(len(data), 0), msg
    assert elapsed < max_seconds, f"{elapsed:.2f}s to refuse: {msg}"
    assert peak < (max_alloc or 1), f"{peak} bytes allocated to refuse: {msg}"
    if match:
        assert re.search(match, m["what"] if not match.startswith("^") else msg), msg
    return msg


HOSTILE = {
    # header
    "bad magic": (patched(BASE, "magic", "4s", b"GGUG"), "not a GGUF file"),
    "zip file": (b"PK\x03\x04" + bytes(60), "not a GGUF file"),
    "version 1": (patched(BASE, "version", "<I", 1), "version 1 is not supported"),
    "version 4": (patched(BASE, "version", "<I", 4), "version 4 is not supported"),
    "version 0xffffffff": (patched(BASE, "version", "<I", 0xFFFFFFFF), "version 4294967295 is not supported"),
    "big-endian": (patched(BASE, "version", ">I", 3), "big-endian"),
    "tensor count max": (patched(BASE, "tensor_count", "<Q", U64_MAX), "cannot fit"),
    "tensor count 2^40": (patched(BASE, "tensor_count", "<Q", 1 << 40), "cannot fit"),
    "tensor count +1": (patched(BASE, "tensor_count", "<Q", 4), None),
    "kv count 2^63": (patched(BASE, "kv_count", "<Q", 1 << 63), "cannot fit"),
    "kv count +1": (patched(BASE, "kv_count", "<Q", 10), None),
    # metadata
    "key length max": (patched(BASE, "kv.general.name.key", "<Q", U64_MAX), "runs past the end"),
    "key length -1 as i64": (patched(BASE, "kv.general.name.key", "<q", -1), "runs past the end"),
    "string length 2^62": (patched(BASE, "kv.general.name.value", "<Q", 1 << 62), "runs past the end"),
    "string array count 2^60": (patched(BASE, "kv.tokens.count", "<Q", 1 << 60), "cannot fit"),
    "float array count 2^61": (patched(BASE, "kv.scores.count", "<Q", 1 << 61), "cannot fit"),
    "float array count +1000": (patched(BASE, "kv.scores.count", "<Q", 1004), None),
    "nested array count max": (patched(BASE, "kv.nested.count", "<Q", U64_MAX), "cannot fit"),
    "string element length max": (patched(BASE, "kv.tokens.count", "<Q", U64_MAX, delta=8), "runs past the end"),
    "unknown value type": (patched(BASE, "kv.general.name.type", "<I", 13), "unknown value type 13"),
    "value type max": (patched(BASE, "kv.general.name.type", "<I", 0xFFFFFFFF), "unknown value type"),
    "unknown array element type": (patched(BASE, "kv.tokens.elem_type", "<I", 99), "unknown value type 99"),
    "bool is 2": (patched(BASE, "kv.flag.value", "<B", 2), "bool value is 2"),
    "duplicate key": (patched(BASE, "kv.key_b.key", "5s", b"key_a", delta=8), "duplicate key 'key_a'"),
    # tensor infos
    "n_dims 5": (patched(BASE, "tensor.w_up.n_dims", "<I", 5), "5 dimensions"),
    "n_dims max": (patched(BASE, "tensor.w_up.n_dims", "<I", 0xFFFFFFFF), "dimensions"),
    "negative dim": (patched(BASE, "tensor.w_up.dims", "<q", -5), "dimension 0 is -5"),
    "negative second dim": (patched(BASE, "tensor.w_up.dims", "<q", -(1 << 63), delta=8), "dimension 1 is"),
    # 2^32 * 2^32 elements: past int64 though each dimension alone is fine
    "dims overflow int64": (patched(BASE, "tensor.w_up.dims", "<QQ", 1 << 32, 1 << 32), "overflows int64"),
    "huge row count": (patched(BASE, "tensor.w_up.dims", "<q", 1 << 40, delta=8), "runs past the end"),
    "row not whole blocks": (patched(BASE, "tensor.w_up.dims", "<q", 33), "not a multiple of the q8_0 block"),
    "unknown tensor type": (patched(BASE, "tensor.w_up.type", "<I", 99), "unknown ggml type 99"),
    "removed tensor type": (patched(BASE, "tensor.w_up.type", "<I", 4), "q4_2 .*removed"),
    "offset past end": (patched(BASE, "tensor.w_dn.offset", "<Q", 1 << 20), "runs past the end"),
    "offset max": (patched(BASE, "tensor.w_dn.offset", "<Q", U64_MAX - 31), "runs past the end"),
    "misaligned offset": (patched(BASE, "tensor.w_dn.offset", "<Q", 33), "not a multiple of the alignment 32"),
    "duplicate tensor": (patched(BASE, "tensor.w_dn.name", "4s", b"w_up", delta=8), "duplicate tensor name 'w_up'"),
    "tensor name length max": (patched(BASE, "tensor.norm.name", "<Q", U64_MAX), "runs past the end"),
    "empty file": (b"", "empty"),
    "just the magic": (b"GGUF", "truncated"),
    "half the magic": (b"GG", "truncated"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_file_is_refused(tmp_path: Path, case: str):
    data, match = HOSTILE[case]
    open_bad(tmp_path, data, match)


def test_message_names_file_field_and_offset(tmp_path: Path):
    msg = open_bad(tmp_path, HOSTILE["negative dim"][0])
    at = BASE.fields["tensor.w_up.dims"]
    assert msg == f"{tmp_path / 'bad.gguf'}: tensor 'w_up' dims at offset {at}: dimension 0 is -5"
    msg = open_bad(tmp_path, HOSTILE["string array count 2^60"][0])
    assert f"metadata 'tokens' array count at offset {BASE.fields['kv.tokens.count']}:" in msg
    msg = open_bad(tmp_path, HOSTILE["duplicate tensor"][0])
    assert f"tensor #2 name at offset {BASE.fields['tensor.w_dn.name']}:" in msg


def test_too_deeply_nested_array(tmp_path: Path):
    open_bad(tmp_path, build_gguf({"deep": deep_array(9)}).data, "nested more than 8 deep")
    with GGUFFile(build_gguf({"deep": deep_array(8)}).write(tmp_path / "ok.gguf")) as f:
        assert f.metadata["deep"] == [[[[[[[[1]]]]]]]]


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (Value(VT.UINT32, 0), "0 is not a power of two"),
        (Value(VT.UINT32, 48), "48 is not a power of two"),
        (Value(VT.UINT64, 1 << 40), "not a power of two between 1 and"),
        (Value(VT.INT32, -32), "-32 is not a power of two"),
        (Value(VT.FLOAT32, 32.0), "must be an integer, not float32"),
        (Value(VT.STRING, "32"), "must be an integer, not string"),
        (Value(VT.BOOL, True), "must be an integer, not bool"),
        (array(VT.UINT32, [32]), "must be an integer, not array"),
    ],
)
def test_bad_alignment(tmp_path: Path, value: Value, match: str):
    msg = open_bad(tmp_path, build_gguf({"general.alignment": value}).data, match)
    assert "metadata 'general.alignment'" in msg


def test_other_integer_alignment_types_are_accepted(tmp_path: Path):
    path = build_gguf({"general.alignment": np.uint64(64)}, [("t", np.ones(16), 0)], alignment=64)
    with GGUFFile(path.write(tmp_path / "a.gguf")) as f:
        assert f.alignment == 64 and f.tensors["t"].offset % 64 == 0


@pytest.mark.parametrize("version", [2, 3])
def test_truncated_at_every_byte(tmp_path: Path, version: int):
    built = base_file(version)
    whole = tmp_path / "whole.gguf"
    with GGUFFile(built.write(whole)) as f:
        data_end = max(t.offset + t.nbytes for t in f.tensors.values())
        w_dn_bytes = f.tensors["w_dn"].nbytes
    path = tmp_path / "t.gguf"
    # every byte through the tensor infos and into the data; past that only which tensor is cut changes
    cuts = [*range(built.fields["data"] + 8), *range(built.fields["data"] + 8, data_end, 5), data_end - 1]
    for n in cuts:
        path.write_bytes(built.data[:n])
        try:
            GGUFFile(path)
        except FormatError as e:
            msg = str(e)
            assert MESSAGE.match(msg), msg
            if n < built.fields["tensor_infos_end"]:
                assert re.search("truncated|runs past the end|cannot fit|empty", msg), msg
        else:
            pytest.fail(f"a file cut to {n} of {len(built.data)} bytes was accepted")
    for n in range(data_end, len(built.data) + 1):  # only padding is missing: still whole
        path.write_bytes(built.data[:n])
        with GGUFFile(path) as f:
            assert f.raw("w_dn").size == w_dn_bytes


def test_truncated_real_header(tmp_path: Path, smollm_gguf):
    with GGUFFile(smollm_gguf) as f:
        data_offset = f.data_offset
        n_meta = len(f.metadata)
    with open(smollm_gguf, "rb") as fh:
        header = fh.read(data_offset)
    # The last ~14 KB are the tensor infos; sample them more densely than the vocabulary before them.
    rng = np.random.default_rng(5)
    cuts = set(range(0, 64, 3)) | {int(c) for c in np.linspace(64, data_offset - 1, 8)}
    cuts |= {int(c) for c in rng.integers(data_offset - 14_000, data_offset, 8)}
    for n in sorted(cuts):
        open_bad(tmp_path, header[:n], max_alloc=None, max_seconds=10)
    # the whole header without the data: the first tensor is past the end
    msg = open_bad(tmp_path, header, "runs past the end", max_alloc=None, max_seconds=10)
    assert "token_embd.weight" in msg and n_meta > 0


# --- fuzzing ----------------------------------------------------------------------------------------------

FUZZ_ITERS = int(os.environ.get("BARELLM_FUZZ_ITERS", "2000"))
SPECIAL_U64 = [0, 1, 2, 3, 4, 5, 31, 32, 33, 255, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 62, 1 << 63, U64_MAX]


def mutate(data: bytearray, rng: np.random.Generator, region: int, count_fields: list[int]) -> str:
    kind = rng.integers(6)
    pos = int(rng.integers(region))
    if kind == 0:
        bit = int(rng.integers(8))
        data[pos] ^= 1 << bit
        return f"flip bit {bit} at {pos}"
    if kind == 1:
        v = int(rng.choice([0x00, 0xFF, 0x7F, 0x80]))
        data[pos] = v
        return f"set {pos} to {v:#x}"
    if kind == 2:
        n = int(rng.integers(1, 9))
        data[pos:pos] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        return f"insert {n} at {pos}"
    if kind == 3:
        n = int(rng.integers(1, 9))
        del data[pos : pos + n]
        return f"delete {n} at {pos}"
    at = count_fields[int(rng.integers(len(count_fields)))]
    if at + 8 > len(data):
        return "no-op"
    if kind == 4:
        v = SPECIAL_U64[int(rng.integers(len(SPECIAL_U64)))]
    else:
        v = int(rng.integers(0, 1 << 63)) << int(rng.integers(0, 2))
        v &= U64_MAX
    struct.pack_into("<Q", data, at, v)
    return f"u64 {v} at {at}"


def test_fuzzed_headers_load_or_raise_format_error(tmp_path: Path):
    base = BASE
    region = base.fields["tensor_infos_end"]
    count_fields = [
        off
        for name, off in base.fields.items()
        if name in ("tensor_count", "kv_count")
        or name.endswith((".count", ".key", ".dims", ".offset", ".name"))
        or (name.endswith(".value") and "general.name" in name)
    ]
    path = tmp_path / "fuzz.gguf"
    rng = np.random.default_rng(20240611)
    loaded = refused = 0
    slowest = (0.0, -1)
    for i in range(FUZZ_ITERS):
        data = bytearray(base.data)
        steps = [mutate(data, rng, region, count_fields) for _ in range(int(rng.integers(1, 4)))]
        path.write_bytes(data)
        start = time.perf_counter()
        try:
            f = GGUFFile(path)
        except FormatError as e:
            assert MESSAGE.match(str(e)), f"case {i} {steps}: {e}"
            refused += 1
            slowest = max(slowest, (time.perf_counter() - start, i))
            continue
        except Exception as e:  # anything else is a reader bug: say which mutation found it
            pytest.fail(f"case {i} {steps}: {type(e).__name__}: {e}")
        loaded += 1
        slowest = max(slowest, (time.perf_counter() - start, i))
        with f, np.errstate(all="ignore"):
            for info in f.tensors.values():
                assert info.offset >= f.data_offset and info.offset + info.nbytes <= len(data), (i, steps)
                assert f.raw(info.name).size == info.nbytes
                if quant.TYPES[info.type].supported:
                    assert f.dequantize(info.name).shape == info.shape
    assert loaded > 0 and refused > 0, (loaded, refused)
    # a hang or a runaway loop over a forged count shows up as one slow case
    assert slowest[0] < 2.0, f"case {slowest[1]} took {slowest[0]:.2f}s to open"


def test_overlapping_tensor_data_is_refused_naming_both(tmp_path: Path):
    built = build_gguf({}, [("a.weight", np.arange(64, dtype=np.float32), 0),
                            ("b.weight", np.arange(64, dtype=np.float32), 0)])
    data = bytearray(built.data)
    # b's data offset pointed 32 bytes into a's (both are 256 bytes)
    struct.pack_into("<Q", data, built.fields["tensor.b.weight.offset"], 32)
    path = tmp_path / "overlap.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"tensor 'b.weight' offset .*overlaps that of tensor 'a.weight'"):
        GGUFFile(path)


def test_tensor_name_that_is_not_utf8_is_named_as_such(tmp_path: Path):
    built = build_gguf({}, [("ab.weight", np.arange(32, dtype=np.float32), 0)])
    data = bytearray(built.data)
    at = built.fields["tensor.ab.weight.name"] + 8   # past the u64 length
    data[at:at + 2] = b"\xff\xfe"
    path = tmp_path / "name.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"tensor #0 name .*b'\\xff\\xfe.weight' is not valid UTF-8"):
        GGUFFile(path)
