"""Shared by the engine tests: opening a model file as a weight source."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class _Info:
    name: str
    shape: tuple[int, ...]
    type: int


class GGUFPackageSource:
    """A weight source over the `gguf` package's reader (used when barellm's own reader is absent)."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self._r = GGUFReader(str(path))
        self.metadata: dict[str, Any] = {}
        for k, f in self._r.fields.items():
            try:
                self.metadata[k] = f.contents()
            except Exception:  # noqa: BLE001 - fields the engines do not need
                pass
        self._t = {t.name: t for t in self._r.tensors}
        self.tensors = {t.name: _Info(t.name, tuple(int(d) for d in reversed(t.shape)), int(t.tensor_type))
                        for t in self._r.tensors}

    def raw(self, name: str) -> np.ndarray:
        return np.asarray(self._t[name].data).reshape(-1).view(np.uint8)

    def dequantize(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        t = self._t[name]
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(self.tensors[name].shape)


def open_source(path: Path) -> Any:
    try:
        from barellm.formats.gguf import GGUFFile
    except ImportError:
        return GGUFPackageSource(path)
    return GGUFFile(path)


def load_config(src: Any):
    from barellm.arch.config import config_from_metadata

    return config_from_metadata(src.metadata, src.tensors["token_embd.weight"].shape[0],
                                tied_output="output.weight" not in src.tensors)
