"""A draft model: a smaller model with the target's vocabulary drafts greedily, in KV slots of its own.

Each target slot has a draft slot of the same index. What a draft slot holds is recorded here (`held`),
and it is only ever written here, so the record is exact: before drafting for a sequence, the tokens it
gained since (the accepted drafts, the target's own token) are fed from where the record and the sequence
part, in one call with the first draft position; each further drafted token is one more call, batched
over every sequence that drafts that far. Rejected drafts are overwritten by the next call, as the
target's are. A long catch-up (a new prompt, or drafting resumed after a long pause) is fed a chunk per
step, so that no step stalls on it; the sequence drafts once it has caught up.

A model whose vocabulary differs from the target's cannot draft for it (the target would be checking
token ids that mean something else): `check_vocabulary` refuses it, naming the first difference.

Opening the draft model's file and making its engine is the Python API's part (api/drafting.py), as it is
for the target: this layer drafts with what it is given.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from barellm.errors import InvalidRequest
from barellm.generate.slots import common_prefix
from barellm.generate.speculative.control import CostTable

CATCH_UP_CHUNK = 256   # tokens of a lagging draft slot fed per step at most
CONFIDENCE = 0.5       # a draft ends before a token the draft model itself gives less than this probability


def check_vocabulary(target: Any, draft: Any, target_name: str, draft_name: str) -> None:
    """Refuses a draft model whose tokenizer is not the target's, token for token."""
    why = None
    if target.vocab_size != draft.vocab_size:
        why = f"{draft_name} has {draft.vocab_size} tokens, {target_name} {target.vocab_size}"
    else:
        for i in range(target.vocab_size):
            a, b = target.token_text(i), draft.token_text(i)
            if a != b:
                why = f"token {i} is {b!r} in {draft_name} and {a!r} in {target_name}"
                break
    if why is None and (target.eos_id != draft.eos_id or target.bos_id != draft.bos_id):
        why = f"their special tokens differ (eos {draft.eos_id} against {target.eos_id})"
    if why is not None:
        raise InvalidRequest(f"{draft_name} cannot draft for {target_name}: their vocabularies differ ({why}); a "
                             "draft model must share the target's tokenizer (e.g. a smaller model of the same family)")


def check_draft_model(target: Any, name: str, config: Any, tokenizer: Any) -> None:
    """Refuses a draft model (its name, ModelConfig and Tokenizer) that cannot draft for target (a Model):
    another vocabulary, or another number of logits."""
    check_vocabulary(target.tokenizer, tokenizer, target.name, name)
    if config.n_vocab != target.config.n_vocab:
        raise InvalidRequest(f"{name} cannot draft for {target.name}: its output has {config.n_vocab} rows, "
                             f"the target's {target.config.n_vocab}")


