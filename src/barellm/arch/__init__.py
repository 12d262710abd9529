"""Model architectures: their configs and NumPy reference forward passes."""

from __future__ import annotations

from typing import Any

from barellm.arch.config import ModelConfig
from barellm.errors import FormatError


def reference_engine(cfg: ModelConfig, source: Any, n_ctx: int, n_slots: int = 1) -> Any:
    """The NumPy float32 reference engine for cfg's architecture."""
    if cfg.arch in ("llama", "gemma3"):
        from barellm.arch.llama import ReferenceEngine

        return ReferenceEngine(cfg, source, n_ctx, n_slots)
    raise FormatError(f"no reference forward for architecture {cfg.arch!r}")
