"""What every model file reader shares: the file mapped read-only, tensors looked up by name and handed out
as zero-copy byte views, and a close that waits for those views to go. Subclasses parse their format."""

from __future__ import annotations

import math
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from barellm.errors import FormatError, ModelNotFound
from barellm.files import check_regular
from barellm.formats import quant

Self = TypeVar("Self", bound="MappedFile")

_MADV_POPULATE_READ = 22  # Linux 5.14: fault the range's pages in, as reading them would
_PREFETCH_STEP = 8 << 20  # bytes per madvise call
_HUGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KB pages)
_MADV_DONTNEED = 4
_PAGEMAP_SCAN = 0xC0606610  # _IOWR('f', 16, struct pm_scan_arg), /proc/self/pagemap: Linux 6.7
_PAGE_IS_PRESENT, _PAGE_IS_HUGE = 1 << 3, 1 << 6


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives in a model file and what it holds. `shape` is in NumPy order (GGUF's ne reversed)."""

    name: str
    shape: tuple[int, ...]
    type: int
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return quant.type_name(self.type)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def ne(self) -> tuple[int, ...]:
        """The dimensions as GGUF lists them, innermost first."""
        return tuple(reversed(self.shape))


def _huge_after(offset: int) -> int:
    """The first 2 MB boundary at or after offset: where the pieces in 2 MB pages begin (hugepages)."""
    return -(-offset // _HUGE) * _HUGE


def small_page_pieces(base: int, size: int) -> list[int] | None:
    """The offsets from `base` (2 MB aligned) of the whole 2 MB pieces of [base, base + size) that hold pages
    this process maps in 4 KB pages; None where the kernel cannot tell (no PAGEMAP_SCAN before Linux 6.7)."""
    import ctypes

    class Region(ctypes.Structure):
        _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]

    class ScanArg(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint64) for n in ("size", "flags", "start", "end", "walk_end", "vec", "vec_len",
                                                    "max_pages", "category_inverted", "category_mask",
                                                    "category_anyof_mask", "return_mask")]

    if base % _HUGE:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ioctl = libc.ioctl
        ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except (OSError, AttributeError):
        return None
    end = base + size // _HUGE * _HUGE
    regions = (Region * 256)()
    small: set[int] = set()
    try:
        at = base
        while at < end:  # (a call returns at most 256 runs of pages alike; walk_end says where it stopped)
            arg = ScanArg(ctypes.sizeof(ScanArg), 0, at, end, 0, ctypes.addressof(regions), 256, 0, 0, 0, 0,
                          _PAGE_IS_PRESENT | _PAGE_IS_HUGE)
            n = ioctl(fd, _PAGEMAP_SCAN, ctypes.byref(arg))
            if n < 0:
                return None
            for r in regions[:n]:
                if r.categories == _PAGE_IS_PRESENT:  # present, not in a huge page
                    small.update(range((r.start - base) // _HUGE * _HUGE, r.end - base, _HUGE))
            if arg.walk_end <= at:
                break
            at = arg.walk_end
    finally:
        os.close(fd)
    return sorted(small)


def rehuge(path: Path, ident: tuple[int, int], base: int, start: int, size: int, madvise: Any) -> int:
    """Reads back through this mapping (which asks for 2 MB pages) the 2 MB pieces of [start, start + size) of
    the file mapped at `base` that are mapped in 4 KB pages; returns the bytes read back.

    The page cache holds a piece in 2 MB only if it was read in through such a mapping while memory had a free
    2 MB block: pieces read in otherwise (a read() of the file, a mapping without the advice, a fault when
    memory was fragmented) stay small for as long as they stay cached, and decode reads weights in them 4-11%
    slower. Each such piece is unmapped here, dropped from the page cache (where no other process maps it)
    and faulted in again. The first piece tells whether this can work now: if it comes back small (memory
    fragmented, a file system without large folios), the rest are left alone. `ident` is the file's
    (st_dev, st_ino) when mapped: nothing is done if `path` names another file now."""
    import ctypes

    pieces = small_page_pieces(base + start, size)
    if not pieces:
        return 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return 0
    done = 0
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != ident:
            return 0
        for i, off in enumerate(pieces):
            at = ctypes.c_void_p(base + start + off)
            if madvise(at, ctypes.c_size_t(_HUGE), _MADV_DONTNEED):
                break
            os.posix_fadvise(fd, start + off, _HUGE, os.POSIX_FADV_DONTNEED)
            if madvise(at, ctypes.c_size_t(_HUGE), _MADV_POPULATE_READ):
                break
            done += _HUGE
            if i == 0 and small_page_pieces(base + start + off, _HUGE):
                break
    except OSError:
        pass
    finally:
        os.close(fd)
    return done


class TensorNotFound(FormatError, KeyError):
    """A tensor name the file does not have (also a KeyError, as for any mapping)."""

    __str__ = Exception.__str__


def hugepages(m: mmap.mmap, data_start: int = 0) -> bool:
    """Asks for the pages of a mapped model file from data_start on in 2 MB pieces, where the page cache holds
    the file so (MADV_HUGEPAGE before the first fault; a no-op where the kernel or the file system cannot),
    and for the 2 MB pieces holding the header in 4 KB pages (MADV_NOHUGEPAGE).

    Decode reads every weight once a token, so each 4 KB page is a TLB miss: weights mapped in 4 KB pages
    read 4-11% slower here than the same bytes in anonymous memory, in 2 MB pages as fast or faster. The
    header is read once and released (MappedFile.release_header); a read of it after that would otherwise
    map a whole 2 MB piece back in."""
    on, off = getattr(mmap, "MADV_HUGEPAGE", None), getattr(mmap, "MADV_NOHUGEPAGE", None)
    if on is None or off is None:
        return False
    head = min(_huge_after(data_start), len(m))
    try:
        m.madvise(on)
        if head:
            m.madvise(off, 0, head)
    except (OSError, ValueError):
        return False
    return True


class MappedFile:
    path: Path
    metadata: dict[str, Any]
    metadata_types: dict[str, str]  # each key's type in the format's terms ("uint32", "array[string]")
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int
    file_size: int

    def __init__(self, path: str | os.PathLike[str], *, prefetch: bool = False) -> None:
        self.path = Path(path)
        self._name = str(path)
        self._mmap: mmap.mmap | None = None
        self._data: np.ndarray | None = None
        self.prefetching: Any = None  # the thread prefetch() started
        self.reread_bytes = 0  # what that thread read back in 2 MB pages (rehuge)
        self._huge = False
        check_regular(self.path)  # a named pipe, a device or a socket is refused before it is opened
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # nor does a pipe swapped in block it
        except FileNotFoundError:
            raise ModelNotFound(f"{self._name}: no such file") from None
        except OSError as e:
            raise FormatError(f"{self._name}: cannot open: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(f"{self._name}: cannot read: not a regular file")
            self.file_size = st.st_size
            self._ident = (st.st_dev, st.st_ino)
            self._check_size(self.file_size)
            try:
                self._mmap = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise FormatError(f"{self._name}: cannot map the file: {e}") from None
        finally:
            os.close(fd)
        try:
            self._data = np.frombuffer(self._mmap, dtype=np.uint8)
            self._huge = hugepages(self._mmap, self._data_start())
            if prefetch:  # (before the parse, which it overlaps)
                self.prefetch()
            self._parse(self._mmap)
        except BaseException:
            self.close()
            raise

    def _check_size(self, size: int) -> None:
        """Refuses a file too small to hold the format's fixed header, before it is mapped."""

    def _parse(self, buf: mmap.mmap) -> None:
        raise NotImplementedError

    def _info(self, name: str) -> Any:
        info = self.tensors.get(name)
        if info is None:
            raise TensorNotFound(f"{self._name}: no tensor named {name!r}")
        return info

    def _bytes(self, name: str) -> np.ndarray:
        """The bytes a tensor occupies in the file: a read-only uint8 view of the mapping (no copy)."""
        info = self._info(name)
        if self._data is None:
            raise ValueError(f"{self._name}: the file is closed")
        return self._data[info.offset:info.offset + info.nbytes]

    def rows(self, name: str) -> np.ndarray:
        """The tensor's bytes in GGUF's row layout (formats that store other layouts convert back)."""
        return self._bytes(name)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor decoded to a new float32 array of shape `TensorInfo.shape`."""
        info = self._info(name)
        try:
            return quant.dequantize(self.rows(name), info.type, info.shape)
        except FormatError as e:
            raise FormatError(f"{self._name}: tensor {name!r}: {e}") from None

    def release_header(self) -> int:
        """Drops this process's mapping of the pages before the first tensor (metadata and the tensor table),
        once what was read from them has been copied out (tokens, template, config): otherwise they stay
        resident beside those copies for the life of the model, 5.5 MB for Gemma 3's 262,144-token vocabulary.
        A later read faults them back in from the page cache. Returns the bytes released."""
        if self._data is None or not self.tensors:
            return 0
        import mmap

        end = min(int(i.offset) for i in self.tensors.values()) // mmap.PAGESIZE * mmap.PAGESIZE
        if end <= 0 or self._mmap is None:
            return 0
        try:
            self._mmap.madvise(mmap.MADV_DONTNEED, 0, end)
        except (OSError, ValueError, AttributeError):
            return 0
        return end

    def prefetch(self) -> bool:
        """Starts mapping the whole file's pages into this process on a background thread (madvise
        MADV_POPULATE_READ; the GIL is released meanwhile), so that the first pass over the weights does not
        stop at a page fault every 64 KB: SmolLM2's first forward pass took 1,400 of them (5 ms),
        Qwen2.5-Coder-1.5B's 12,800 (60 ms); a load parses the header and sets the tokenizer and the engine
        up meanwhile. Then the pieces the page cache held in 4 KB pages are read back in 2 MB ones (rehuge;
        `reread_bytes` says how much). Skipped (False) where the file would take more than half the available
        memory, and a no-op where the kernel lacks MADV_POPULATE_READ (Linux < 5.14)."""
        if self._data is None or not self._data.size:
            return False
        from barellm.cpu import available_memory

        avail = available_memory()
        if avail is not None and self._data.size > avail // 2:
            return False  # reading it all in would evict what it is to read
        try:
            import ctypes
            import threading

            libc = ctypes.CDLL(None, use_errno=True)
            madvise = libc.madvise
        except (OSError, AttributeError):
            return False
        start = self._data_start() // mmap.PAGESIZE * mmap.PAGESIZE
        view = self._data[start:]  # (the mapping starts on a page)
        head = _huge_after(start)  # (hugepages() left the pieces before this in 4 KB pages)

        def populate(view: np.ndarray) -> None:  # (holding the view keeps the mapping alive through a close())
            # in steps, each holding the process's memory-map lock briefly: the loading thread's own mmap and
            # munmap calls (NumPy's large arrays) wait for it to be released
            base, size = view.ctypes.data, view.nbytes
            for at in range(0, size, _PREFETCH_STEP):
                if madvise(ctypes.c_void_p(base + at), ctypes.c_size_t(min(_PREFETCH_STEP, size - at)),
                           _MADV_POPULATE_READ):
                    return  # not supported here (EINVAL), or the range went away
            if self._huge and head < self.file_size:
                self.reread_bytes = rehuge(self.path, self._ident, base - start, head, self.file_size - head,
                                           madvise)

        self.prefetching = threading.Thread(target=populate, args=(view,), name="barellm-prefetch", daemon=True)
        self.prefetching.start()
        return True

    def tensor_data(self) -> np.ndarray:
        """The file's bytes from its first tensor's to the end of its last one's: a read-only view, no copy."""
        if self._data is None:
            raise ValueError(f"{self._name}: the file is closed")
        if not self.tensors:
            return self._data[:0]
        lo = min(int(i.offset) for i in self.tensors.values())
        return self._data[lo:max(int(i.offset) + int(i.nbytes) for i in self.tensors.values())]

    def small_pieces(self) -> int | None:
        """How many of the 2 MB pieces holding tensor data this process maps in 4 KB pages (small_page_pieces;
        None where the kernel cannot tell, or the mapping is not 2 MB aligned)."""
        if self._data is None or not self._data.size:
            return None
        base = self._data.ctypes.data
        head = _huge_after(self._data_start())
        pieces = small_page_pieces(base + head, self.file_size - head) if head < self.file_size else []
        return None if pieces is None else len(pieces)

    def _data_start(self) -> int:
        """Where the tensor data begins, as far as the file's first bytes tell before it is parsed (0: not
        known). prefetch() maps the pages from there on: the header's are read by the parse and released
        after it (release_header), and mapping them in again would only raise the peak."""
        return 0

    def close(self) -> None:
        """Release the mapping (deferred while tensor views are still alive)."""
        self._data = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # views are alive; the mapping goes when they do
            self._mmap = None

    def __enter__(self: Self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
