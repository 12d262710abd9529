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
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from barellm.progress import Progress

_TEMP_NAME = re.compile(r"\..+\.(\d+)\.[0-9a-f]{8}\.tmp")


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
def atomic_write(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Opens a temporary file for writing `path`; on a normal exit it is flushed, synced and renamed over
    `path`; on any exception it is removed and `path` is left as it was."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


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


def remove_stale_temps(directory: Path) -> list[Path]:
    """Removes the temporary files and directories in `directory` whose writing process is gone; returns
    what it removed. Those of live processes, and names it does not recognise, are left alone."""
    try:
        entries = [p for p in directory.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]
    except OSError:
        return []
    removed = []
    for p in entries:
        m = _TEMP_NAME.fullmatch(p.name)
        if not m or _alive(int(m.group(1))):
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


def sha256_file(path: Path, progress: Progress | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            if progress:
                progress.advance(len(chunk))
    return h.hexdigest()
