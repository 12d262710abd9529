"""Model file formats: GGUF (read) and barellm's own .blm (read and write).

This layer reads and writes files and knows nothing of conversion, caching or engines (cache.py opens a
model for loading; convert.py turns other formats into .blm).
"""

from __future__ import annotations

from pathlib import Path

from barellm.errors import FormatError

GGUF_MAGIC = b"GGUF"


def sniff(path: Path) -> str:
    """The kind of model file at path: "gguf", "blm" or "hf" (a checkpoint directory)."""
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf"
        raise FormatError(f"{path}: a directory without config.json is not a model checkpoint")
    try:
        with open(path, "rb") as f:
            magic = f.read(8)
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror}") from e
    if magic[:4] == GGUF_MAGIC:
        return "gguf"
    if magic[:4] == b"BLM\0" or magic[:8].startswith(b"BARELLM"):
        return "blm"
    raise FormatError(f"{path}: not a model file (starts with {magic[:4]!r}; expected GGUF or a barellm .blm)")
