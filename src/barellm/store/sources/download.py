"""What every download of a model file shares: the disk checked before a byte is written, a progress bar
(bytes, rate, time left) or progress reports for a server, files checked against their SHA-256 before they
take their final name, and a rerun that resumes where an interrupted download stopped.

A download writes to NAME.part beside its target and renames it only once the whole file hashed right: a
Ctrl-C leaves no file under the final name, and the .part is where the next run resumes (an HTTP Range
request for the bytes that are missing).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from barellm.errors import BarellmError
from barellm.files import fsync_dir
from barellm.progress import Progress

# what a pull reports to a server, as Ollama's progress objects ({"status", "digest", "total", "completed"})
StatusReport = Callable[[dict[str, Any]], None]
# free space a pull keeps beyond what it writes: a disk filled to the last byte breaks more than the pull
DISK_MARGIN = 64 << 20
_REPORT_SECONDS = 0.25
_CHUNK = 1 << 20


def mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _existing_parent(path: Path) -> Path:
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path("/")


def check_disk(directory: Path, needed: int, what: str) -> None:
    """Refuses a write of `needed` bytes into `directory` that the disk has no room for, before a byte of it
    is written; `what` says what the bytes are, for the message."""
    free = shutil.disk_usage(_existing_parent(directory)).free
    if needed + DISK_MARGIN > free:
        raise BarellmError(f"not enough free disk for {what}: it needs {mb(needed)} in {directory}, and "
                           f"{mb(free)} is free there; free some space (`barellm rm MODEL`) and pull again")


def say(text: str, quiet: bool) -> None:
    if not quiet:
        print(text, file=sys.stderr)


class Reporter:
    """Tells a server's pull how a download goes, as Ollama's {"status", "digest", "total", "completed"} lines,
    a few times a second at most."""

    def __init__(self, on_status: StatusReport | None, status: str, digest: str, total: int) -> None:
        self.on_status = on_status
        self.status, self.digest, self.total = status, digest, total
        self._last = 0.0

    def __call__(self, completed: int, force: bool = False) -> None:
        now = time.monotonic()
        if self.on_status is not None and (force or now - self._last >= _REPORT_SECONDS):
            self._last = now
            self.on_status({"status": self.status, "digest": self.digest, "total": self.total,
                            "completed": completed})


def fetch(url: str, target: Path, *, sha256: str, size: int | None, label: str, quiet: bool = False,
          headers: Mapping[str, str] | None = None, on_status: StatusReport | None = None,
          timeout: float = 60.0) -> Path:
    """Downloads url into target, resuming a TARGET.part an earlier run left, and checks the whole file
    against sha256 before renaming it to target (a mismatch removes it: the next run starts over). A target
    that is there already is trusted (it was checked before it took its name)."""
    if target.is_file():
        return target
    import http.client  # here, not at the top: finding a model by name (every load) needs no HTTP client
    import urllib.error
    import urllib.request

    part = target.with_name(target.name + ".part")
    have = part.stat().st_size if part.is_file() else 0
    if size is not None and have > size:
        part.unlink()
        have = 0
    request = urllib.request.Request(url, headers={**(headers or {}), **({"Range": f"bytes={have}-"} if have else {})})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and size is not None and have == size:   # the .part is whole already
            response = None
        else:
            raise BarellmError(f"{label}: {url} answered {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise BarellmError(f"{label}: cannot reach {url}: {getattr(e, 'reason', e)}") from None
    h = hashlib.sha256()
    if response is not None and have and response.status != 206:
        have = 0   # the server ignored the Range: it sends the whole file, which replaces the .part
    if have:
        with open(part, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    if response is not None:
        total = size if size is not None else have + int(response.headers.get("Content-Length") or 0)
        report = Reporter(on_status, f"pulling {sha256[:12]}", f"sha256:{sha256}", total)
        with response, open(part, "ab" if have else "wb") as out, \
                Progress(total, label, enabled=not quiet, start=have) as bar:
            report(have, force=True)
            done = have
            try:
                while chunk := response.read(_CHUNK):
                    out.write(chunk)
                    h.update(chunk)
                    done += len(chunk)
                    bar.advance(len(chunk))
                    report(done)
            except (OSError, http.client.HTTPException) as e:
                out.flush()
                raise BarellmError(f"{label}: the download broke off after {mb(done)} of {mb(total)} ({e!r}); "
                                   "pull again to resume it") from None
            finally:
                out.flush()
                os.fsync(out.fileno())
            report(done, force=True)
    if size is not None and part.stat().st_size != size:
        raise BarellmError(f"{label}: the download ended after {mb(part.stat().st_size)} of {mb(size)}; pull "
                           "again to resume it")
    digest = h.hexdigest()
    if digest != sha256:
        part.unlink(missing_ok=True)
        raise BarellmError(f"{label}: SHA-256 {digest} does not match the expected {sha256}; the download is "
                           "corrupt or was tampered with, and was removed")
    os.replace(part, target)
    fsync_dir(target.parent)
    return target