class DraftModel:
    """A draft model's engine and what each of its slots holds. Thread-safe: one call at a time."""

    def __init__(self, name: str, source: Any, engine: Any, target: Any) -> None:
        """name: what messages call it; source: its opened model file; engine: its native engine, with as
        many slots as the target's (target: the Model it drafts for)."""
        self.name = name
        self.source = source
        self.engine = engine
        self.config = engine.cfg
        self.n_ctx = engine.n_ctx
        self.held: list[list[int]] = [[] for _ in range(target.slots)]
        # per slot: the sequence list last drafted for and how far it agreed with the slot then; a sequence
        # only grows, so the agreement is looked for from there on (not over the whole context every step)
        self._agreed: list[tuple[Any, Any, int]] = [(None, None, 0)] * target.slots
        self.costs = CostTable()
        # the bytes a decoded token reads, against the target's: what a draft call costs before it is measured
        self.weight_ratio = (_weight_bytes(source, engine.n_logits / engine.n_vocab)
                             / max(1, _weight_bytes(target.source)))
        self._lock = threading.Lock()

    def lag(self, slot: int, tokens: Sequence[int]) -> int:
        """Tokens of `tokens` the slot does not hold yet (to be fed before it can draft what follows)."""
        return len(tokens) - self._agreement(slot, tokens)

    def _agreement(self, slot: int, tokens: Sequence[int]) -> int:
        """How many first tokens of `tokens` the slot holds."""
        held = self.held[slot]
        was_held, seq, known = self._agreed[slot]
        start = min(known, len(held), len(tokens)) if seq is tokens and was_held is held else 0
        n = start + common_prefix(held[start:], tokens[start:])
        self._agreed[slot] = (held, tokens, n)
        return n

    def draft(self, wants: Sequence[tuple[int, Sequence[int], int]]) -> list[list[int]]:
        """Greedy drafts of wants[i] = (slot, the sequence so far, k) tokens each: the most likely next
        tokens by the draft model, one after another, up to k, ending early before a token the draft model is
        unsure of (llama.cpp's --draft-p-min): such a guess is more likely wrong than worth checking. A slot
        that lags more than a chunk behind only catches up this time (its draft is empty)."""
        out: list[list[int]] = [[] for _ in wants]
        with self._lock:
            first: list[tuple[int, list[int], int]] = []
            which: list[int] = []
            for i, (slot, tokens, k) in enumerate(wants):
                held = self.held[slot]
                keep = self._agreement(slot, tokens)
                del held[keep:]
                feed = list(tokens[keep:keep + CATCH_UP_CHUNK])
                if not feed:   # the slot holds the whole sequence: the last token's logits are needed again
                    keep -= 1
                    del held[keep:]
                    feed = [tokens[keep]]
                if keep + len(feed) + max(k, 1) > self.n_ctx:
                    continue
                first.append((slot, feed, keep))
                which.append(i)
            if not first:
                return out
            rows = self._run(first)
            going: list[tuple[int, int, int]] = []   # (want index, slot, next position)
            for j, (i, (slot, feed, start)) in enumerate(zip(which, first, strict=True)):
                self.held[slot].extend(feed)
                k = wants[i][2]
                if start + len(feed) == len(wants[i][1]) and k > 0:
                    tok = _confident(rows[j])
                    if tok is not None:
                        out[i].append(tok)
                        if k > 1:
                            going.append((i, slot, start + len(feed)))
            while going:
                rows = self._run([(slot, [out[i][-1]], pos) for i, slot, pos in going])
                nxt = []
                for j, (i, slot, pos) in enumerate(going):
                    self.held[slot].append(out[i][-1])
                    tok = _confident(rows[j])
                    if tok is not None:
                        out[i].append(tok)
                        if len(out[i]) < wants[i][2]:
                            nxt.append((i, slot, pos + 1))
                going = nxt
        return out

    def _run(self, seqs: list[tuple[int, list[int], int]]) -> np.ndarray:
        t0 = time.perf_counter()
        rows = self.engine.forward_batch(seqs)
        self.costs.record(sum(len(t) for _, t, _ in seqs), time.perf_counter() - t0)
        return rows

    def forget(self, slot: int | None = None) -> None:
        for s in range(len(self.held)) if slot is None else (slot,):
            self.held[s] = []
            self._agreed[s] = (None, None, 0)


def _confident(row: np.ndarray) -> int | None:
    """The most likely token of a row of logits, if the model gives it at least CONFIDENCE."""
    top = int(np.argmax(row))
    z = row - row[top]
    return top if 1.0 / float(np.exp(z, dtype=np.float32).sum(dtype=np.float64)) >= CONFIDENCE else None


def _weight_bytes(source: Any, logits: float = 1.0) -> int:
    """Bytes of weights a decoded token reads: the layers, the final norm and the output matrix (the
    embedding table when it is tied; `logits` of its rows); the embedding lookup reads one row."""
    t = source.tensors
    total = sum(int(v.nbytes) for k, v in t.items() if k.startswith("blk.") or k == "output_norm.weight")
    out = t.get("output.weight", t.get("token_embd.weight"))
    return total + (int(out.nbytes * logits) if out is not None else 0) or 1
