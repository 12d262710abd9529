"""Lossless speculative decoding: guessed tokens checked by the model in one pass, the output unchanged.

Decode is bound by memory bandwidth: every token reads every weight once. Feeding a token and k guessed
tokens after it reads the weights once too and gives the logits after each of them, so every guess the
model agrees with is a token past that limit. Where the guesses come from (a drafter):

- prompt lookup (`lookup.py`): what followed an earlier occurrence of the sequence's last tokens, in the
  prompt or the text so far; no second model;
- a draft model (`draft_model.py`): a smaller model with the same vocabulary, drafting greedily in its own
  KV slots.

When to draft, and how far, is decided per step and per sequence from the measured cost of the engine's
calls and each sequence's recent acceptance (`control.py`).

The token loop is the scheduler's step (generate/scheduler.py), the one the Python API and the server both
run: its Scheduler holds a `Speculation` (speculation.py, from the model's `Speculator`; why the output is
plain decoding's is told there) and calls three things: `plan(...)` for the tokens to feed each decoding
sequence (its next token, then its draft), `measured(...)` after the engine call, and `verify(...)` with
each sequence's rows of logits. What a `load(..., draft=...)` asks for (prompt lookup, or a draft model
opened and given an engine) is made by api/drafting.py.
"""

from barellm.generate.speculative.draft_model import DraftModel, check_draft_model, check_vocabulary
from barellm.generate.speculative.lookup import Lookup
from barellm.generate.speculative.speculation import LOOKUP, Speculation, Speculator

__all__ = ["LOOKUP", "DraftModel", "Lookup", "Speculation", "Speculator", "check_draft_model", "check_vocabulary"]
