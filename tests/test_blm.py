"""The .blm format: round trips, layouts, integrity checks, versioning, atomic writes, and a fuzzer over the
header and tensor table."""

from __future__ import annotations

import os
import re
import signal
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from barellm.errors import FormatError
from barellm.formats import blm, quant, sniff
from barellm.formats.blm import BLMFile
from barellm.formats.blm_writer import TensorSpec, write_blm
from barellm.store.converted import open_model as open_model_file

from conftest import plain

RNG_SEED = 1234
METADATA = {
    "general.architecture": "llama",
    "u8": 200, "i8": -5, "u16": 60000, "i16": -30000, "u32": 4_000_000_000, "i32": -2_000_000_000,
    "u64": 1 << 63, "i64": -(1 << 62), "f32": 0.5, "f64": 1e-300, "flag": True,
    "tokens": ["<s>", "", "héllo", "\udcff\udcfe", "a b", "日本"],
    "scores": [0.0, -1.5, 2.25],
    "types": [1, 3, 5],
    "bools": [True, False, True],
    "empty": [],
    "template": "{{ messages }}",
}
TYPES = {"u8": "uint8", "i8": "int8", "u16": "uint16", "i16": "int16", "u64": "uint64", "i64": "int64",
         "f64": "float64", "types": "array[int32]", "bools": "array[bool]", "empty": "array[string]"}


def _tensors(rng: np.random.Generator) -> dict[str, tuple[int, tuple[int, ...], np.ndarray, int]]:
    """name -> (type, shape, float values, layout)"""
    out = {}
    for name, tid, shape, layout in [
        ("norm", 0, (64,), 0), ("f16.matrix", 1, (3, 40), 0), ("bf16.matrix", 30, (2, 8), 0),
        ("q4_0.matrix", 2, (5, 64), 0), ("q8_0.matrix", 8, (16, 32), 0), ("q4_1.cube", 3, (2, 3, 32), 0),
        ("q4_0.i8", 2, (13, 64), 1), ("q4_1.i8", 3, (8, 96), 1), ("q8_0.i8", 8, (9, 32), 1),
        ("empty", 0, (0, 4), 0), ("scalar", 0, (), 0),
    ]:
        out[name] = (tid, shape, rng.standard_normal(shape).astype(np.float32), layout)
    return out


def _rows(tid: int, x: np.ndarray) -> np.ndarray:
    return quant.quantize(x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1), tid).reshape(-1)


def write_sample(path: Path, seed: int = RNG_SEED) -> dict:
    tensors = _tensors(np.random.default_rng(seed))
    specs = []
    for name, (tid, shape, x, layout) in tensors.items():
        data = blm.LAYOUTS[layout].from_rows(_rows(tid, x), tid, shape)
        specs.append(TensorSpec(name, tid, shape, data, layout))
    write_blm(path, METADATA, specs, metadata_types=TYPES,
              provenance={"source.name": "sample", "source.sha256": "0" * 64, "source.size": 1})
    return tensors


@pytest.fixture()
def sample(tmp_path):
    path = tmp_path / "sample.blm"
    return path, write_sample(path)


def fix_crc(buf: bytearray) -> None:
    """Recomputes the header checksum of a (patched) file image."""
    (header_size,) = struct.unpack_from("<Q", buf, 16)
    end = min(64 + header_size, len(buf))
    crc = zlib.crc32(bytes(buf[56:end]), zlib.crc32(bytes(buf[:52]) + b"\0\0\0\0"))
    struct.pack_into("<I", buf, 52, crc)


def table_offsets(path: Path) -> dict[str, int]:
    """Offset of each tensor's fixed 64-byte record in the file."""
    with BLMFile(path) as f:
        names = list(f.tensors)
        end = 64 + f.header_size
    out = {}
    pos = end
    for name in reversed(names):  # the table is the last section: walk it backwards from the end
        pos -= 64
        out[name] = pos
        pos -= 2 + len(name.encode())
    return out


# --- round trips -----------------------------------------------------------------------------------------


