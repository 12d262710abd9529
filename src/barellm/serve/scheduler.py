"""Continuous batching: one thread owns the engine and advances every live sequence together.

Each KV cache slot holds at most one live sequence. A scheduler step gathers, for every decoding
sequence, its last sampled token, and for prefilling sequences the next chunk of their prompt, and runs
them all through ONE engine call. The engines guarantee that each sequence's logits are bit-identical to
running it alone, and the scheduler feeds every sequence exactly what it would feed it alone (same
chunks, same positions, same sampler history), so a greedy request's output does not depend on what else
is being served.

What a sequence does with its logits (sampling, stop strings, limits, the text held back, logprobs) is
its Generation's business (generation.py), the same state machine Model drives. A job asking for n
choices takes n slots: its prompt is prefilled once and its KV entries copied into the other slots.

The asyncio side never touches the engine and the scheduler never waits for the asyncio side: a job's
`emit` is called from this thread and must not block (the app appends to a queue and wakes the event
loop at most once per batch of events). A job that is not streamed gets its text in one event at the end;
a streamed one at most one event per its stream interval, so the event loop, which shares the cores with
the engine's threads, wakes up once per interval rather than once per token.

Slots remember the tokens their cache holds after a sequence ends. A new job goes to the free slot whose
cache saves it the most prefill without throwing away more than it saves, and only the rest is prefilled.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from barellm.generation import (
    Delta,
    Generation,
    SlotTable,
    Timings,
    TokenLogprob,
    common_prefix,
    pooled,
    time_engine,
)
from barellm.sampling import SamplingParams
from barellm.serve.metrics import Metrics
from barellm.structured import spare_core

__all__ = ["DEFAULT_PREFILL_CHUNK", "EmbedJob", "Event", "Job", "QueueFull", "Scheduler", "TokenLogprob",
           "common_prefix"]

DEFAULT_PREFILL_CHUNK = 256


class QueueFull(Exception):
    """The waiting queue holds --queue jobs already."""


@dataclass
class Event:
    """What the scheduler tells a job's owner. kind is one of:

    "start"  the job has its slot(s): cached_tokens, prompt_tokens
    "delta"  new text (may be "") of choice `index` and the tokens that produced it (logprobs when asked)
    "done"   choice `index` ended: finish_reason ("stop" or "length"), usage counts of that choice, and
             stop_type: "eos" (the text ended: an end token, or a line indented less than min_indent,
             which ends a fill), "word" (stop_word, a stop string) or "limit" (max_tokens, the context, the
             time limit: finish_reason "length")
    "error"  status, message, error_type (the job ended without completing)
    "embeddings"  an EmbedJob's result: data, float32 [inputs, dim]; prompt_tokens
    """

    kind: str
    text: str = ""
    tokens: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    status: int = 0
    message: str = ""
    error_type: str = ""
    index: int = 0
    stop_type: str = ""
    stop_word: str | None = None
    data: Any = None


@dataclass(eq=False)
class Job:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    emit: Callable[[Event], None]       # called from the scheduler thread; must not block
    stops: list[str] = field(default_factory=list)
    top_logprobs: int | None = None     # None: no logprobs; k >= 0: the chosen token's and k alternatives
    timeout: float | None = None        # seconds from submission
    cache_prompt: bool = True           # False: prefill the whole prompt, reusing no cached prefix
    n: int = 1                          # choices, each in its own slot, sharing the prompt's KV entries
    stream: bool = True                 # False: one "delta" per choice, just before its "done"
    stream_interval: float = 0.0        # streamed deltas are gathered and sent at most once per this many seconds
    grammar: Any = None                 # a structured.Grammar every choice's output follows (None: free)
    min_indent: int = 0                 # a new line indented less ends the text (infill)
    draft: bool = True                  # speculative decoding, when the scheduler drafts (False: off for this job)
    submitted: float = 0.0
    cancelled: bool = False
    done: bool = False
    live: int = 0                       # choices still generating

    @property
    def deadline(self) -> float | None:
        return None if self.timeout is None else self.submitted + self.timeout


@dataclass(eq=False)
class EmbedJob:
    """Embeddings of inputs (token-id lists), in one slot, one input after another; each step feeds at most
    a prefill chunk of tokens beside the decoding sequences, so a long batch of texts does not stall them."""

    inputs: list[list[int]]
    emit: Callable[[Event], None]
    pooling: str = "mean"
    normalize: bool = True
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

    def __init__(self, job: EmbedJob, slot: int, dim: int) -> None:
        self.job = job
        self.slot = slot
        self.index = 0
        self.fed = 0
        self.rows: np.ndarray | None = None
        self.out = np.empty((len(job.inputs), dim), np.float32)


class _Live:
    """A job's choice bound to a slot: its prompt progress and its Generation."""

    __slots__ = ("job", "index", "slot", "gen", "seq_no", "fed", "cached", "leader", "followers", "acc", "started",
                 "pending", "sent_at")

    def __init__(self, job: Job, index: int, slot: int, gen: Generation, reuse: int, seq_no: int) -> None:
        self.job = job
        self.index = index
        self.slot = slot
        self.gen = gen
        self.seq_no = seq_no              # admission order: prefill is served first come, first served
        self.fed = reuse                  # prompt tokens whose KV entries the slot holds
        self.cached = reuse
        self.leader: _Live | None = None  # another choice whose prefilled prompt this one copies
        self.followers: list[_Live] = []
        self.acc: Delta | None = None if job.stream else Delta()   # a whole response's text so far
        self.started = False
        self.pending: Delta | None = None   # streamed text waiting for its stream interval
        self.sent_at = -1e300

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.job.prompt)


