"""GGUF metadata as the plain dict the tokenizer and chat templates are built from, read once per path."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from barellm.formats.gguf import GGUFFile


@functools.lru_cache(maxsize=4)
def read_metadata(path: Path) -> dict[str, Any]:
    f = GGUFFile(path)
    try:
        return dict(f.metadata)
    finally:
        f.close()