def test_round_trip_metadata_types_and_tensors(sample):
    path, tensors = sample
    assert sniff(path) == "blm"
    with BLMFile(path) as f:
        assert f.version == "1.2"
        assert plain(f.metadata) == METADATA
        assert f.metadata_types["u64"] == "uint64" and f.metadata_types["tokens"] == "array[string]"
        assert f.metadata_types["general.architecture"] == "string" and f.metadata_types["f32"] == "float32"
        assert f.metadata_types["i32"] == "int32" and f.metadata_types["scores"] == "array[float32]"
        assert f.provenance["source.name"] == "sample"
        assert list(f.tensors) == list(tensors)
        assert f.data_offset % 4096 == 0
        for name, (tid, shape, x, layout) in tensors.items():
            info = f.tensors[name]
            assert (info.type, info.shape, info.layout) == (tid, shape, layout)
            assert (info.offset - f.data_offset) % 64 == 0 and info.offset % 64 == 0
            rows = _rows(tid, x)
            assert np.array_equal(f.rows(name), rows)
            expected = quant.dequantize(rows, tid, shape)
            assert np.array_equal(f.dequantize(name), expected)
            stored = f.stored(name)
            assert stored.dtype == np.uint8 and not stored.flags.writeable and stored.size == info.nbytes
            assert np.shares_memory(stored, f.stored(name)) or stored.size == 0  # a view of the mapping
            if layout == 0:
                assert np.shares_memory(f.raw(name), stored) or stored.size == 0
            else:  # never handed out as rows it is not
                with pytest.raises(FormatError, match=f"tensor '{name}' is stored in layout interleave8"):
                    f.raw(name)


def test_open_model_file_maps_blm_directly(sample):
    path, _ = sample
    src = open_model_file(path)
    assert isinstance(src, BLMFile)
    src.close()


def test_released_header_reads_back_the_same(sample):
    # release_header drops the process's pages of the metadata; what still points into them reads them back
    path, tensors = sample
    with BLMFile(path) as f:
        before = {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in f.metadata.items()}
        assert 0 < f.release_header() <= f.data_offset
        assert plain(f.metadata) == plain(before) == METADATA
        for name, (tid, shape, x, _layout) in tensors.items():
            assert np.array_equal(f.dequantize(name), quant.dequantize(_rows(tid, x), tid, shape))


def test_views_survive_close(sample):
    path, tensors = sample
    f = BLMFile(path)
    raw = f.raw("q4_0.matrix")
    f.close()
    assert np.array_equal(raw, _rows(2, tensors["q4_0.matrix"][2]))
    with pytest.raises(ValueError):
        f.raw("q4_0.matrix")


def test_missing_tensor_is_a_key_error_and_format_error(sample):
    path, _ = sample
    with BLMFile(path) as f, pytest.raises(KeyError) as e:
        f.raw("nope")
    assert isinstance(e.value, FormatError) and "nope" in str(e.value)


