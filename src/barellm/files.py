"""The files barellm keeps: where they live, and how they are written.

Every file barellm writes (a pulled model, a converted .blm, a manifest, an index entry, a table cached for
start-up) goes through `atomic_write`: the bytes go to a hidden temporary file beside the target, named after
the writing process, are flushed to disk, and only then renamed over the target. A reader therefore sees
either the old file or the whole new one, never a half-written file; and the leftovers of a writer that was
killed part-way are recognised by their name and removed by `remove_stale_temps` once their process is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from barellm.errors import FormatError, ModelNotFound
from barellm.progress import Progress

_TEMP_NAME = re.compile(r"\.(.+)\.(\d+)\.[0-9a-f]{8}\.tmp")  # .<target name>.<pid>.<hex>.tmp


def home() -> Path:
    """barellm's own directory: $BARELLM_HOME, default ~/.cache/barellm."""
    return Path(os.environ.get("BARELLM_HOME") or Path.home() / ".cache" / "barellm")


def temp_path(path: Path) -> Path:
    """The temporary name a write to `path` goes through: hidden, in the same directory (so that the
    final rename is atomic), and carrying the writer's pid so that a killed writer's leftovers can be
    told from a live writer's work."""
    return path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")


def fsync_dir(directory: Path) -> None:
    """Makes a rename in `directory` durable (best effort: some filesystems refuse a directory fsync)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], *, drop_cache: bool = False) -> Iterator[BinaryIO]:
    """Opens a temporary file for writing `path`; on a normal exit it is flushed, synced and renamed over
    `path`; on any exception it is removed and `path` is left as it was. With drop_cache the written pages
    leave the page cache once synced (see drop_page_cache)."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            if drop_cache:
                drop_page_cache(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def drop_page_cache(fd: int) -> None:
    """Lets the kernel drop a synced file's pages from the page cache (best effort). A model file is read
    back through a mapping that asks for 2 MB pages (formats.mapped.hugepages), and the page cache holds a
    file in 2 MB pieces only where it read them that way: the pages a write left behind are small, and
    weights mapped from them decode 4-11% slower here (a TLB miss every 4 KB)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_write(path) as f:
        f.write(data)


@contextlib.contextmanager
def temp_dir(parent: Path, name: str) -> Iterator[Path]:
    """A scratch directory in `parent`, named like a temporary file (so `remove_stale_temps` recognises it
    when its process dies), removed with its contents on exit."""
    path = temp_path(parent / name)
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_temps(directory: Path, target_suffix: str = "") -> list[Path]:
    """Removes the temporary files and directories in `directory` whose writing process is gone; returns
    what it removed. Those of live processes, and names it does not recognise, are left alone; with
    target_suffix (".blm"), only the temporaries of targets named so (in a directory barellm does not own,
    such as the output directory of `barellm convert -o`)."""
    try:
        entries = [p for p in directory.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]
    except OSError:
        return []
    removed = []
    for p in entries:
        m = _TEMP_NAME.fullmatch(p.name)
        if not m or not m.group(1).endswith(target_suffix) or _alive(int(m.group(2))):
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # someone else's process, or unknowable: assume it is still writing
    return True


_KINDS = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _not_regular(path: str | os.PathLike[str], mode: int) -> FormatError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return FormatError(f"{os.fspath(path)}: is {kind}, not a regular file")


def check_regular(path: str | os.PathLike[str]) -> os.stat_result:
    """stat() of a path that must be a regular file (following links): ModelNotFound or FormatError else."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ModelNotFound(f"{os.fspath(path)}: no such file") from None
    except OSError as e:
        raise FormatError(f"{os.fspath(path)}: cannot read: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode)
    return st


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Opens a file for reading, refusing anything but a regular file before a byte is read: reading a named
    pipe blocks until someone writes to it (forever, for a model path), and a device can stream without end.
    The path is checked before it is opened (a device is never opened) and the descriptor after (the path
    cannot be swapped in between); the open itself does not wait on a pipe."""
    check_regular(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ModelNotFound(f"{os.fspath(path)}: no such file") from None
    except OSError as e:
        raise FormatError(f"{os.fspath(path)}: cannot read: {e.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def sha256_file(path: Path, progress: Progress | None = None) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            if progress:
                progress.advance(len(chunk))
    return h.hexdigest()


# --- checks that passed before ------------------------------------------------------------------------------
# A start skips a costly check of a model's data (a Python loop over its vocabulary, compiling and rendering
# its chat template) that has passed before on this machine for exactly that data: an empty file named by the
# SHA256 of what was checked says so.

def passed_before(digest: str) -> bool:
    """Whether the check named `digest` (a hex SHA256 of exactly what it checked, and how) has passed here."""
    return (home() / "checked" / digest).is_file()


def note_passed(digest: str) -> None:
    """Remembers that the check named `digest` passed (best effort: a read-only cache only costs the check
    again next time)."""
    note = home() / "checked" / digest
    try:
        note.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(note, b"")
    except OSError:
        pass
