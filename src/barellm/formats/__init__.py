"""Model file formats: GGUF (read) and barellm's own .blm (read and write)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

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


def open_model_file(path: Path, *, convert: bool | None = None) -> Any:
    """Opens a model file for the engines: .metadata, .tensors, .raw(name), .dequantize(name).

    A .blm file is mapped as it is. A GGUF file or a checkpoint directory is converted once into the
    model cache ($BARELLM_HOME/blm) and mapped from there afterwards (see barellm.convert.open_cached);
    with convert=False (default: unless BARELLM_CONVERT=0), a GGUF file is read directly instead.
    """
    path = Path(path)
    kind = sniff(path)
    if kind == "blm":
        from barellm.formats.blm import BLMFile

        return BLMFile(path)
    if convert is None:
        convert = os.environ.get("BARELLM_CONVERT", "1") != "0"
    if not convert:
        if kind == "gguf":
            from barellm.formats.gguf import GGUFFile

            return GGUFFile(path)
        raise FormatError(f"{path}: a checkpoint directory is only read by converting it (`barellm convert`)")
    from barellm.convert import CacheError, open_cached

    try:
        return open_cached(path)
    except CacheError as e:
        if kind != "gguf":
            raise
        # a read-only or full cache should not stop a GGUF file from running
        print(f"barellm: {e}; reading {path.name} directly", file=sys.stderr)
        from barellm.formats.gguf import GGUFFile

        return GGUFFile(path)
