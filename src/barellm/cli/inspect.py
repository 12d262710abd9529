"""`barellm inspect FILE`: what a model file holds (header, metadata, tensor table), without running it."""

from __future__ import annotations

import argparse
import math
from collections import Counter
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="metadata and tensor table of a .gguf or .blm file",
                       description="Shows a model file's header, metadata and tensors. FILE may be a model name.")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--tensors", action="store_true", help="list every tensor (default: a summary by type)")
    p.add_argument("--all-metadata", action="store_true", help="show long values (vocabularies) in full")
    p.set_defaults(func=cmd_inspect)


def preview(value: Any, full: bool = False, width: int = 72) -> str:
    """A one-line rendering of a metadata value; long lists are abbreviated."""
    if isinstance(value, (list, tuple)):
        if full or len(value) <= 8:
            text = "[" + ", ".join(preview(v, full, 24) for v in value) + "]"
        else:
            head = ", ".join(preview(v, False, 24) for v in value[:4])
            text = f"[{head}, … {len(value)} items]"
    elif isinstance(value, str):
        text = repr(value)
    else:
        text = str(value)
    return text if full or len(text) <= width else text[: width - 1] + "…"


def cmd_inspect(args: argparse.Namespace) -> int:
    from barellm.errors import FormatError
    from barellm.formats import sniff
    from barellm.formats.quant import TYPES
    from barellm.store import catalog
    from barellm.store.converted import open_model

    path = catalog.resolve(args.file, pull_missing=False)
    kind = sniff(Path(path))
    if kind == "hf":
        raise FormatError(f"{path}: a checkpoint directory; `barellm convert` it and inspect the .blm")
    src = open_model(Path(path), convert=False, prefetch=False)  # the file itself, not its converted copy
    size = Path(path).stat().st_size
    print(f"file: {path}")
    print(f"format: {kind}" + (f" v{src.version}" if hasattr(src, "version") else "") + f", {size / 1e6:.1f} MB")
    for line in getattr(src, "header_lines", lambda: [])():
        print(line)
    print(f"metadata ({len(src.metadata)} keys):")
    for key, value in src.metadata.items():
        print(f"  {key} = {preview(value, args.all_metadata)}")
    tensors = src.tensors
    total = sum(t.nbytes for t in tensors.values())
    n_params = sum(math.prod(map(int, t.shape)) for t in tensors.values())
    print(f"tensors: {len(tensors)}, {n_params / 1e6:.1f} M parameters, {total / 1e6:.1f} MB")

    def tname(t: Any) -> str:
        row = TYPES.get(t.type)
        return row.name if row else f"type {t.type}"

    if args.tensors:
        for name, t in tensors.items():
            layout = f" {getattr(t, 'layout_name', t.layout)}" if getattr(t, "layout", None) not in (None, 0) else ""
            print(f"  {name:<40} {tname(t):<6} {str(tuple(t.shape)):<16} {t.nbytes:>11,} B{layout}")
    else:
        by_type: Counter[str] = Counter()
        bytes_by_type: Counter[str] = Counter()
        for t in tensors.values():
            key = tname(t) + (f" {getattr(t, 'layout_name', t.layout)}" if getattr(t, "layout", 0) else "")
            by_type[key] += 1
            bytes_by_type[key] += t.nbytes
        for name, count in by_type.most_common():
            print(f"  {name:<6} {count:>4} tensors {bytes_by_type[name] / 1e6:>9.1f} MB")
        print("  (--tensors lists them all)")
    return 0
