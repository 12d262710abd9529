"""GGUF metadata as the plain dict the tokenizer and chat templates are built from, read once per path."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any


@functools.lru_cache(maxsize=4)
def read_metadata(path: Path) -> dict[str, Any]:
    try:
        from barellm.formats.gguf import GGUFFile
    except ImportError:
        return _read_with_gguf_package(path)
    f = GGUFFile(path)
    try:
        return dict(f.metadata)
    finally:
        f.close()


def _read_with_gguf_package(path: Path) -> dict[str, Any]:
    # Same shape as GGUFFile.metadata: key -> str, int, float, bool or a list of those.
    from gguf import GGUFReader
    from gguf.constants import GGUFValueType

    md: dict[str, Any] = {}
    for name, field in GGUFReader(path).fields.items():
        if name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            if field.types[-1] == GGUFValueType.STRING:
                md[name] = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
            else:
                md[name] = [field.parts[i][0].item() for i in field.data]
        elif vtype == GGUFValueType.STRING:
            md[name] = bytes(field.parts[field.data[0]]).decode("utf-8", "surrogateescape")
        else:
            md[name] = field.parts[field.data[0]][0].item()
    return md