class Scheduler:
    """Owns the model's engine from its own thread; thread-safe submit() and cancel()."""

    def __init__(self, engine: Any, tokenizer: Any, *, n_ctx: int, n_slots: int | None = None,
                 max_queue: int = 64, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 metrics: Metrics | None = None, clock: Callable[[], float] = time.monotonic,
                 speculator: Any = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.n_slots = n_slots if n_slots is not None else engine.n_slots
        if not 1 <= self.n_slots <= engine.n_slots:
            raise ValueError(f"n_slots must be in 1..{engine.n_slots}")
        self.max_queue = max_queue
        self.prefill_chunk = max(1, prefill_chunk)
        self.metrics = metrics or Metrics(self.n_slots)
        self.clock = clock
        self.eog = frozenset(tokenizer.eog_ids)
        self.n_vocab: int | None = getattr(engine, "n_vocab", None)
        self.timings = Timings()                     # the token loop's phases, read by /metrics
        self.metrics.timings = self.timings
        self._table = SlotTable(self.n_slots, clock)
        self._live: dict[int, _Live] = {}            # slot -> live sequence; scheduler thread only
        self._embeds: dict[int, _Embedding] = {}     # slot -> embedding job, in admission order
        self._hidden = getattr(engine, "hidden_batch", None)
        self._mask_thread = spare_core(getattr(engine, "threads", 1))   # grammar masks beside the forward pass
        self._dim = getattr(getattr(engine, "cfg", None), "dim", 0)
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._seq_no = 0
        self._thread: threading.Thread | None = None
        self._untime: Callable[[], None] | None = None
        self._forward_one = getattr(engine, "forward", None)
        self._copy = getattr(engine, "copy_prefix", None)
        # speculative decoding (barellm.speculative): drafts checked in the step's one engine call
        self._spec = speculator.session() if speculator is not None else None

    @property
    def slot_tokens(self) -> list[list[int]]:
        """What each slot's KV cache holds, in order (valid entries only). Read by tests and /health."""
        return self._table.tokens

    # --- any thread ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._untime = time_engine(self.engine, self.timings)
            self._thread = threading.Thread(target=self._run, name="barellm-scheduler", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the thread after its current step; every unfinished job gets an error event."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._untime is not None:
            self._untime()
            self._untime = None

    def submit(self, job: Job | EmbedJob) -> None:
        if not 1 <= job.n <= self.n_slots:
            raise ValueError(f"n must be in 1..{self.n_slots} (one slot per choice)")
        job.submitted = self.clock()
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            # The bound counts jobs not yet holding a slot; a job that would get a slot at once also
            # waits here for a moment, so a full queue with free slots still admits.
            free = self.n_slots - self.slots_in_use
            if len(self._waiting) >= self.max_queue + max(free, 0):
                raise QueueFull(f"{len(self._waiting)} requests are waiting already")
            self._waiting.append(job)
            self._update_occupancy()
            self._cond.notify_all()

    def cancel(self, job: Job | EmbedJob) -> None:
        """Ends a job (its client went away): dropped from the queue now, its slots freed before the
        next step. Safe to call more than once and after the job finished."""
        with self._cond:
            if job.done or job.cancelled:
                return
            job.cancelled = True
            try:
                self._waiting.remove(job)
                job.done = True
                self.metrics.finish("cancelled")
            except ValueError:
                pass
            self._update_occupancy()
            self._cond.notify_all()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def slots_in_use(self) -> int:
        return len(self._live) + len(self._embeds)

    def _update_occupancy(self) -> None:
        self.metrics.occupancy(len(self._waiting), self.slots_in_use)

    # --- the scheduler thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            # the lock only when there is something to admit or nothing to do (a job appended meanwhile is
            # seen on the next round)
            if self._waiting or not (self._live or self._embeds) or self._stopping:
                with self._cond:
                    while not self._stopping and not self._waiting and not self._live and not self._embeds:
                        self._cond.wait()
                    if self._stopping:
                        break
                    if self._waiting:
                        self._expire_waiting()
                        self._admit()
                    self._update_occupancy()
            self._reap()
            try:
                self._step()
            except Exception as e:  # a bug or an engine failure: fail what was live, keep serving
                for s in list(self._live.values()):
                    self._table.forget(s.slot)   # what the cache holds is unknown now
                    self._fail(s, 500, f"generation failed: {type(e).__name__}: {e}", "server_error")
            try:
                if self._embeds:
                    self._embed_step()
            except Exception as e:  # noqa: BLE001 - as above, for the embedding jobs
                for em in list(self._embeds.values()):
                    self._end_embedding(em, Event("error", status=500, message=f"embedding failed: "
                                                  f"{type(e).__name__}: {e}", error_type="server_error"))
            if self.slots_in_use != self.metrics.slots_in_use:
                with self._cond:
                    self._update_occupancy()
        with self._cond:
            for s in list(self._live.values()):
                self._fail(s, 503, "the server is shutting down", "server_error")
            for em in list(self._embeds.values()):
                self._end_embedding(em, Event("error", status=503, message="the server is shutting down",
                                              error_type="server_error"))
            while self._waiting:
                job = self._waiting.popleft()
                job.done = True
                self._emit(job, Event("error", status=503, message="the server is shutting down",
                                      error_type="server_error"))
            self._update_occupancy()

    def _emit(self, job: Job, ev: Event) -> None:
        try:
            job.emit(ev)
        except Exception:
            job.cancelled = True   # the receiving side is gone (its loop closed)

    def _expire_waiting(self) -> None:
        now = self.clock()
        if not any(j.deadline is not None and now >= j.deadline for j in self._waiting):
            return
        keep: deque[Job] = deque()
        for job in self._waiting:
            if job.deadline is not None and now >= job.deadline:
                job.done = True
                self.metrics.finish("timeout")
                self._emit(job, Event("error", status=503, error_type="timeout_error",
                                      message=f"the request waited longer than its time limit of {job.timeout:g} s "
                                              "for a free slot; the server is busy, try again later"))
            else:
                keep.append(job)
        self._waiting = keep

    def _admit(self) -> None:
        """Gives waiting jobs free slots, first come first served; each choice takes the free slot whose
        cache serves it best (SlotTable.score). A job needing more slots than are free waits at the head."""
        table = self._table
        while self._waiting:
            job = self._waiting[0]
            if len(table.free()) < job.n:
                return
            self._waiting.popleft()
            if isinstance(job, EmbedJob):
                slot = table.choose([], False)
                assert slot is not None
                table.take(slot, [], False)
                table.forget(slot)
                self._embeds[slot] = _Embedding(job, slot, self._dim)
                n = sum(len(x) for x in job.inputs)
                self.metrics.admitted(n, 0)
                self._emit(job, Event("start", prompt_tokens=n))
                continue
            try:
                gens = [Generation(job.prompt, self.tokenizer, params=_choice_params(job.params, i),
                                   max_tokens=job.max_tokens, n_ctx=self.n_ctx, stops=job.stops,
                                   top_logprobs=job.top_logprobs, eog=self.eog, n_vocab=self.n_vocab,
                                   timings=self.timings,
                                   guide=job.grammar.guide(self._mask_thread) if job.grammar is not None else None,
                                   min_indent=job.min_indent)
                    for i in range(job.n)]
            except Exception as e:   # parameters are validated before submit(); this is a last guard
                job.done = True
                self._emit(job, Event("error", status=400, message=str(e), error_type="invalid_request_error"))
                continue
            self._seq_no += 1
            lives = []
            for i, gen in enumerate(gens):
                slot = table.choose(job.prompt, job.cache_prompt)
                assert slot is not None
                copies = i > 0 and self._copy is not None
                reuse = table.take(slot, job.prompt, job.cache_prompt and not copies)
                s = _Live(job, i, slot, gen, reuse, self._seq_no)
                if copies:
                    s.leader = lives[0]
                    lives[0].followers.append(s)
                self._live[slot] = s
                lives.append(s)
            job.live = job.n
            self.metrics.admitted(len(job.prompt), lives[0].cached)
            self._emit(job, Event("start", prompt_tokens=len(job.prompt), cached_tokens=lives[0].cached))

    def _reap(self) -> None:
        """Frees the slots of cancelled jobs and ends those past their time limit."""
        now = self.clock()
        for em in list(self._embeds.values()):
            job = em.job
            if job.cancelled:
                self._end_embedding(em, None)
            elif job.deadline is not None and now >= job.deadline:
                self._end_embedding(em, Event("error", status=503, error_type="timeout_error",
                                              message=f"the embeddings took longer than the time limit of "
                                                      f"{job.timeout:g} s"))
        if not any(s.job.cancelled or (s.job.deadline is not None and now >= s.job.deadline)
                   for s in self._live.values()):
            return
        for s in list(self._live.values()):
            if s.job.cancelled:
                self._release(s, "cancelled")
            elif s.job.deadline is not None and now >= s.job.deadline and s.slot in self._live:
                self._deliver(s, s.gen.finish("length"))
                self._end(s)

    def _step(self) -> None:
        clock = time.perf_counter
        t_start = clock()
        parts: list[_Live] = [s for s in self._live.values() if s.gen.next_token is not None]
        # Prompt chunks always start where the sequence's prefill stands and are prefill_chunk long
        # (the last one shorter), whatever else runs: the budget only decides which chunks join this
        # step, never how a prompt is cut, so a sequence sees the same forward calls under any load.
        budget = self.prefill_chunk
        prefills = sorted((s for s in self._live.values() if s.prefilling and s.leader is None),
                          key=lambda s: s.seq_no)
        chunks: dict[int, int] = {}
        for s in prefills:
            n = min(self.prefill_chunk, len(s.job.prompt) - s.fed)
            if chunks and n > budget:
                break
            chunks[s.slot] = n
            budget -= n
        feeds = ([(s.gen.next_token,) for s in parts] if self._spec is None else
                 self._spec.plan([(s.slot, s.gen, s.job.draft) for s in parts], sum(chunks.values())))
        batch: list[tuple[int, Any, int]] = [(s.slot, f, s.gen.position) for s, f in zip(parts, feeds, strict=True)]
        for s in prefills:
            if s.slot in chunks:
                batch.append((s.slot, s.job.prompt[s.fed:s.fed + chunks[s.slot]], s.fed))
                parts.append(s)
        if not batch:
            return
        t0 = clock()
        tails = [len(f) for f in feeds] + [1] * (len(batch) - len(feeds))
        if len(batch) == 1 and self._forward_one is not None and tails[0] == 1:
            slot, tokens, start = batch[0]
            logits = self._forward_one(tokens, start, slot=slot)
        elif max(tails) == 1:
            logits = self.engine.forward_batch(batch)
        else:   # drafted tokens: the logits of every fed token of those sequences, to check the drafts against
            out = self.engine.forward_batch(batch, tails)
            ends = np.cumsum(tails).tolist()
            logits = [out[e - 1] if t == 1 else out[e - t:e] for e, t in zip(ends, tails, strict=True)]
        t1 = clock()
        self.timings.engine += t1 - t0
        if self._spec is not None:
            self._spec.measured(sum(len(t) for _, t, _ in batch), t1 - t0)
        tokens0 = self.timings.tokens
        table = self._table.tokens
        for i, s in enumerate(parts):
            if s.slot in chunks:
                n = chunks[s.slot]
                table[s.slot].extend(s.job.prompt[s.fed:s.fed + n])
                s.fed += n
                if s.prefilling:
                    continue
                for f in s.followers:   # the other choices start from a copy of the prompt's cache
                    self._copy(s.slot, f.slot, len(s.job.prompt))
                    table[f.slot][:] = s.job.prompt
                    f.fed = len(s.job.prompt)
            else:
                table[s.slot].append(s.gen.next_token)
            if s.job.cancelled:
                self._release(s, "cancelled")
                continue
            row = logits[i]
            self._advance(s, row)
            for f in s.followers:
                if f.slot in self._live and not f.started:
                    self._advance(f, row)
            s.followers = []
        generated = self.timings.tokens - tokens0
        self.timings.wall += clock() - t_start
        self.metrics.step(t1 - t0, len(parts), generated)

    def _embed_step(self) -> None:
        """Feeds the oldest embedding job's current input on by at most a prefill chunk; finishes an input
        (pools its rows) or the job (emits every vector) when it is all in."""
        em = next(iter(self._embeds.values()))
        job = em.job
        ids = job.inputs[em.index]
        n = min(self.prefill_chunk, len(ids) - em.fed)
        last = em.fed + n == len(ids)
        t0 = time.perf_counter()
        assert self._hidden is not None
        rows = self._hidden([(em.slot, ids[em.fed:em.fed + n], em.fed)], last_only=job.pooling == "last")
        self.metrics.step(time.perf_counter() - t0, 1, 0)
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
            self._end_embedding(em, Event("embeddings", data=em.out,
                                          prompt_tokens=sum(len(x) for x in job.inputs)))

    def _end_embedding(self, em: _Embedding, ev: Event | None) -> None:
        if self._embeds.get(em.slot) is em:
            del self._embeds[em.slot]
            self._table.forget(em.slot)
            self._table.release(em.slot)
        job = em.job
        if not job.done:
            job.done = True
            self.metrics.finish("stop" if ev is not None and ev.kind == "embeddings" else
                                "cancelled" if ev is None else "error")
            if ev is not None:
                self._emit(job, ev)

    def _advance(self, s: _Live, row: np.ndarray) -> None:
        """Hands s the logits that follow its last fed token; delivers what became visible."""
        if not s.started:
            s.started = True
            if s.index == 0:
                self.metrics.first_token(self.clock() - s.job.submitted)
        for d in (self._spec.verify(s.slot, s.gen, row, self._table.tokens[s.slot]) if self._spec is not None
                  else (s.gen.step(row),)):
            if d is not None:
                self._deliver(s, d)
        if s.gen.done:
            self._end(s)

    def _deliver(self, s: _Live, d: Delta) -> None:
        if s.acc is not None:   # a whole response: gathered until the end
            _merge(s.acc, d)
            return
        if not (d.text or d.token_ids):
            return
        interval = s.job.stream_interval
        if interval > 0:   # at most one event per interval: fewer wake-ups of the event loop per token
            if s.pending is not None:
                d = _merge(s.pending, d)
            now = self.clock()
            if now - s.sent_at < interval:
                s.pending = d
                return
            s.pending, s.sent_at = None, now
        self._emit(s.job, Event("delta", text=d.text, tokens=d.logprobs, token_ids=d.token_ids, index=s.index))

    def _end(self, s: _Live) -> None:
        job = s.job
        rest = s.acc if s.acc is not None else s.pending
        if rest is not None and (rest.text or rest.token_ids):
            self._emit(job, Event("delta", text=rest.text, tokens=rest.logprobs, token_ids=rest.token_ids,
                                  index=s.index))
        reason = s.gen.finish_reason or "length"
        self._remove(s)
        self.metrics.finish(reason)
        job.live -= 1
        if job.live <= 0:
            job.done = True
        gen = s.gen
        # a dedent ends a fill where its block ends: the text's own end, as "stop" says, not a limit
        stop_type = "word" if gen.stop_word else "limit" if reason != "stop" else "eos"
        self._emit(job, Event("done", finish_reason=reason, prompt_tokens=len(job.prompt), cached_tokens=s.cached,
                              completion_tokens=len(gen.generated), index=s.index, stop_type=stop_type,
                              stop_word=gen.stop_word))

    def _release(self, s: _Live, reason: str) -> None:
        s.job.done = True
        self._remove(s)
        self.metrics.finish(reason)

    def _fail(self, s: _Live, status: int, message: str, error_type: str) -> None:
        job = s.job
        self._remove(s)
        self.metrics.finish("error")
        if not job.done:
            job.done = True
            self._emit(job, Event("error", status=status, message=message, error_type=error_type))

    def _remove(self, s: _Live) -> None:
        if self._live.get(s.slot) is s:
            del self._live[s.slot]
            self._table.release(s.slot)
        for f in s.followers:   # a leader gone before its prompt was in: the copies have nothing to copy
            if f.slot in self._live and f.prefilling:
                f.leader = None
        s.followers = []


def _merge(into: Delta, d: Delta) -> Delta:
    into.text += d.text
    into.token_ids.extend(d.token_ids)
    into.logprobs.extend(d.logprobs)
    return into


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i draws with seed + i, so choice 0 is what n=1 gives (as Model does)."""
    if index == 0 or params.seed is None:
        return params
    return SamplingParams(**{**params.__dict__, "seed": params.seed + index})
