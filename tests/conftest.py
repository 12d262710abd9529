"""Shared fixtures: the real models (fetched once into the cache) and the golden reference data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from kernel_tiers import ABSENT, PRESENT, using
from kernel_tiers import params as tier_params

from barellm import _native

DATA = Path(__file__).parent / "data"


def _resolve(name: str, env: str) -> Path:
    override = os.environ.get(env)
    if override:
        return Path(override)
    from barellm.store import hub

    return hub.pull(name, keep_gguf=True, quiet=True)  # the GGUF itself: tests read it with other readers too


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """Path of the default model's GGUF (SmolLM2-135M-Instruct Q4_1)."""
    return _resolve("smollm2-135m", "BARELLM_SMOLLM_GGUF")


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF."""
    return _resolve("gemma3-270m", "BARELLM_GEMMA_GGUF")


def load_data(name: str):
    """A JSON file from tests/data."""
    with open(DATA / name, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="session")
def qwen05_gguf() -> Path:
    """Path of the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF."""
    return _resolve("qwen2.5-coder-0.5b", "BARELLM_QWEN05_GGUF")


@pytest.fixture(scope="session")
def qwen15_gguf() -> Path:
    """Path of the Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF (the slow tests only: CI does not pull it)."""
    return _resolve("qwen2.5-coder-1.5b", "BARELLM_QWEN15_GGUF")


def plain(metadata: dict) -> dict:
    """Metadata with numeric arrays as lists (the .blm reader hands them over as NumPy views of the file)."""
    return {k: v.tolist() if hasattr(v, "tolist") and not isinstance(v, (str, bytes)) else v
            for k, v in metadata.items()}


def pytest_report_header(config):
    absent = f"; absent, their tests skipped: {', '.join(ABSENT)}" if ABSENT else ""
    return f"kernel tiers run: {', '.join(PRESENT)} (in use: {_native.cpu_info()['isa']}){absent}"


@pytest.fixture(params=tier_params())
def isa(request):
    """Each ISA tier in turn (the kernel tests' parameter); the tier in use is restored after."""
    with using(request.param):
        yield request.param
