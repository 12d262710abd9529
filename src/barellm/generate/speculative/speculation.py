"""The speculation a Model's scheduler runs: `Speculator` (a model's drafter and its engine's cost table) and
`Speculation` (one scheduler's: plan the feeds, take the measured costs, verify the rows).

Why the output is exactly plain decoding's, greedy or sampled. Both drafters are deterministic: a draft d
is a point mass. For a point-mass draft, the standard speculative rule (accept d with probability
min(1, p(d) / q(d)) = p(d); on rejection draw from p with d removed, renormalised) gives every token x the
probability p(x), and it is the same as: draw x from p, accept the draft iff x == d, else keep x and stop.
That is what `Speculation.verify` does, with the generation's own machinery: it hands the logits after the
fed token, then after each drafted one, to Generation.step in order (the sampler chain with its bias,
penalties over the history so far, the allowed mask, a structured Guide's grammar mask, stop strings,
limits), and stops at the first token that differs from the draft or ends the generation. Each step()
draws one uniform number from the generation's seeded generator (sampling.Sampler.sample: one
`rng.random()` per sampled token, none when greedy) and appends the chosen token to the penalties'
history, and step() runs exactly for the tokens that plain decoding would produce, in the same order, on
logits that are bit-identical to plain decoding's (the engines give each row the same bits however many
tokens a call feeds: tests/test_speculative.py checks it on every kernel tier). So the same seed gives the
same tokens, not merely the same distribution; a drafted token the grammar forbids is simply never drawn.
A drafter that proposed tokens at random would need the general rule above, with its own probabilities:
none does.

The KV cache: the drafted tokens are written at the positions after the fed one; attention reads only the
positions before a query's, so the entries of rejected drafts are never read before the next call
overwrites them. What a slot holds (slots.SlotTable, the draft model's record) is cut back to the
accepted tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from barellm.generate.generation import Delta, Generation
from barellm.generate.slots import common_prefix
from barellm.generate.speculative.control import (
    EXPLORE_EVERY,
    LATELY_DECAY,
    Acceptance,
    CostTable,
    choose,
    costs_of,
)
from barellm.generate.speculative.draft_model import DraftModel
from barellm.generate.speculative.lookup import Lookup

__all__ = ["LOOKUP", "MODEL_PRIOR", "Speculation", "Speculator"]

LOOKUP = "lookup"
LOOKUP_MAX = 12          # tokens prompt lookup drafts at most in one step
MODEL_MAX = 8            # tokens a draft model drafts at most in one step
LOOKUP_PRIORS = {1: 0.2, 2: 0.35, 3: 0.5}   # acceptance before any evidence, by match length (3: three or more)
MODEL_PRIOR = 0.7        # a draft model of the same family agrees this often, before any evidence
STEADY_LAG = 2           # tokens a draft slot is behind between two drafts (the rest is a catch-up)


class Speculator:
    """A Model's drafting: its drafter (prompt lookup or a draft model) and its engine's cost table."""

    def __init__(self, engine: Any, draft_model: DraftModel | None = None) -> None:
        self.draft_model = draft_model
        self.kind = "model" if draft_model is not None else LOOKUP
        self.name = draft_model.name if draft_model is not None else LOOKUP
        self.costs: CostTable = costs_of(engine)

    def session(self) -> Speculation:
        """The drafting state of one token loop."""
        return Speculation(self)

    def __repr__(self) -> str:
        return f"Speculator({self.name})"


@dataclass(eq=False)
class _Seq:
    """One decoding sequence's drafting state."""

    gen: Generation
    tokens: list[int]                 # the sequence so far (prompt and generated), as the drafters see it
    lookup: Lookup | None
    acceptance: dict[int, Acceptance]  # by match length (lookup) or one (0) for a draft model
    seen: int = 0                     # generated tokens already in `tokens`
    draft: Sequence[int] = ()         # the tokens drafted in the last plan, fed after the next token
    bucket: int = 0                   # which acceptance the draft counts in
    position: int = 0                 # where the next token went in that plan
    shadow: tuple[list[int], int, int] | None = None   # a lookup draft not fed: (tokens, bucket, matched so far)


