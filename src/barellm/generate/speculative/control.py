"""When drafting pays: the measured cost of an engine call by the tokens it feeds, each sequence's recent
acceptance, and the choice of draft lengths that maximises the tokens a step yields per second.

A step that feeds B decoding tokens yields B tokens; with k_i drafted tokens for sequence i, each accepted
with probability a_i independently of position (the acceptance the sequence has shown lately), it yields
B + sum_i (a_i + a_i^2 + ... + a_i^k_i) tokens on average and costs C(B + sum k_i) plus the drafting.
The draft lengths are handed out one token at a time to the sequence whose next drafted token is the most
likely to be accepted, and the step keeps the total that gives the most tokens per second, only if that
beats plain decoding (B / C(B)) by a margin. So a sequence that keeps missing drafts nothing, a batch that
already makes the engine compute-bound (many live sequences) drafts little or nothing, and a draft that
costs more to check than it is likely to give is never made.

C(T) is what this engine's calls of T tokens have taken lately (CostTable): nothing is tuned for one
machine, and as the small-T kernels get faster the same rule drafts further.
"""

from __future__ import annotations

import bisect
import heapq
import weakref
from collections.abc import Callable, Sequence
from typing import Any

PRIOR_SLOPE = 0.1      # before a T-token call is measured: each token past the first adds this share of one
EMA_DOWN = 0.3         # weight of a new measurement below a cost's running average
EMA_UP = 0.15          # and above it: on a shared machine the noise is mostly other work slowing a call down
DECAY = 0.8            # weight of a sequence's earlier acceptance against a new observation
LATELY_DECAY = 0.95    # the same for a drafter's acceptance over every sequence (a new sequence's prior)
IDLE_DECAY = 0.97      # per step without drafting, a draft model's acceptance drifts back to its prior
MARGIN = 0.03          # drafting must promise this much more than plain decoding (timing noise)
EXPLORE_EVERY = 16     # every this many plans, the costs are taken at their most hopeful (see Speculation.plan)
MAX_STEP_DRAFTS = 32   # drafted tokens in one step, all sequences together


