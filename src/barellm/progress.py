"""A dependency-free progress bar for long steps (pull, convert, perplexity), drawn on stderr."""

from __future__ import annotations

import sys
import time
from types import TracebackType


class Progress:
    """done/total with a bar; for bytes also the rate and the time left. start: what was there before (a
    resumed download), counted as done but not in the rate."""

    def __init__(self, total: int, label: str, *, enabled: bool = True, unit: str = "B", start: int = 0) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.unit = unit
        self.done = start
        self._start_done = start
        self.detail = ""   # shown after the counts (what a count of parts amounts to, in bytes)
        self.enabled = enabled
        self._tty = sys.stderr.isatty()
        self._last = 0.0
        self._start = time.monotonic()

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > (0.1 if self._tty else 2.0) or self.done >= self.total):
            self._last = now
            self._draw()

    def _fmt(self, n: float) -> str:
        if self.unit == "B":
            return f"{n / 1e6:.1f} MB"
        return f"{int(n)}"

    def _draw(self) -> None:
        frac = min(self.done / self.total, 1.0)
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        line = f"{self.label} [{bar}] {frac * 100:5.1f}% {self._fmt(self.done)}/{self._fmt(self.total)}"
        elapsed = time.monotonic() - self._start
        rate = (self.done - self._start_done) / elapsed if elapsed > 0 else 0.0
        if self.detail:
            line += f" {self.detail}"
        if rate > 0:
            left = max(self.total - self.done, 0) / rate
            line += f"{' ' + format(rate / 1e6, '.1f') + ' MB/s,' if self.unit == 'B' else ''} " \
                    f"{int(left) // 60}:{int(left) % 60:02d} left"
        sys.stderr.write(("\r" + line + "\x1b[K") if self._tty else (line + "\n"))
        sys.stderr.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self.enabled and self._tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