# --- layouts ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tid", [2, 3, 6, 8, 11, 12, 13, 14])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 24])
def test_interleave8_is_the_native_repack_and_undoes_it(tid, rows):
    """The format's interleave8 is the kernels' own repacking (one implementation, in C), and converts back to
    the same GGUF bytes; any bytes, so every bit of every field is carried."""
    from barellm import _native
    from barellm.formats import quant

    qt = quant.TYPES[tid]
    cols = qt.block_size * (5 if qt.block_size == 32 else 2)
    q = np.random.default_rng(rows * cols + tid).integers(0, 256, rows * cols // qt.block_size * qt.block_bytes,
                                                           dtype=np.uint8)
    lay = blm.LAYOUTS[blm.LAYOUT_INTERLEAVE8]
    packed = lay.from_rows(q, tid, (rows, cols))
    assert packed.size == lay.nbytes(tid, (rows, cols)) == -(-rows // 8) * -(-8 * q.size // rows // 64) * 64
    assert np.array_equal(np.frombuffer(_native.repack(tid, 1, rows, cols, q), np.uint8), packed)
    assert np.array_equal(lay.to_rows(packed, tid, (rows, cols)), q)


def test_kernel_layout_decision():
    from barellm.store.convert import kernel_layout

    assert kernel_layout("blk.0.attn_q.weight", 3, (576, 576), False) == blm.LAYOUT_INTERLEAVE8
    assert kernel_layout("token_embd.weight", 8, (49152, 576), False) == blm.LAYOUT_ROWS  # only looked up
    assert kernel_layout("token_embd.weight", 8, (49152, 576), True) == blm.LAYOUT_INTERLEAVE8  # also the output
    assert kernel_layout("blk.0.attn_norm.weight", 0, (576,), True) == blm.LAYOUT_ROWS
    for k_quant in (11, 12, 13, 14):  # the K-quants have their kernels' layout too
        assert kernel_layout("blk.0.ffn_down.weight", k_quant, (576, 1536), False) == blm.LAYOUT_INTERLEAVE8
    assert kernel_layout("blk.0.ffn_down.weight", 7, (576, 1536), False) == blm.LAYOUT_ROWS  # q5_1: no kernels


def test_unknown_layout_tag_names_the_tensor_and_tag(sample):
    path, _ = sample
    buf = bytearray(path.read_bytes())
    struct.pack_into("<I", buf, table_offsets(path)["q8_0.matrix"] + 4, 7)
    fix_crc(buf)
    path.write_bytes(bytes(buf))
    with pytest.raises(FormatError, match=r"tensor 'q8_0.matrix' layout .*unknown layout tag 7"):
        BLMFile(path)


def test_layout_that_cannot_hold_the_type_is_refused(tmp_path):
    with pytest.raises(FormatError, match="interleave8"):
        write_blm(tmp_path / "x.blm", {}, [TensorSpec("w", 0, (8, 32), np.zeros(256, np.float32), 1)])
    assert not list(tmp_path.iterdir())


# --- integrity -------------------------------------------------------------------------------------------


def test_verify_passes_then_names_a_tensor_with_one_flipped_byte(sample):
    path, _ = sample
    r = blm.verify(path)
    assert r.n_tensors == 11
    with BLMFile(path) as f:
        info = f.tensors["q4_1.i8"]
    buf = bytearray(path.read_bytes())
    buf[info.offset + info.nbytes // 2] ^= 0x10
    path.write_bytes(bytes(buf))
    BLMFile(path).close()  # data corruption does not stop loading (that would read every page) ...
    with pytest.raises(FormatError, match=r"checksum mismatch in 1 of 11 tensors: 'q4_1.i8'"):
        blm.verify(path)  # ... verify finds it


def test_every_flipped_header_byte_is_caught_at_load(sample):
    path, _ = sample
    good = path.read_bytes()
    with BLMFile(path) as f:
        end = 64 + f.header_size
    rng = np.random.default_rng(5)
    positions = sorted(set(range(64)) | set(rng.integers(64, end, 300).tolist()) | {end - 1})
    for pos in positions:
        if 56 <= pos < 64:
            continue  # reserved bytes are covered by the checksum too, tested below
        buf = bytearray(good)
        buf[pos] ^= 1 << int(rng.integers(8))
        path.write_bytes(bytes(buf))
        with pytest.raises(FormatError):
            BLMFile(path)
    buf = bytearray(good)
    buf[60] ^= 1
    path.write_bytes(bytes(buf))
    with pytest.raises(FormatError, match="header checksum mismatch"):
        BLMFile(path)


def test_truncated_and_extended_files_are_refused(sample):
    path, _ = sample
    good = path.read_bytes()
    for cut in (0, 10, 63, 64, 200, len(good) - 1):
        path.write_bytes(good[:cut])
        with pytest.raises(FormatError):
            BLMFile(path)
    path.write_bytes(good + b"\0")
    with pytest.raises(FormatError, match="does not end where the file does"):
        BLMFile(path)


def test_not_a_blm_file(tmp_path):
    p = tmp_path / "x.blm"
    p.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(FormatError, match="not a barellm .blm file"):
        BLMFile(p)


# --- versions --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("major, minor, outcome", [
    (2, 0, "newer than this barellm reads"), (0, 9, "older than this barellm reads"), (1, 7, None),
])
def test_versioning_rule(sample, major, minor, outcome):
    path, _ = sample
    buf = bytearray(path.read_bytes())
    struct.pack_into("<HH", buf, 8, major, minor)
    fix_crc(buf)
    path.write_bytes(bytes(buf))
    if outcome:
        with pytest.raises(FormatError, match=outcome):
            BLMFile(path)
    else:
        with BLMFile(path) as f:  # a newer minor only adds: read as usual
            assert f.version == f"1.{minor}" and plain(f.metadata) == METADATA