class CostTable:
    """Seconds an engine call takes by the tokens it feeds: running averages of the calls measured (from each
    count's second call: the first is a cold one), and for a count never measured an estimate from its
    neighbours (interpolated; beyond the largest, extended by the last measured slope, which errs low, so a
    longer call gets tried and measured rather than assumed slow). The average follows a faster call more
    readily than a slower one: a call slowed by a page fault or by other work on the machine says less about
    the engine than a quick one."""

    def __init__(self) -> None:
        self._avg: dict[int, float] = {}
        self._keys: list[int] = []
        self._cold: set[int] = set()   # counts called once (not measured yet)

    def record(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds > 0:
            return
        old = self._avg.get(tokens)
        if old is None:
            # a count's first call is a cold one (a kernel path's first run: its scratch allocated, its code and
            # buffers first touched; a draft model's weights faulted in), up to 2-3 times a warm one, and a
            # count judged dear on such a call would not be tried again: it is not counted
            if tokens not in self._cold:
                self._cold.add(tokens)
                return
            self._avg[tokens] = seconds
            self._keys = sorted(self._avg)
        else:
            self._avg[tokens] = old + (EMA_DOWN if seconds < old else EMA_UP) * (seconds - old)

    def measured(self, tokens: int) -> bool:
        return tokens in self._avg

    def __bool__(self) -> bool:
        return bool(self._avg)

    def __call__(self, tokens: int) -> float | None:
        """The estimated seconds of a call of `tokens` tokens; None before any call was measured."""
        avg = self._avg
        got = avg.get(tokens)
        if got is not None:
            return got
        keys = self._keys
        if not keys:
            return None
        at = bisect.bisect_left(keys, tokens)   # keys[at - 1] < tokens < keys[at]
        lo = keys[at - 1] if at > 0 else None
        hi = keys[at] if at < len(keys) else None
        if lo is not None and hi is not None:
            return avg[lo] + (avg[hi] - avg[lo]) * (tokens - lo) / (hi - lo)
        if lo is None:   # below every measured count: a share of the smallest, never less than per token
            assert hi is not None
            return avg[hi] / (1 + PRIOR_SLOPE * (hi - 1)) * (1 + PRIOR_SLOPE * (tokens - 1))
        if at >= 2:
            prev = keys[at - 2]
            slope = max(0.0, (avg[lo] - avg[prev]) / (lo - prev))
        else:
            slope = PRIOR_SLOPE * avg[lo] / (1 + PRIOR_SLOPE * (lo - 1))
        return avg[lo] + slope * (tokens - lo)

    def hopeful(self, tokens: int, base: int) -> float | None:
        """The cost of `tokens` at its most hopeful: the estimate, or if lower what a call of `base` tokens
        plus PRIOR_SLOPE of a one-token call per token more would take. Planning with it now and then
        measures again a count whose old figure was a slow spell's."""
        est, at_base, one = self(tokens), self(base), self(1)
        if est is None or at_base is None or one is None:
            return est
        return min(est, at_base + PRIOR_SLOPE * one * max(0, tokens - base))

    def snapshot(self) -> dict[int, float]:
        return dict(self._avg)


_TABLES: weakref.WeakKeyDictionary[Any, CostTable] = weakref.WeakKeyDictionary()


def costs_of(engine: Any) -> CostTable:
    """The cost table of an engine (one per engine, shared by every loop that drives it)."""
    table = _TABLES.get(engine)
    if table is None:
        table = _TABLES[engine] = CostTable()
    return table


class Acceptance:
    """How often a sequence's drafted tokens have been accepted lately: accepted tokens and rejections,
    each decayed by DECAY per observation, on top of a prior worth two observations' tokens. The rate is
    the chance that the next drafted token is accepted given the ones before it were."""

    __slots__ = ("accepted", "rejected", "prior", "decay")

    def __init__(self, prior: float, decay: float = DECAY) -> None:
        self.prior = prior
        self.decay = decay
        self.accepted = 2 * prior
        self.rejected = 2 * (1 - prior)

    def observe(self, accepted: int, rejected: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + rejected

    def idle(self) -> None:
        """A step without drafting: the estimate drifts back towards the prior (so drafting is tried again)."""
        total = self.accepted + self.rejected
        self.accepted += (1 - IDLE_DECAY) * (total * self.prior - self.accepted)
        self.rejected += (1 - IDLE_DECAY) * (total * (1 - self.prior) - self.rejected)

    @property
    def rate(self) -> float:
        total = self.accepted + self.rejected
        return self.accepted / total if total > 0 else self.prior


def choose(cost: Callable[[int], float | None], base: int, rates: Sequence[float], caps: Sequence[int],
           draft_cost: Callable[[Sequence[int]], float] | None = None) -> list[int]:
    """How many tokens to draft for each sequence of a step that feeds `base` tokens without drafts.

    rates[i]: sequence i's acceptance; caps[i]: the most it may draft; cost(T): seconds of a T-token call;
    draft_cost(k): seconds the drafting of lengths k takes (None: free, as prompt lookup nearly is)."""
    n = len(rates)
    out = [0] * n
    c0 = cost(base)
    if c0 is None or base < 1 or not any(caps):
        return out
    plain = base / c0
    heap = [(-r, i, 1) for i, (r, c) in enumerate(zip(rates, caps, strict=True)) if c > 0 and r > 0]
    heapq.heapify(heap)
    k = [0] * n
    gained = 0.0
    best, best_k = plain * (1 + MARGIN), None
    total = 0
    while heap and total < MAX_STEP_DRAFTS:
        g, i, j = heapq.heappop(heap)
        gained -= g
        k[i] = j
        total += 1
        if j < caps[i]:
            heapq.heappush(heap, (g * rates[i], i, j + 1))
        c = cost(base + total)
        if c is None:
            break
        if draft_cost is not None:
            c += draft_cost(k)
        rate = (base + gained) / c
        if rate > best:
            best, best_k = rate, list(k)
    return out if best_k is None else best_k
