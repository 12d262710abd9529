"""Model architectures: their configs and NumPy reference forward passes."""

from __future__ import annotations

from typing import Any

from barellm.arch.config import ModelConfig
from barellm.errors import FormatError


def reference_engine(cfg: ModelConfig, source: Any, n_ctx: int) -> Any:
    """The NumPy float32 reference engine for cfg's architecture."""
    if cfg.arch == "llama":
        from barellm.arch.llama import ReferenceEngine

        return ReferenceEngine(cfg, source, n_ctx)
    raise FormatError(f"no reference forward for architecture {cfg.arch!r}")
