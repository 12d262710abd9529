"""Where a token's time goes: `Timings` accumulates seconds per phase of the token loop (forward, logits copy,
sample, ...) for `barellm bench --breakdown`, the Python API's results and the server's /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

__all__ = ["PHASES", "Timings"]

# The phases of a token's life, in order. "forward" is the native executor running the layers; "logits copy"
# the rest of the engine call (its Python wrapper filling token and position arrays, the logits copied out);
# "grammar" the constrained-decoding parser (waiting for its mask, taking the chosen token); "write" the
# server's formatting and sending of the events (the Python API has none).
PHASES = ("forward", "logits copy", "grammar", "sample", "logprobs", "detokenize", "stop", "bookkeeping", "write")


@dataclass(eq=False, slots=True)
class Timings:
    """Seconds spent in each phase of the token loop, and the tokens generated meanwhile.

    The driver of the loop adds its engine calls (`engine`) and its whole wall time (`wall`); the executor's
    own share of the engine calls lands in seconds["forward"] where the engine counts it (the native engine's
    executor_seconds), and `breakdown` then gives the rest of the engine calls as "logits copy". What no
    phase accounts for is "bookkeeping": the driver's own work (slots, events, the loop itself).

    With speculative decoding (generate/speculative/): `drafted` tokens were fed for checking in
    `verifications` engine calls, `accepted` of them were what the model chose anyway, and those calls gave
    `verified` tokens in all (the accepted ones and each call's own)."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    tokens: int = 0
    engine: float = 0.0
    wall: float = 0.0
    drafted: int = 0
    accepted: int = 0
    verifications: int = 0
    verified: int = 0

    @property
    def acceptance(self) -> float | None:
        """The share of drafted tokens accepted (None when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_verification(self) -> float | None:
        """Tokens each checking call gave on average (None when nothing was drafted)."""
        return self.verified / self.verifications if self.verifications else None

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def merge(self, other: Timings) -> None:
        for k, v in other.seconds.items():
            self.seconds[k] += v
        for f in fields(self):
            if f.name != "seconds":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def breakdown(self) -> dict[str, float]:
        """Seconds by phase (PHASES order); they add up to the wall time."""
        out = dict(self.seconds)
        if out["forward"] > 0:
            out["logits copy"] = max(0.0, self.engine - out["forward"])
        else:
            out["forward"] = self.engine
        # the server writes from another thread, alongside: not part of the loop's wall time
        measured = sum(v for k, v in out.items() if k not in ("bookkeeping", "write"))
        out["bookkeeping"] += max(0.0, self.wall - measured)
        return out

    def per_token_ms(self) -> dict[str, float]:
        n = max(self.tokens, 1)
        return {k: 1000 * v / n for k, v in self.breakdown().items()}