# --- writing ---------------------------------------------------------------------------------------------


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path, sample):
    path, _ = sample
    before = path.read_bytes()

    def boom() -> np.ndarray:
        raise RuntimeError("source went away")

    specs = [TensorSpec("a", 0, (4,), np.zeros(4, np.float32)), TensorSpec("b", 0, (4,), boom)]
    with pytest.raises(RuntimeError):
        write_blm(path, {}, specs)
    with pytest.raises(FormatError, match="6 bytes of data given"):
        write_blm(path, {}, [TensorSpec("a", 0, (4,), np.zeros(6, np.uint8))])
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_writer_refuses_bad_input(tmp_path):
    out = tmp_path / "x.blm"
    cases = [
        ({}, [TensorSpec("a", 2, (4, 31), b"")], "block size"),
        ({}, [TensorSpec("a", 0, (1,), b"\0" * 4), TensorSpec("a", 0, (1,), b"\0" * 4)], "given twice"),
        ({}, [TensorSpec("a", 5, (1,), b"")], "cannot be stored"),
        ({"k": 1 << 40}, [], None),
        ({"k": [[1]]}, [], "arrays do not nest"),
        ({"k": -1}, [], None),
    ]
    for md, specs, err in cases:
        if err:
            with pytest.raises(FormatError, match=err):
                write_blm(out, md, specs)
        else:
            write_blm(out, md, specs)
            with BLMFile(out) as f:
                assert plain(f.metadata) == md
    with pytest.raises(FormatError, match="not a uint8"):
        write_blm(out, {"k": 300}, [], metadata_types={"k": "uint8"})


def test_same_input_same_bytes(tmp_path):
    a, b = tmp_path / "a.blm", tmp_path / "b.blm"
    write_sample(a)
    write_sample(b)
    assert a.read_bytes() == b.read_bytes()


# --- fuzzing ---------------------------------------------------------------------------------------------

