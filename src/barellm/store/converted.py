"""The model cache: model files converted once into barellm's own format, and opened from there.

    $BARELLM_HOME/blm/<sha256 of the source>.blm     a GGUF file or checkpoint, converted (kernel layouts)
    $BARELLM_HOME/blm/index/<state key>.json        (path, size, mtime, inode) of a source -> its sha256

`open_model(path)` is what loading a model calls: a .blm file is mapped as it is; a GGUF file or a checkpoint
directory is converted the first time and the cached .blm is mapped afterwards, so a later start neither
hashes nor converts anything. Every write goes through files.atomic_write.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from barellm.errors import BarellmError, FormatError, ModelNotFound
from barellm.files import home, remove_stale_temps, write_bytes_atomic
from barellm.formats import blm, sniff
from barellm.progress import Progress
from barellm.store import convert as converter

# The model cache stores weight matrices the way the native kernels read them, so that loading maps them
# instead of repacking (SmolLM2: the engine's set-up 0.26 -> 0.11 s, and the matrices that are not fused
# are used in place, shared with the page cache). The NumPy reference converts them back to rows.
CACHE_LAYOUT = "kernels"


class CacheError(BarellmError):
    """The model cache cannot be written (read-only or full): the source itself may still be readable."""


def cache_dir() -> Path:
    return home() / "blm"


def _stat_key(files: list[Path]) -> str:
    """A name for the source's current state: absolute path, size, mtime and inode of every file read."""
    parts = []
    for p in files:
        st = p.stat()
        parts.append([str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ino])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:40]


def _index_lookup(idx: Path) -> str | None:
    try:
        entry = json.loads(idx.read_text())
        sha = entry["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return sha if isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha) else None


def conversion_of(src: str | os.PathLike[str]) -> Path | None:
    """The cached .blm of a source as the index records it, if there is one (nothing is converted)."""
    src = Path(src)
    sha = _index_lookup(cache_dir() / "index" / f"{_stat_key(converter.source_files(src))}.json")
    path = cache_dir() / f"{sha}.blm" if sha else None
    return path if path is not None and path.is_file() else None


def _usable(path: Path, sha: str, verify: bool = False, prefetch: bool = False) -> blm.BLMFile | None:
    """The cached file opened, if it is intact and what this converter would write for that source now.
    Intact: its header, and its tensors' checksums, a sample of them (all with verify); a cached file found
    corrupt is said so on stderr, and converted again."""
    try:
        f = blm.BLMFile(path, prefetch=prefetch)
    except (FormatError, ModelNotFound):
        return None
    p = f.provenance
    if (p.get("source.sha256") == sha and p.get("converter.revision") == converter.CONVERTER_REVISION
            and p.get("convert.type") == "keep" and p.get("convert.layout") == CACHE_LAYOUT):
        try:
            check_data(f, verify)
            return f
        except FormatError as e:
            print(f"barellm: the cached conversion is corrupt ({e}); converting the model again", file=sys.stderr)
    f.close()
    return None


def check_data(f: blm.BLMFile, verify: bool = False) -> None:
    """The integrity check every load of a .blm makes: the checksums of a sample of its tensors, or of all of
    them with verify (`--verify`); FormatError names a tensor whose data is corrupt."""
    if verify:
        blm.check_all(f)
    else:
        blm.check_sample(f)


def converted_path(sha256: str) -> Path:
    """Where the cache keeps the conversion of a source whose SHA256 is sha256 (it may not exist yet)."""
    return cache_dir() / f"{sha256}.blm"


def is_current(path: Path, sha256: str) -> bool:
    """Whether the cache's conversion at path is what this converter writes for that source now."""
    f = _usable(path, sha256, False)
    if f is None:
        return False
    f.close()
    return True


def open_cached(src: str | os.PathLike[str], *, verify: bool = False, sha256: str | None = None,
                index: bool = True, progress: bool | None = None, prefetch: bool = False) -> blm.BLMFile:
    """A GGUF file or checkpoint directory as a .blm from the cache, converting it the first time.

    The index maps the source's (path, size, mtime, inode) to its SHA256, so a start that finds both the
    index entry and the .blm neither hashes nor converts anything. sha256: the source's, when the caller
    knows it already (a pull has just checked it); index: record the source in the index (not for a file
    about to be deleted); progress: draw progress bars (default: when stderr is a terminal); prefetch: map the
    .blm's pages in on a background thread (MappedFile.prefetch).
    """
    src = Path(src)
    files = converter.source_files(src)
    directory = cache_dir()
    for d in (directory, directory / "index"):  # what a start killed while writing the cache left there
        remove_stale_temps(d)
    idx = directory / "index" / f"{_stat_key(files)}.json"
    sha = sha256 or _index_lookup(idx)
    if sha is not None:
        f = _usable(directory / f"{sha}.blm", sha, verify, prefetch)
        if f is not None:
            return f
    show = sys.stderr.isatty() if progress is None else progress
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "index").mkdir(exist_ok=True)
    except OSError as e:
        raise CacheError(f"{directory}: cannot create the model cache: {e.strerror}") from e
    if sha is None:
        with Progress(sum(p.stat().st_size for p in files), f"hashing {src.name}", enabled=show) as bar:
            sha, _ = converter.sha256_files(files, bar)
    out = directory / f"{sha}.blm"
    f = _usable(out, sha, verify, prefetch)
    if f is None:
        if show:
            print(f"barellm: converting {src} to {out} (once; later loads map it directly)", file=sys.stderr)
        try:
            converter.convert(src, out, layout=CACHE_LAYOUT, source_sha256=sha, progress=show)
        except (FormatError, ModelNotFound):
            raise
        except BarellmError as e:  # writing failed (the source was fine)
            raise CacheError(str(e)) from e
        f = blm.BLMFile(out, prefetch=prefetch)
    try:
        if index:
            write_bytes_atomic(idx, json.dumps({"sha256": sha, "source": str(src.resolve())}).encode())
    except OSError:
        pass  # without the index entry the next start hashes the source again; it still works
    return f


