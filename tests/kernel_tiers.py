"""The ISA tiers of the native core, for the kernel tests: every tier is a test parameter; the ones this CPU
lacks are skipped by name (the session header says which ran). Besides the tiers, "amx-emulated": the amx
tier's kernels on the tile emulation (amx/tile.h), which every x86-64 CPU runs, so that the amx kernels are
checked on machines without AMX too; on an AMX CPU both it and the hardware tier run."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from barellm import _native as nat

ALL = nat.tier_names()
PRESENT = tuple(nat.cpu_info()["tiers"])
ABSENT = tuple(t for t in ALL if t not in PRESENT)
EMULATED = tuple(nat.cpu_info()["emulated"])
# the tiers and emulations that run here, for tests that loop over them
RUN = PRESENT + EMULATED


def params() -> list:
    """Every tier as a pytest parameter, those this CPU lacks marked skipped with the reason, then the
    emulated amx kernels."""
    return [pytest.param(t, marks=pytest.mark.skipif(t not in PRESENT, reason=f"this CPU lacks the {t} tier"))
            for t in ALL] + list(EMULATED)


@contextmanager
def using(tier: str) -> Iterator[str]:
    """Caps the kernel tier for the block; gives back the one that was in use. On the amx kernels (hardware
    or emulated) every call takes the tiles, however few its tokens, so that the tests reach their tails."""
    before = nat.cpu_info()["isa"]
    nat.set_isa(tier)
    min_tokens = nat.amx_min_tokens(1) if tier.startswith("amx") else None
    try:
        yield tier
    finally:
        if min_tokens is not None:
            nat.amx_min_tokens(min_tokens)
        nat.set_isa(before)
