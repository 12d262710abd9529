"""What each KV cache slot holds: `SlotTable` remembers which tokens each slot's cache holds and picks the free
slot whose cache serves a new prompt best, so a continuing conversation finds its prefix."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

__all__ = ["SlotTable", "common_prefix"]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotTable:
    """What each KV cache slot holds (the tokens whose entries are valid, in order) and which are in use.

    A new sequence goes to the free slot whose cache saves it the most prefill without throwing away more
    than it saves (see `score`). Not thread-safe: its owner serializes access."""

    def __init__(self, n_slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.n = n_slots
        self.tokens: list[list[int]] = [[] for _ in range(n_slots)]
        self.busy = [False] * n_slots
        self.used_at = [0.0] * n_slots
        self.clock = clock

    def free(self) -> list[int]:
        return [i for i in range(self.n) if not self.busy[i]]

    def score(self, slot: int, prompt: Sequence[int], cache_prompt: bool = True) -> tuple[int, float]:
        """How good a free slot is for prompt: the prompt tokens its cache saves now, minus the cached tokens
        it would throw away (which another conversation's next turn may still want); ties go to the least
        recently used slot. So a continuing conversation returns to its own slot, a new one that shares only
        a system prompt with the others takes an empty slot rather than evicting one of them, and a repeated
        long prompt still finds its cache."""
        held = len(self.tokens[slot])
        saved = common_prefix(self.tokens[slot], prompt) if cache_prompt else 0
        return saved - (held - saved), -self.used_at[slot]

    def choose(self, prompt: Sequence[int], cache_prompt: bool = True) -> int | None:
        free = self.free()
        if not free:
            return None
        return max(free, key=lambda i: self.score(i, prompt, cache_prompt))

    def take(self, slot: int, prompt: Sequence[int], cache_prompt: bool = True) -> int:
        """Marks slot in use for prompt; returns how many prompt tokens its cache serves (at least the last
        one is always fed, to get the logits that follow it). The cache is cut back to those."""
        reuse = min(common_prefix(self.tokens[slot], prompt), len(prompt) - 1) if cache_prompt else 0
        reuse = max(reuse, 0)
        del self.tokens[slot][reuse:]
        self.busy[slot] = True
        self.used_at[slot] = self.clock()
        return reuse

    def release(self, slot: int) -> None:
        self.busy[slot] = False
        self.used_at[slot] = self.clock()

    def forget(self, slot: int | None = None) -> None:
        """The cache contents are unknown (a failed step, another owner wrote there): nothing is reused."""
        for i in range(self.n) if slot is None else (slot,):
            self.tokens[i] = []