def open_model(path: str | os.PathLike[str], *, convert: bool | None = None, verify: bool = False,
               prefetch: bool = True) -> Any:
    """Opens a model file for the engines: .metadata, .tensors, .raw(name), .dequantize(name).

    A .blm file is mapped as it is. A GGUF file or a checkpoint directory is converted once into the
    model cache and mapped from there afterwards; with convert=False (default: unless BARELLM_CONVERT=0),
    a GGUF file is read directly instead. A .blm's tensors are checked against their checksums, a sample of
    them at every load, all of them with verify (a corrupt file in the cache is converted again; one given
    by path is a FormatError naming the tensor). With prefetch, a .blm's pages are mapped in on a background
    thread while the load goes on (MappedFile.prefetch): the engines read them in place.
    """
    path = Path(path)
    kind = sniff(path)
    if kind == "blm":
        f = blm.BLMFile(path, prefetch=prefetch)
        try:
            check_data(f, verify)
        except BaseException:
            f.close()
            raise
        return f
    if convert is None:
        convert = os.environ.get("BARELLM_CONVERT", "1") != "0"
    if not convert:
        if kind == "gguf":
            from barellm.formats.gguf import GGUFFile

            return GGUFFile(path)
        raise FormatError(f"{path}: a checkpoint directory is only read by converting it (`barellm convert`)")
    try:
        return open_cached(path, verify=verify, prefetch=prefetch)
    except CacheError as e:
        if kind != "gguf":
            raise
        # a read-only or full cache should not stop a GGUF file from running
        print(f"barellm: {e}; reading {path.name} directly", file=sys.stderr)
        from barellm.formats.gguf import GGUFFile

        return GGUFFile(path)
