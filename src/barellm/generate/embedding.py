"""Embedding and scoring jobs of the scheduler: a job's inputs fed through one slot, a prefill chunk at a time
beside the generations (so a long batch of texts does not stall them), each input's final hidden states
pooled into its embedding (pooled), or, for a scoring job, the logits at every position kept.

`Embeddings` holds them for the Scheduler (generate/scheduler.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from barellm.generate.request import Event
from barellm.generate.slots import SlotTable


def pooled(rows: np.ndarray, pooling: str, normalize: bool = True) -> np.ndarray:
    """One input's embedding from its final hidden states rows [n, dim] (all of them for "mean", its last
    for "last"): the mean (accumulated in float64) or the last row, L2-normalised unless told not to.
    The scheduler makes every embedding here, so the same rows give the same bits."""
    v = rows.mean(axis=0, dtype=np.float64) if pooling == "mean" else rows[-1].astype(np.float64)
    if normalize:
        v = v / max(float(np.sqrt(np.dot(v, v))), 1e-12)
    return v.astype(np.float32)


@dataclass(eq=False)
class EmbedJob:
    """Embeddings of inputs (token-id lists), in one slot, one input after another; each step feeds at most
    a prefill chunk of tokens beside the decoding sequences, so a long batch of texts does not stall them."""

    inputs: list[list[int]]
    emit: Callable[[Event], None]
    pooling: str = "mean"
    normalize: bool = True
    logits: bool = False        # score one input instead: its logits at every position, [len, n_vocab]
    timeout: float | None = None
    n: int = 1
    submitted: float = 0.0
    cancelled: bool = False
    done: bool = False

    @property
    def deadline(self) -> float | None:
        return None if self.timeout is None else self.submitted + self.timeout

class _Embedding:
    """An EmbedJob bound to a slot: which input it is on, how far, the rows so far."""

    def __init__(self, job: EmbedJob, slot: int, dim: int, n_vocab: int) -> None:
        self.job = job
        self.slot = slot
        self.index = 0
        self.fed = 0
        self.rows: np.ndarray | None = None
        shape = (len(job.inputs[0]), n_vocab) if job.logits else (len(job.inputs), dim)
        self.out = np.empty(shape, np.float32)


class Embeddings:
    """The scheduler's embedding and scoring jobs, by the slot each runs in (in admission order), and their
    steps. The Scheduler owns one: it picks their slots in its table and calls `step` in its rounds, handing
    over its current prefill chunk and counters; events go out through its `emit`."""

    def __init__(self, engine: Any, table: SlotTable, emit: Callable[[Any, Event], None]) -> None:
        self.engine = engine
        self.jobs: dict[int, _Embedding] = {}
        self._table = table
        self._emit = emit
        self._hidden = getattr(engine, "hidden_batch", None)
        self._dim = getattr(getattr(engine, "cfg", None), "dim", 0)
        self._n_vocab = getattr(engine, "n_vocab", None) or 0

    def add(self, job: EmbedJob, slot: int) -> None:
        """Runs job in slot (taken in the table, its cache forgotten) from the next step on."""
        self.jobs[slot] = _Embedding(job, slot, self._dim, self._n_vocab)

    def step(self, prefill_chunk: int, metrics: Any) -> None:
        """Feeds the oldest job's current input on by at most prefill_chunk tokens; finishes an input (pools
        its rows) or the job (emits every vector) when it is all in."""
        em = next(iter(self.jobs.values()))
        job = em.job
        ids = job.inputs[em.index]
        n = min(prefill_chunk, len(ids) - em.fed)
        last = em.fed + n == len(ids)
        t0 = time.perf_counter()
        if job.logits:   # a scoring job: every position's logits, the slot's cache kept as its prompt's
            em.out[em.fed:em.fed + n] = self.engine.forward(ids[em.fed:em.fed + n], em.fed, True, slot=em.slot)
            self._table.tokens[em.slot].extend(ids[em.fed:em.fed + n])
            rows = em.out
        else:
            assert self._hidden is not None
            rows = self._hidden([(em.slot, ids[em.fed:em.fed + n], em.fed)], last_only=job.pooling == "last")
        metrics.step(time.perf_counter() - t0, 1, 0)
        if job.logits:
            em.fed += n
            if last:
                self.end(em, Event("embeddings", data=em.out, prompt_tokens=len(ids)), metrics)
            return
        if job.pooling == "mean":
            if em.rows is None:
                em.rows = np.empty((len(ids), self._dim), np.float32)
            em.rows[em.fed:em.fed + n] = rows
        em.fed += n
        if not last:
            return
        em.out[em.index] = pooled(em.rows if job.pooling == "mean" else rows, job.pooling, job.normalize)
        em.index, em.fed, em.rows = em.index + 1, 0, None
        if em.index == len(job.inputs):
            self.end(em, Event("embeddings", data=em.out, prompt_tokens=sum(len(x) for x in job.inputs)), metrics)

    def end(self, em: _Embedding, ev: Event | None, metrics: Any) -> None:
        """Ends a job with ev (None: cancelled, nothing to say), its slot released."""
        if self.jobs.get(em.slot) is em:
            del self.jobs[em.slot]
            if not (em.job.logits and ev is not None and ev.kind == "embeddings"):
                self._table.forget(em.slot)   # what it holds serves no prompt
            self._table.release(em.slot)
        job = em.job
        if not job.done:
            job.done = True
            metrics.finish("stop" if ev is not None and ev.kind == "embeddings" else
                                "cancelled" if ev is None else "error")
            if ev is not None:
                self._emit(job, ev)
