"""Choosing the next token from logits: penalties, then top-k, top-p, min-p, temperature, a seeded draw.

The order follows llama.cpp's default chain so the same settings mean the same thing in both.
temperature <= 0 is greedy: the argmax after penalties (the lowest id wins a tie), with no randomness.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from barellm.errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40              # 0 = off
    top_p: float = 0.95          # 1 = off
    min_p: float = 0.05          # 0 = off
    repeat_penalty: float = 1.0  # 1 = off; > 1 makes recent tokens less likely (llama.cpp's rule)
    repeat_last_n: int = 64      # how many recent tokens the penalties look at (-1 = all)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def validated(self) -> SamplingParams:
        def check(ok: bool, what: str) -> None:
            if not ok:
                raise InvalidRequest(what)

        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                  f"{name} must be a finite number, got {value!r}")
        check(0 <= self.temperature <= 100, f"temperature must be in [0, 100], got {self.temperature}")
        check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(0 < self.repeat_penalty <= 10, f"repeat_penalty must be in (0, 10], got {self.repeat_penalty}")
        check(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2 <= self.frequency_penalty <= 2,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(isinstance(self.repeat_last_n, int) and self.repeat_last_n >= -1,
              f"repeat_last_n must be an integer >= -1, got {self.repeat_last_n!r}")
        check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
              f"seed must be an integer, got {self.seed!r}")
        return self

    def with_(self, **changes: Any) -> SamplingParams:
        """A copy with the given fields changed, ignoring those set to None (except seed)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def apply_penalties(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> np.ndarray:
    """Repetition (multiplicative, llama.cpp style) and presence/frequency (additive, OpenAI style)."""
    if not history or (p.repeat_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0):
        return logits
    recent = history if p.repeat_last_n < 0 else history[len(history) - p.repeat_last_n:] if p.repeat_last_n else []
    if len(recent) == 0:
        return logits
    ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
    ids_ok = (ids >= 0) & (ids < logits.shape[0])
    ids, counts = ids[ids_ok], counts[ids_ok]
    out = logits.copy()
    vals = out[ids]
    if p.repeat_penalty != 1:
        vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    vals = vals - counts * np.float32(p.frequency_penalty) - np.float32(p.presence_penalty)
    out[ids] = vals
    return out


def candidates(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The ids that survive top-k, top-p and min-p, and their probabilities after temperature.

    Filters are applied in llama.cpp's order (top-k, top-p, min-p on the untempered distribution,
    then temperature), so a given setting keeps the same ids in both engines.
    """
    n = logits.shape[0]
    k = p.top_k if 0 < p.top_k < n else n
    if k < n:
        ids = np.argpartition(-logits, k - 1)[:k]
    else:
        ids = np.arange(n)
    # Sort the survivors best first; ties by id so the order never depends on the partition.
    order = np.lexsort((ids, -logits[ids]))
    ids = ids[order]
    z = logits[ids].astype(np.float64)
    probs = np.exp(z - z[0])
    probs /= probs.sum()
    keep = len(ids)
    if p.top_p < 1:
        # keep the smallest prefix whose mass reaches top_p (at least one token)
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
    if p.min_p > 0:
        keep = min(keep, max(1, int(np.count_nonzero(probs[:keep] >= p.min_p * probs[0]))))
    ids, z = ids[:keep], z[:keep]
    t = max(p.temperature, 1e-6)
    probs = np.exp((z - z[0]) / t)
    probs /= probs.sum()
    return ids, probs


class Sampler:
    """Draws tokens for one generation; the same seed gives the same draws."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params.validated()
        self.rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        logits = apply_penalties(np.asarray(logits, dtype=np.float32).reshape(-1), history, self.params)
        if self.params.greedy:
            return int(np.argmax(logits))
        ids, probs = candidates(logits, self.params)
        # one uniform draw per token, mapped through the cumulative distribution: reproducible
        # across NumPy versions, unlike Generator.choice's internals
        u = self.rng.random()
        return int(ids[min(int(np.searchsorted(np.cumsum(probs), u, side="right")), len(ids) - 1)])