class Speculation:
    """The drafting state of one token loop (a Scheduler's live sequences, whichever front end submitted
    them), keyed by slot: one sequence per slot at a time, a new Generation in a slot starts afresh."""

    def __init__(self, owner: Speculator) -> None:
        self.owner = owner
        self.costs = owner.costs
        self.draft_model = owner.draft_model
        self._seqs: dict[int, _Seq] = {}
        self._plans = 0
        # the drafter's acceptance over every sequence, which a new sequence starts from (drifting back to the
        # fixed priors while nothing is drafted): from a fixed 0.7, a 0.5B draft for the 1.5B looked not worth
        # its cost to each new sequence, which drafted nothing for its first ~40 tokens though the sequences
        # before had accepted 95%
        priors = LOOKUP_PRIORS if self.draft_model is None else {0: MODEL_PRIOR}
        self._lately = {b: Acceptance(p, LATELY_DECAY) for b, p in priors.items()}

    # --- the three calls of a token loop -----------------------------------------------------

    def plan(self, entries: Sequence[tuple[int, Generation, bool]], others: int = 0) -> list[list[int]]:
        """The tokens to feed each decoding sequence (slot, generation, whether it may draft) this step: its
        next token, then its draft (possibly none). others: tokens the same engine call feeds besides
        (prompt chunks): such a step drafts nothing, as the batch is compute-bound already."""
        feeds = [[int(g.next_token)] for _, g, _ in entries]  # type: ignore[arg-type]
        states = [self._state(slot, g) if may else None for slot, g, may in entries]
        for st in states:
            if st is not None:
                st.draft = ()
        base = len(entries)
        if others or not any(states) or not self.costs.measured(base):
            for st in states:
                if st is not None and st.lookup is None:
                    self._idle(st)
            return feeds
        self._plans += 1
        rates, caps, proposals = [], [], []
        for st in states:
            cap = 0 if st is None else self._room(st.gen)
            prop: list[int] = []
            rate = 0.0
            if st is not None and cap > 0:
                if st.lookup is not None:
                    prop, run = st.lookup.propose(min(cap, LOOKUP_MAX))
                    st.bucket = min(run, 3)
                    cap = len(prop)
                    rate = st.acceptance[st.bucket].rate if prop else 0.0
                else:
                    cap = min(cap, MODEL_MAX)
                    rate = st.acceptance[0].rate
            rates.append(rate)
            caps.append(cap)
            proposals.append(prop)
        # now and then the costs are taken at their most hopeful, so that a call size measured in a slow spell
        # (or cold: a draft model's first calls fault its weights in) is tried and measured again
        hopeful = self._plans % EXPLORE_EVERY == 0
        cost = (lambda n: self.costs.hopeful(n, base)) if hopeful else self.costs
        draft_cost = (self._draft_cost([slot for slot, _, _ in entries], states, hopeful)
                      if self.draft_model is not None else None)
        ks = choose(cost, base, rates, caps, draft_cost)
        if self.draft_model is not None:
            wants = [(slot, st.tokens, k) for (slot, _, _), st, k in zip(entries, states, ks, strict=True)
                     if st is not None and k > 0]
            drafted = iter(self.draft_model.draft(wants)) if wants else iter(())
            for st, k in zip(states, ks, strict=True):
                if st is not None:
                    if k > 0:
                        st.draft = next(drafted)
                    else:
                        self._idle(st)
        else:
            for st, k, prop in zip(states, ks, proposals, strict=True):
                if st is None:
                    continue
                st.draft = prop[:k]
                if k:
                    st.shadow = None
                elif prop and st.shadow is None:   # not fed, but still scored against what comes
                    st.shadow = (prop, st.bucket, 0)
        for feed, st in zip(feeds, states, strict=True):
            if st is not None and st.draft:
                st.position = st.gen.position
                feed.extend(st.draft)
        return feeds

    def measured(self, tokens: int, seconds: float) -> None:
        """An engine call of `tokens` tokens (drafts included) took `seconds`."""
        self.costs.record(tokens, seconds)

    def verify(self, slot: int, gen: Generation, rows: np.ndarray, held: list[int]) -> list[Delta]:
        """Hands `gen` (in `slot`) the logits after its fed token and after each drafted one (rows, one per fed
        token; a single row when nothing was drafted), in order, until the model's choice differs from the
        draft or the generation ends; returns what became visible. `held`, the slot's record of its cache
        (up to the fed token), gains the drafted tokens accepted: the entries of the others are not valid."""
        st = self._seqs.get(slot)
        if st is not None and st.gen is not gen:
            st = None
        if rows.ndim == 1 or st is None or not st.draft:
            d = gen.step(rows if rows.ndim == 1 else rows[0])
            self._finish(slot, st)
            return [] if d is None else [d]
        draft = st.draft
        st.draft = ()
        n0 = len(gen.generated)
        out = []
        for j in range(len(draft) + 1):
            d = gen.step(rows[j])
            if d is not None:
                out.append(d)
            if gen.done or j == len(draft) or gen.next_token != draft[j]:
                break
        new = gen.generated[n0:]
        accepted = common_prefix(new, draft)
        rejected = 0 if gen.done or accepted == len(draft) else 1
        self._observe(st, st.bucket, accepted, rejected)
        t = gen.timings
        t.drafted += len(draft)
        t.accepted += accepted
        t.verifications += 1
        t.verified += len(new)
        del held[st.position + 1:]
        held.extend(draft[:accepted])
        self._finish(slot, st)
        return out

    # --- state ---------------------------------------------------------------------------------

    def _state(self, slot: int, gen: Generation) -> _Seq:
        st = self._seqs.get(slot)
        if st is None or st.gen is not gen:
            tokens = gen.prompt + gen.generated
            lookup = Lookup(tokens) if self.draft_model is None else None
            st = _Seq(gen, lookup.tokens if lookup is not None else tokens, lookup, self._priors(),
                      len(gen.generated))
            self._seqs[slot] = st
            return st
        new = gen.generated[st.seen:]
        st.seen = len(gen.generated)
        for t in new:
            if st.shadow is not None:
                prop, bucket, matched = st.shadow
                if t == prop[matched]:
                    matched += 1
                    st.shadow = (prop, bucket, matched) if matched < len(prop) else None
                    if matched == len(prop):
                        self._observe(st, bucket, matched, 0)
                else:
                    self._observe(st, bucket, matched, 1)
                    st.shadow = None
            if st.lookup is not None:
                st.lookup.append(t)
            else:
                st.tokens.append(t)
        return st

    def _priors(self) -> dict[int, Acceptance]:
        """A new sequence's acceptance by bucket: what the drafter achieved lately."""
        return {b: Acceptance(a.rate) for b, a in self._lately.items()}

    def _observe(self, st: _Seq, bucket: int, accepted: int, rejected: int) -> None:
        st.acceptance[bucket].observe(accepted, rejected)
        self._lately[bucket].observe(accepted, rejected)

    def _idle(self, st: _Seq) -> None:
        """A draft model's sequence that drafted nothing this step."""
        st.acceptance[0].idle()
        self._lately[0].idle()

    def _finish(self, slot: int, st: _Seq | None) -> None:
        if st is not None and st.gen.done and self._seqs.get(slot) is st:
            del self._seqs[slot]

    @staticmethod
    def _room(gen: Generation) -> int:
        """Tokens the generation may still draft: a step gives at most the draft and one more token, within
        max_tokens and the context."""
        return max(0, min(gen.max_tokens - len(gen.generated) - 1, gen.n_ctx - 1 - gen.position))

    def _draft_cost(self, slots: Sequence[int], states: Sequence[_Seq | None], hopeful: bool) -> Any:
        """Seconds the draft model takes to draft lengths k (one call per drafted position, batched over the
        sequences that draft that far; the first also feeds what each slot lacks, as between two drafts):
        its own calls as measured, else the target's scaled by the weights each reads."""
        dm = self.draft_model
        assert dm is not None
        lags = [0 if st is None else min(dm.lag(slot, st.tokens), STEADY_LAG) or 1
                for slot, st in zip(slots, states, strict=True)]

        def cd(n: int) -> float:
            scaled = (self.costs(n) or 0.0) * dm.weight_ratio
            if dm.costs.measured(n):
                own = dm.costs(n) or 0.0
                return min(own, scaled) if hopeful else own
            return scaled

        def cost(ks: Sequence[int]) -> float:
            top = max(ks, default=0)
            if top == 0:
                return 0.0
            total = cd(sum(lag for lag, k in zip(lags, ks, strict=True) if k > 0))
            for j in range(2, top + 1):
                total += cd(sum(1 for k in ks if k >= j))
            return total

        return cost
