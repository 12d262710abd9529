"""Continuous batching: one thread at a time owns the engine and advances every live sequence together.

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

Who runs the steps: the server starts the scheduler's own thread (start()); the Python API has none, and
each thread waiting for its own request's events runs the rounds itself (run_until()), one thread at a time,
every live sequence advancing in each, as vLLM's offline LLM steps its engine from the caller. A request
whose reader has not taken its last piece (a Python stream between two next() calls) is `paused`: no step
advances it until it is read on.

With a speculator (`load(..., draft=...)`, `serve --draft`) a step feeds a decoding sequence a draft after
its token and checks it against the logits after each fed token (generate/speculative/): the bits plain
decoding gives, so the output and the guarantee above are unchanged.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from barellm.cpu import spare_core
from barellm.generate.embedding import Embeddings, EmbedJob
from barellm.generate.generation import Delta, Generation, TokenLogprob
from barellm.generate.request import Event, Request
from barellm.generate.slots import SlotTable, common_prefix
from barellm.generate.stats import SchedulerStats
from barellm.generate.timings import Timings

__all__ = ["DEFAULT_PREFILL_CHUNK", "UNBOUNDED", "EmbedJob", "Event", "Job", "QueueFull", "Request", "Scheduler",
           "TokenLogprob", "common_prefix"]

DEFAULT_PREFILL_CHUNK = 256
UNBOUNDED = 1 << 62   # a queue with no bound: callers of the Python API wait for a slot, however many


class QueueFull(Exception):
    """The waiting queue holds --queue jobs already."""


Job = Request   # what the scheduler runs is the one request type (generate/request.py)


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
    """Owns the model's engine, run from its own thread (start()) or from the threads waiting for their
    requests (run_until()); thread-safe submit() and cancel()."""

    def __init__(self, engine: Any, tokenizer: Any, *, n_ctx: int, n_slots: int | None = None,
                 max_queue: int = 64, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 metrics: SchedulerStats | None = None, clock: Callable[[], float] = time.monotonic,
                 speculator: Any = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.n_slots = n_slots if n_slots is not None else engine.n_slots
        if not 1 <= self.n_slots <= engine.n_slots:
            raise ValueError(f"n_slots must be in 1..{engine.n_slots}")
        self.max_queue = max_queue
        self.prefill_chunk = max(1, prefill_chunk)
        self.metrics = metrics or SchedulerStats(self.n_slots)
        self.clock = clock
        self.eog = frozenset(tokenizer.eog_ids)
        self.n_vocab: int | None = getattr(engine, "n_vocab", None)
        self.timings = Timings()                     # the token loop's phases, read by /metrics
        self.metrics.timings = self.timings
        self._table = SlotTable(self.n_slots, clock)
        self._live: dict[int, _Live] = {}            # slot -> live sequence; scheduler thread only
        self._embeds = Embeddings(engine, self._table, self._emit)   # the embedding and scoring jobs
        self._mask_thread = spare_core(getattr(engine, "threads", 1))   # grammar masks beside the forward pass
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._seq_no = 0
        self._thread: threading.Thread | None = None
        self._stepping = False                       # a thread is running a round (run_until)
        self._forward_one = self._forward_into if hasattr(engine, "forward") else None
        # each slot's logits land in its own row here when the engine writes into a given array: a decode step
        # allocates nothing
        takes_out = self._forward_one is not None and "out" in inspect.signature(engine.forward).parameters
        self._rows = np.empty((self.n_slots, 1, self.n_vocab), np.float32) if takes_out and self.n_vocab else None
        self._executor = getattr(engine, "executor_seconds", None)   # the native executor's own time so far
        self._copy = getattr(engine, "copy_prefix", None)
        # speculative decoding (generate/speculative/): drafts checked in the step's one engine call
        self.speculator = speculator
        self._spec = speculator.session() if speculator is not None else None

    def configure(self, *, max_queue: int | None = None, prefill_chunk: int | None = None,
                  metrics: SchedulerStats | None = None, speculator: Any = None) -> None:
        """Changes what a server sets (its --queue, its --prefill-chunk, its Metrics, its --draft's
        Speculator) on a scheduler made before it (a Model's), before it runs the scheduler."""
        if max_queue is not None:
            self.max_queue = max_queue
        if prefill_chunk is not None:
            self.prefill_chunk = max(1, prefill_chunk)
        if metrics is not None:
            self.metrics = metrics
            metrics.timings = self.timings
        if speculator is not None:
            self.speculator, self._spec = speculator, speculator.session()

    @property
    def slot_tokens(self) -> list[list[int]]:
        """What each slot's KV cache holds, in order (valid entries only). Read by tests and /health."""
        return self._table.tokens

    # --- any thread ---------------------------------------------------------------------------

    @property
    def threaded(self) -> bool:
        """Whether the scheduler's own thread runs it (start() until stop())."""
        return self._thread is not None

    def start(self) -> None:
        with self._cond:
            while self._stepping:   # a caller's round still under way
                self._cond.wait()
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="barellm-scheduler", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the thread after its current step; every unfinished job gets an error event. The scheduler
        can be started again, or run from callers' threads (run_until)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._cond:
            self._stopping = False

    def run_until(self, ready: Callable[[], bool]) -> None:
        """Runs rounds from the calling thread until ready() is true (checked under the scheduler's lock, after
        every round). Threads waiting on their own requests take turns at the rounds, one at a time, and each
        round advances every live sequence; a thread with nothing to run waits until another's round, a
        submit, a cancel or a wake() may have changed that. Not while the scheduler's own thread runs."""
        cond = self._cond
        while True:
            with cond:
                while not ready():
                    if self._thread is not None:
                        raise RuntimeError("the scheduler's own thread runs it")
                    if not self._stepping and self._has_work():
                        self._stepping = True
                        break
                    cond.wait()
                else:
                    return
            try:
                if self._waiting:
                    with cond:
                        self._expire_waiting()
                        self._admit()
                        self._update_occupancy()
                self._work()
            finally:
                with cond:
                    self._stepping = False
                    cond.notify_all()

    def wake(self) -> None:
        """Something a waiting run_until() may care about changed (a paused request was read on)."""
        with self._cond:
            self._cond.notify_all()

    def forget_free(self) -> None:
        """The free slots' caches are not reused: the next request feeds its whole prompt."""
        with self._cond:
            while self._stepping:
                self._cond.wait()
            for slot in self._table.free():
                self._table.forget(slot)

    def _has_work(self) -> bool:
        """Whether a round would do anything now (under the lock, no round running)."""
        if self._embeds.jobs or (self._waiting and len(self._table.free()) >= self._waiting[0].n):
            return True
        for s in self._live.values():
            job = s.job
            if job.cancelled or not (job.paused or s.gen.next_token is None):
                return True
            if job.deadline is not None and self.clock() >= job.deadline:
                return True
            if s.prefilling and s.leader is None:
                return True
        return False

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
        return len(self._live) + len(self._embeds.jobs)

    def _update_occupancy(self) -> None:
        self.metrics.occupancy(len(self._waiting), self.slots_in_use)

    # --- the scheduler thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            # the lock only when there is something to admit or nothing to do (a job appended meanwhile is
            # seen on the next round)
            if self._waiting or not (self._live or self._embeds.jobs) or self._stopping:
                with self._cond:
                    while not self._stopping and not self._waiting and not self._live and not self._embeds.jobs:
                        self._cond.wait()
                    if self._stopping:
                        break
                    if self._waiting:
                        self._expire_waiting()
                        self._admit()
                    self._update_occupancy()
            self._work()
        with self._cond:
            for s in list(self._live.values()):
                self._fail(s, 503, "the server is shutting down", "server_error")
            for em in list(self._embeds.jobs.values()):
                self._embeds.end(em, Event("error", status=503, message="the server is shutting down",
                                           error_type="server_error"), self.metrics)
            while self._waiting:
                job = self._waiting.popleft()
                job.done = True
                self._emit(job, Event("error", status=503, message="the server is shutting down",
                                      error_type="server_error"))
            self._update_occupancy()

    def _work(self) -> None:
        """A round's work once the waiting jobs are admitted: frees what ended, one step of the generations,
        one of the embeddings."""
        self._reap()
        try:
            self._step()
        except Exception as e:  # a bug or an engine failure: fail what was live, keep serving
            for s in list(self._live.values()):
                self._table.forget(s.slot)   # what the cache holds is unknown now
                self._fail(s, 500, f"generation failed: {type(e).__name__}: {e}", "server_error")
        try:
            if self._embeds.jobs:
                self._embeds.step(self.prefill_chunk, self.metrics)
                if self._executor is not None:   # its executor time is not the token loop's
                    self._executor = self.engine.executor_seconds
        except Exception as e:  # noqa: BLE001 - as above, for the embedding jobs
            for em in list(self._embeds.jobs.values()):
                self._embeds.end(em, Event("error", status=500, message=f"embedding failed: "
                                           f"{type(e).__name__}: {e}", error_type="server_error"), self.metrics)
        if self.slots_in_use != self.metrics.slots_in_use:
            with self._cond:
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
                self._embeds.add(job, slot)
                n = sum(len(x) for x in job.inputs)
                self.metrics.admitted(n, 0)
                self._emit(job, Event("start", prompt_tokens=n))
                continue
            try:
                gens = [Generation(job.prompt, self.tokenizer, params=job.choice_params(i),
                                   max_tokens=job.max_tokens, n_ctx=self.n_ctx, stops=job.stops,
                                   top_logprobs=job.top_logprobs, eog=self.eog, n_vocab=self.n_vocab,
                                   timings=job.timings if job.timings is not None else self.timings,
                                   guide=job.grammar.guide(self._mask_thread) if job.grammar is not None else None,
                                   min_indent=job.min_indent, allowed=job.allowed)
                    for i in range(job.n)]
            except Exception as e:   # parameters are validated before submit(); this is a last guard
                job.done = True
                self._emit(job, Event("error", status=400, message=str(e), error_type="invalid_request_error"))
                continue
            self._seq_no += 1
            job.admitted_at = self.clock()
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
            if gens[0].done:   # max_tokens 0: nothing to compute
                for s in lives:
                    self._end(s)

    def _reap(self) -> None:
        """Frees the slots of cancelled jobs and ends those past their time limit."""
        now = self.clock()
        for em in list(self._embeds.jobs.values()):
            job = em.job
            if job.cancelled:
                self._embeds.end(em, None, self.metrics)
            elif job.deadline is not None and now >= job.deadline:
                self._embeds.end(em, Event("error", status=503, error_type="timeout_error",
                                           message=f"the embeddings took longer than the time limit of "
                                                   f"{job.timeout:g} s"), self.metrics)
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
        parts: list[_Live] = [s for s in self._live.values()
                              if s.gen.next_token is not None and not s.job.paused]
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
            # the copies take the same first row; taken before the leader's step, which may end it (its
            # first token an end, or max_tokens 1) and drop its followers, who would then never start
            followers, s.followers = s.followers, []
            self._advance(s, row)
            for f in followers:
                if f.slot in self._live and not f.started:
                    self._advance(f, row)
        generated = self.timings.tokens - tokens0
        self.timings.wall += clock() - t_start
        self.metrics.step(t1 - t0, len(parts), generated)
        self._account(parts, chunks, t1 - t0)

    def _forward_into(self, tokens: Any, start: int, slot: int) -> np.ndarray:
        """One sequence's forward call (looked up on the engine each time: a test may wrap it)."""
        if self._rows is not None:
            return self.engine.forward(tokens, start, slot=slot, out=self._rows[slot])
        return self.engine.forward(tokens, start, slot=slot)

    def _account(self, parts: list[_Live], chunks: dict[int, int], engine_seconds: float) -> None:
        """The executor's share of the engine calls since the last account goes to the token loop's "forward";
        a request with Timings of its own gets its decode steps' engine time and executor time (once per
        step, however many of its choices took part; prefill is not the token loop's)."""
        executor = 0.0
        if self._executor is not None:
            now = self.engine.executor_seconds
            executor, self._executor = now - self._executor, now
            self.timings.seconds["forward"] += executor
        seen: list[Timings] = []
        for s in parts:
            t = s.job.timings
            if t is not None and s.slot not in chunks and not any(t is x for x in seen):
                seen.append(t)
                t.engine += engine_seconds
                t.seconds["forward"] += executor


    def _advance(self, s: _Live, row: np.ndarray) -> None:
        """Hands s the logits that follow its last fed token; delivers what became visible."""
        if not s.started:
            s.started = True
            if s.index == 0:
                s.job.first_token_at = now = self.clock()
                self.metrics.first_token(now - s.job.submitted)
        for d in (self._spec.verify(s.slot, s.gen, row, self._table.tokens[s.slot]) if self._spec is not None
                  else (s.gen.step(row),)):
            if d is not None:
                self._deliver(s, d)
        if s.gen.done:
            self._end(s)

    def _deliver(self, s: _Live, d: Delta) -> None:
        if s.acc is not None:   # a whole response: gathered until the end
            s.acc.merge(d)
            return
        if not (d.text or d.token_ids):
            return
        interval = s.job.stream_interval
        if interval > 0:   # at most one event per interval: fewer wake-ups of the event loop per token
            if s.pending is not None:
                d = s.pending.merge(d)
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
                              stop_word=gen.stop_word, token_ids=gen.generated))

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

