"""The bounds-checked cursor both model-file readers parse their headers with (gguf.py, blm.py).

It reads the mapped bytes [pos, end) and refuses to go past end: every read names its field, and every refusal
is one `FormatError` line, "<path>: <field> at offset <n>: <what is wrong>", so that a truncated or hostile
file is reported where it goes wrong, whichever format it is. Each format adds its own value types on top.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

from barellm.errors import FormatError


class BoundedReader:
    """A cursor over buf[pos:end] of the file at path; `region` names what end is the end of ("file",
    "header") in its messages."""

    def __init__(self, buf: mmap.mmap, pos: int, end: int, path: str, region: str = "file") -> None:
        self.buf, self.pos, self.end, self.path, self.region = buf, pos, end, path, region

    def error(self, field: str, offset: int, what: str) -> FormatError:
        return FormatError(f"{self.path}: {field} at offset {offset}: {what}")

    def left(self) -> int:
        return self.end - self.pos

    def need(self, n: int, field: str) -> None:
        if n > self.end - self.pos:
            raise self.error(field, self.pos, f"truncated: needs {n} bytes but the {self.region} ends at offset "
                                              f"{self.end}")

    def unpack(self, st: struct.Struct, field: str) -> Any:
        """One struct's fields (its only one as itself), the cursor past them."""
        self.need(st.size, field)
        v = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return v[0] if len(v) == 1 else v

    def fits(self, n: int, min_bytes: int, field: str, at: int, what: str = "entries") -> None:
        """Refuses a count of n items, each at least min_bytes long, that cannot fit in what is left (the count
        read at offset at)."""
        if n * min_bytes > self.end - self.pos:
            raise self.error(field, at, f"{n} {what} cannot fit in the {self.end - self.pos} bytes left in the "
                                        f"{self.region}")

    def text(self, n: int, field: str, at: int) -> str:
        """The next n bytes as text (their length read at offset at). Invalid UTF-8 is kept, not refused:
        surrogateescape maps each bad byte to a lone surrogate, so s.encode("utf-8", "surrogateescape") gives
        back the exact bytes (token texts need that)."""
        if n > self.end - self.pos:
            raise self.error(field, at, f"string length {n} runs past the end of the {self.region} "
                                        f"({self.end - self.pos} bytes left)")
        start = self.pos
        self.pos += n
        return self.buf[start:start + n].decode("utf-8", "surrogateescape")
