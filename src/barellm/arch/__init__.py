"""Model architectures: their configs and NumPy reference forward passes."""

from __future__ import annotations

from typing import Any

from barellm.arch.config import ModelConfig


def reference_engine(cfg: ModelConfig, source: Any, n_ctx: int, n_slots: int = 1, kv_type: str = "f32") -> Any:
    """The NumPy float32 reference engine for cfg's architecture (kv_type: ReferenceEngine's)."""
    from barellm.arch.llama import ReferenceEngine  # every row of the registry is a llama-family model

    return ReferenceEngine(cfg, source, n_ctx, n_slots, kv_type)
