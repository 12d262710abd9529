"""The ISA tiers of the native core, for the kernel tests: every tier is a test parameter; the ones this CPU
lacks are skipped by name (the session header says which ran)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from barellm import _native as nat

ALL = ("scalar", "avx2", "avx512", "amx")
PRESENT = tuple(nat.cpu_info()["tiers"])
ABSENT = tuple(t for t in ALL if t not in PRESENT)


def params() -> list:
    """Every tier as a pytest parameter, those this CPU lacks marked skipped with the reason."""
    return [pytest.param(t, marks=pytest.mark.skipif(t not in PRESENT, reason=f"this CPU lacks the {t} tier"))
            for t in ALL]


@contextmanager
def using(tier: str) -> Iterator[str]:
    """Caps the kernel tier for the block; gives back the one that was in use."""
    before = nat.cpu_info()["isa"]
    nat.set_isa(tier)
    try:
        yield tier
    finally:
        nat.set_isa(before)