_INTERESTING = [0, 1, 7, 63, 64, 4095, 4096, 0x7FFFFFFF, 0xFFFFFFFF, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


def _mutate(buf: bytearray, end: int, rng: np.random.Generator) -> None:
    for _ in range(int(rng.integers(1, 4))):
        kind = int(rng.integers(4))
        pos = int(rng.integers(0, end))
        if kind == 0:
            buf[pos] ^= 1 << int(rng.integers(8))
        elif kind == 1:
            buf[pos] = int(rng.integers(256))
        else:
            width = 4 if kind == 2 else 8
            pos = min(pos - pos % width, end - width)
            v = _INTERESTING[int(rng.integers(len(_INTERESTING)))]
            if rng.integers(2):
                v = int(struct.unpack_from("<Q" if width == 8 else "<I", buf, pos)[0]) + int(rng.integers(-70, 70))
            v %= 1 << (8 * width)
            struct.pack_into("<Q" if width == 8 else "<I", buf, pos, v)


def _check_loaded(path: Path, good_tensors: dict[str, tuple[tuple, bytes]]) -> None:
    size = path.stat().st_size
    with BLMFile(path) as f:
        for name, info in f.tensors.items():
            assert 0 <= info.offset and info.offset + info.nbytes <= size
            raw = f.stored(name)
            assert raw.size == info.nbytes
            key = (info.type, info.shape, info.layout, info.offset)
            if name in good_tensors and good_tensors[name][0] == key:
                assert raw.tobytes() == good_tensors[name][1]  # unchanged entries read the same data
            try:
                f.dequantize(name)
            except FormatError:
                pass  # a type we list but cannot decode
    try:
        blm.verify(path)
    except FormatError:
        pass


def test_fuzz_header_and_table(tmp_path):
    """Every mutation of the header and table loads correct data or raises the clean FormatError.

    Half the cases keep the stored checksum (so the checksum catches them), half recompute it, so the
    parser itself sees hostile values. BARELLM_FUZZ_ITERS raises the count."""
    iters = int(os.environ.get("BARELLM_FUZZ_ITERS", "2000"))
    path = tmp_path / "f.blm"
    write_sample(path)
    good = path.read_bytes()
    with BLMFile(path) as f:
        end = 64 + f.header_size
        good_tensors = {n: ((i.type, i.shape, i.layout, i.offset), f.stored(n).tobytes()) for n, i in f.tensors.items()}
    rng = np.random.default_rng(int(os.environ.get("BARELLM_FUZZ_SEED", "20240601")))
    outcomes = {"refused": 0, "loaded": 0}

    def hang(signum, frame):
        raise TimeoutError("the reader hung on a mutated file")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(max(60, iters // 20))
    try:
        worst = 0.0
        for i in range(iters):
            buf = bytearray(good)
            _mutate(buf, end, rng)
            fixed = bool(i % 2)
            if fixed:
                fix_crc(buf)
            with open(path, "r+b") as fh:
                fh.write(buf)
                fh.truncate(len(buf))
            t0 = time.perf_counter()
            try:
                _check_loaded(path, good_tensors)
                outcomes["loaded"] += 1
                if not fixed:
                    assert bytes(buf) == good, f"case {i}: a mutation with a stale checksum loaded"
            except FormatError:
                outcomes["refused"] += 1
            worst = max(worst, time.perf_counter() - t0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert outcomes["refused"] > iters // 2
    assert worst < 5.0


def test_prefetch_maps_the_pages_in_on_a_background_thread(tmp_path):
    import resource

    path = tmp_path / "big.blm"
    data = np.arange(2 << 20, dtype=np.float32)  # 8 MB
    write_blm(path, METADATA, [TensorSpec("w", 0, data.shape, data)], metadata_types=TYPES)

    def faults_reading(f: BLMFile) -> int:
        page = f.stored("w")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        int(page[::4096].sum())  # a byte of every page
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    with BLMFile(path) as cold:
        assert cold.prefetching is None
        unfetched = faults_reading(cold)
    with BLMFile(path, prefetch=True) as warm:
        assert warm.prefetching is not None
        warm.prefetching.join(10)
        fetched = faults_reading(warm)
        assert np.array_equal(warm.stored("w").view(np.float32), data)
    if fetched >= unfetched:
        pytest.skip(f"this kernel lacks MADV_POPULATE_READ (Linux < 5.14): {fetched} faults either way")
    assert fetched <= unfetched // 4, (unfetched, fetched)  # (a fault maps 64 KB to 2 MB of a cached file)


def test_tensor_data_spans_every_tensor(tmp_path):
    path = tmp_path / "two.blm"
    a, b = np.arange(1000, dtype=np.float32), np.arange(77, dtype=np.float32)
    write_blm(path, METADATA, [TensorSpec("a", 0, a.shape, a), TensorSpec("b", 0, b.shape, b)],
              metadata_types=TYPES)
    with BLMFile(path) as f:
        span = f.tensor_data()
        lo = span.ctypes.data
        for name in ("a", "b"):
            page = f.stored(name)
            assert lo <= page.ctypes.data and page.ctypes.data + page.nbytes <= lo + span.nbytes
        assert span.nbytes < a.nbytes + b.nbytes + 4096  # (alignment padding between them at most)


def _read_in(path: Path, huge: bool) -> None:
    """Drops the file from the page cache, then reads it back in through a mapping that asks for 2 MB pages or
    for 4 KB ones, which decides the size of the pages the cache holds it in."""
    import mmap

    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
        int(np.frombuffer(m, np.uint8)[::4096].sum())
        del m
    finally:
        os.close(fd)


def _small_pieces(page: np.ndarray) -> list[int] | None:
    """The 2 MB pieces wholly inside a mapped array that this process maps in 4 KB pages"""
    from barellm.formats.mapped import small_page_pieces

    lo = -(-page.ctypes.data // (2 << 20)) * (2 << 20)
    return small_page_pieces(lo, page.ctypes.data + page.nbytes - lo)


def _cached_small(path: Path) -> list[int] | None:
    """_small_pieces of the file through a mapping of its own that asks for 2 MB pages: those the page cache
    holds in 4 KB pages"""
    import mmap

    with open(path, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    m.madvise(mmap.MADV_HUGEPAGE)
    page = np.frombuffer(m, np.uint8)
    int(page[::4096].sum())
    pieces = _small_pieces(page[2 << 20:])  # (the header's piece aside)
    del page
    m.close()
    return pieces


def test_prefetch_reads_pieces_cached_in_small_pages_back_in_huge_ones(tmp_path):
    data = np.arange(6 << 20, dtype=np.float32)  # 24 MB
    control, path = tmp_path / "control.blm", tmp_path / "small.blm"
    for p in (control, path):
        write_blm(p, METADATA, [TensorSpec("w", 0, data.shape, data)], metadata_types=TYPES)
    _read_in(control, huge=True)
    pieces = _cached_small(control)
    if pieces is None:
        pytest.skip("this kernel cannot tell how a mapping's pages are mapped (PAGEMAP_SCAN: Linux >= 6.7)")
    if pieces:
        pytest.skip("this machine does not cache the file in 2 MB pages now (transparent huge pages off, memory "
                    "fragmented, or a file system without large folios)")
    _read_in(path, huge=False)
    assert len(_cached_small(path) or []) >= 10  # the page cache holds it in 4 KB pages
    with BLMFile(path, prefetch=True) as warm:
        warm.prefetching.join(30)
        assert warm.reread_bytes >= 10 << 20
        assert _small_pieces(warm.stored("w")) == []
        assert np.array_equal(warm.stored("w").view(np.float32), data)
    assert _cached_small(path) == []
    with BLMFile(path, prefetch=True) as again:  # cached in 2 MB pages now: nothing to read back
        again.prefetching.join(30)
        assert again.reread_bytes == 0


def _vm_flags(base: int) -> list[tuple[int, int, set[str]]]:
    """(start, end, VmFlags) of this process's mappings from address `base` on, in address order"""
    out = []
    start = end = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
        elif line.startswith("VmFlags:") and start is not None and end > base:
            out.append((start, end, set(line.split()[1:])))
    return out


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not hasattr(os, "posix_fadvise"),
                    reason="Linux's /proc and madvise")
def test_weights_ask_for_huge_pages_and_the_header_for_small_ones(tmp_path):
    # decode streams every weight once a token: 2 MB pages spare a TLB miss every 4 KB; the header is read
    # once, released, and a later read of it must not map a whole 2 MB piece back in
    import mmap as mmap_module

    probe = mmap_module.mmap(-1, 4 << 20)
    try:
        probe.madvise(mmap_module.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pytest.skip("this kernel takes no MADV_HUGEPAGE")
    finally:
        probe.close()
    path = tmp_path / "big.blm"
    big = np.random.default_rng(0).standard_normal((1536, 1024)).astype(np.float32)  # 6 MB of data
    write_blm(path, METADATA, [TensorSpec("w", 0, big.shape, big)], metadata_types=TYPES)
    with BLMFile(path) as f:
        base = f._data.ctypes.data
        maps = [m for m in _vm_flags(base) if m[0] < base + f.file_size]
        head = -(-f.data_offset // (2 << 20)) * (2 << 20)
        assert maps[0][0] == base and "nh" in maps[0][2] and maps[0][1] == base + head
        assert all("hg" in flags for _, _, flags in maps[1:]) and len(maps) >= 2
        assert np.array_equal(f.dequantize("w"), big)


def _file_system(path: Path) -> str:
    """The type of the file system holding path, from /proc/self/mounts (the longest mount point above it)"""
    best, kind = "", ""
    target = str(path.resolve())
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        point = fields[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def _resident_pages(path: Path) -> int:
    """Pages of the file in the page cache (mincore over a fresh mapping)"""
    import ctypes
    import mmap as mmap_module

    size = path.stat().st_size
    with open(path, "rb") as fh:
        m = mmap_module.mmap(fh.fileno(), 0, access=mmap_module.ACCESS_READ)
    view = np.frombuffer(m, np.uint8)
    try:
        vec = (ctypes.c_ubyte * -(-size // mmap_module.PAGESIZE))()
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec)
    finally:
        del view
        m.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not Path("/proc/self/smaps").exists(),
                    reason="posix_fadvise and mincore (Linux)")
def test_a_written_model_file_leaves_the_page_cache(tmp_path):
    # the page cache keeps a file in 2 MB pieces only where it read it so; the small pages a write leaves
    # behind go, and the first load reads the file back through a mapping that asks for huge pages
    from barellm.files import atomic_write

    if _file_system(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("a memory file system has no page cache to leave")
    data = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes()
    kept, dropped = tmp_path / "kept.bin", tmp_path / "dropped.bin"
    with atomic_write(kept) as f:
        f.write(data)
    with atomic_write(dropped, drop_cache=True) as f:
        f.write(data)
    n = (8 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert _resident_pages(kept) > n // 2          # a plain write stays cached
    assert _resident_pages(dropped) < n // 8       # synced, then dropped
    assert dropped.read_bytes() == data


def test_overlapping_tensor_data_is_refused_naming_both(sample):
    path, _ = sample
    with BLMFile(path) as f:
        infos = sorted(f.tensors.values(), key=lambda t: t.offset)
        data_offset = f.data_offset
    a, b = infos[0], infos[1]
    buf = bytearray(path.read_bytes())
    name = b.name.encode()
    at = buf.index(struct.pack("<H", len(name)) + name, 64) + 2 + len(name)   # b's table entry
    struct.pack_into("<Q", buf, at + 48, a.offset - data_offset)              # b's data now starts at a's
    fix_crc(buf)
    path.write_bytes(bytes(buf))
    with pytest.raises(FormatError, match=rf"tensor '{re.escape(a.name)}' offset.*overlaps that of tensor "
                                          rf"'{re.escape(b.name)}'|tensor '{re.escape(b.name)}' offset.*overlaps "
                                          rf"that of tensor '{re.escape(a.name)}'"):
        BLMFile(path)
