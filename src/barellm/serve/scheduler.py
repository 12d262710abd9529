"""Continuous batching: one thread owns the engine and advances every live sequence together.

Each KV cache slot holds at most one live sequence. A scheduler step gathers, for every decoding
sequence, its last sampled token, and for prefilling sequences the next chunk of their prompt, and runs
them all through ONE engine.forward_batch call. The engines guarantee that each sequence's logits are
bit-identical to running it alone, and the scheduler feeds every sequence exactly what it would feed
it alone (same chunks, same positions, same sampler history), so a greedy request's output does not
depend on what else is being served.

The asyncio side never touches the engine: it submits Jobs and receives Events through a callback,
which the app turns into loop.call_soon_threadsafe.

Slots remember the tokens their cache holds after a sequence ends. A new job goes to the free slot whose
cache saves it the most prefill without throwing away more than it saves, and only the rest is prefilled.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from barellm.sampling import Sampler, SamplingParams
from barellm.serve.metrics import Metrics

DEFAULT_PREFILL_CHUNK = 256


class QueueFull(Exception):
    """The waiting queue holds --queue jobs already."""


@dataclass
class TokenLogprob:
    """One generated token's log-probability and the best alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Event:
    """What the scheduler tells a job's owner. kind is one of:

    "start"  the job has a slot: cached_tokens, prompt_tokens
    "delta"  new text (may be "") and the tokens that produced it (logprobs when asked)
    "done"   finish_reason ("stop" or "length"), usage counts
    "error"  status, message, error_type (the job ended without completing)
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
    submitted: float = 0.0
    cancelled: bool = False
    done: bool = False

    @property
    def deadline(self) -> float | None:
        return None if self.timeout is None else self.submitted + self.timeout


class _Live:
    """A job bound to a slot: its prompt progress, sampler, decoder and text held back for stop strings."""

    def __init__(self, job: Job, slot: int, reuse: int, sampler: Sampler, decoder: Any, seq_no: int) -> None:
        self.job = job
        self.slot = slot
        self.seq_no = seq_no              # admission order: prefill is served first come, first served
        self.fed = reuse                  # prompt tokens whose KV entries the slot holds
        self.cached = reuse
        self.history = list(job.prompt)   # prompt + generated: what penalties look at, as Model does
        self.generated: list[int] = []
        self.last: int | None = None      # sampled, not yet fed
        self.sampler = sampler
        self.decoder = decoder
        self.text = ""                    # all text decoded so far
        self.emitted = 0                  # chars of text already sent
        self.pending: list[tuple[int, TokenLogprob | None, int]] = []   # (text offset, logprob, id) not yet sent
        self.first_token_at: float | None = None
        self.longest_stop = max((len(s) for s in job.stops), default=0)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.job.prompt)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def stop_prefix_len(text: str, stops: list[str], longest: int) -> int:
    """Length of the longest end of text that could still grow into a stop string."""
    for n in range(min(longest, len(text)), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0


def top_logprobs(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """Log-softmax of the logits the sampler was given: the chosen token's value and the k best."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = float(z.max())
    lse = m + float(np.log(np.exp(z - m).sum()))
    top: list[tuple[int, float]] = []
    if k > 0:
        k = min(k, z.shape[0])
        ids = np.argpartition(-z, k - 1)[:k]
        ids = ids[np.lexsort((ids, -z[ids]))]   # best first, ties by id: independent of the partition
        top = [(int(i), float(z[i] - lse)) for i in ids]
    return TokenLogprob(token, float(z[token] - lse), top)


class Scheduler:
    """Owns the model's engine from its own thread; thread-safe submit() and cancel()."""

    def __init__(self, engine: Any, tokenizer: Any, *, n_ctx: int, n_slots: int | None = None,
                 max_queue: int = 64, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 metrics: Metrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
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
        self.eog = set(tokenizer.eog_ids)
        # What each slot's KV cache holds, in order (valid entries only). Read by tests and /health.
        self.slot_tokens: list[list[int]] = [[] for _ in range(self.n_slots)]
        self._slot_used_at = [0.0] * self.n_slots
        self._live: dict[int, _Live] = {}            # slot -> live sequence; scheduler thread only
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._seq_no = 0
        self._thread: threading.Thread | None = None

    # --- any thread ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
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

    def submit(self, job: Job) -> None:
        job.submitted = self.clock()
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            # The bound counts jobs not yet holding a slot; a job that would get a slot at once also
            # waits here for a moment, so a full queue with free slots still admits.
            free = self.n_slots - len(self._live)
            if len(self._waiting) >= self.max_queue + max(free, 0):
                raise QueueFull(f"{len(self._waiting)} requests are waiting already")
            self._waiting.append(job)
            self._update_occupancy()
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """Ends a job (its client went away): dropped from the queue now, its slot freed before the
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
        return len(self._live)

    def _update_occupancy(self) -> None:
        self.metrics.occupancy(len(self._waiting), len(self._live))

    # --- the scheduler thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._live:
                    self._cond.wait()
                if self._stopping:
                    break
                self._expire_waiting()
                self._admit()
                self._update_occupancy()
            self._reap()
            try:
                self._step()
            except Exception as e:  # a bug or an engine failure: fail what was live, keep serving
                for s in list(self._live.values()):
                    self.slot_tokens[s.slot] = []   # what the cache holds is unknown now
                    self._fail(s, 500, f"generation failed: {type(e).__name__}: {e}", "server_error")
            with self._cond:
                self._update_occupancy()
        with self._cond:
            for s in list(self._live.values()):
                self._fail(s, 503, "the server is shutting down", "server_error")
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
        """Gives waiting jobs free slots, first come first served; each takes the free slot whose cache
        serves it best (see _slot_score)."""
        while self._waiting:
            free = [i for i in range(self.n_slots) if i not in self._live]
            if not free:
                return
            job = self._waiting.popleft()
            try:
                sampler = Sampler(job.params)
            except Exception as e:   # parameters are validated before submit(); this is a last guard
                job.done = True
                self._emit(job, Event("error", status=400, message=str(e), error_type="invalid_request_error"))
                continue
            best = max(free, key=lambda i: self._slot_score(i, job))
            # at least the last prompt token is fed, to get the logits that follow it
            reuse = (min(common_prefix(self.slot_tokens[best], job.prompt), len(job.prompt) - 1)
                     if job.cache_prompt else 0)
            self.slot_tokens[best] = self.slot_tokens[best][:reuse]
            self._slot_used_at[best] = self.clock()
            self._seq_no += 1
            live = _Live(job, best, reuse, sampler, self.tokenizer.stream_decoder(), self._seq_no)
            self._live[best] = live
            self.metrics.admitted(len(job.prompt), reuse)
            self._emit(job, Event("start", prompt_tokens=len(job.prompt), cached_tokens=reuse))

    def _slot_score(self, slot: int, job: Job) -> tuple[int, float]:
        """How good a free slot is for job: the prompt tokens its cache saves now, minus the cached tokens
        it would throw away (which another conversation's next turn may still want); ties go to the least
        recently used slot. So a continuing conversation returns to its own slot, a new one that shares
        only a system prompt with the others takes an empty slot rather than evicting one of them, and a
        repeated long prompt still finds its cache."""
        held = len(self.slot_tokens[slot])
        saved = common_prefix(self.slot_tokens[slot], job.prompt) if job.cache_prompt else 0
        return saved - (held - saved), -self._slot_used_at[slot]

    def _reap(self) -> None:
        """Frees the slots of cancelled jobs and ends those past their time limit."""
        now = self.clock()
        for s in list(self._live.values()):
            if s.job.cancelled:
                self._release(s, "cancelled")
            elif s.job.deadline is not None and now >= s.job.deadline:
                self._finish(s, "length", flush=True)

    def _step(self) -> None:
        batch: list[tuple[int, list[int], int]] = []
        parts: list[_Live] = []
        for s in self._live.values():
            if not s.prefilling and s.last is not None:
                batch.append((s.slot, [s.last], len(s.history) - 1))
                parts.append(s)
        # Prompt chunks always start where the sequence's prefill stands and are prefill_chunk long
        # (the last one shorter), whatever else runs: the budget only decides which chunks join this
        # step, never how a prompt is cut, so a sequence sees the same forward calls under any load.
        budget = self.prefill_chunk
        prefills = sorted((s for s in self._live.values() if s.prefilling), key=lambda s: s.seq_no)
        chunks: dict[int, int] = {}
        for s in prefills:
            n = min(self.prefill_chunk, len(s.job.prompt) - s.fed)
            if chunks and n > budget:
                break
            batch.append((s.slot, s.job.prompt[s.fed:s.fed + n], s.fed))
            parts.append(s)
            chunks[s.slot] = n
            budget -= n
        if not batch:
            return
        t0 = self.clock()
        logits = self.engine.forward_batch(batch)
        dt = self.clock() - t0
        generated = 0
        for i, s in enumerate(parts):
            if s.slot in chunks:
                n = chunks[s.slot]
                self.slot_tokens[s.slot].extend(s.job.prompt[s.fed:s.fed + n])
                s.fed += n
                if s.prefilling:
                    continue
            else:
                assert s.last is not None
                self.slot_tokens[s.slot].append(s.last)
                s.last = None
            if s.job.cancelled:
                self._release(s, "cancelled")
                continue
            generated += self._sample(s, logits[i])
        self.metrics.step(dt, len(parts), generated)

    def _sample(self, s: _Live, row: np.ndarray) -> int:
        """Draws the next token of s from its logits; returns how many tokens were generated (0 or 1)."""
        job = s.job
        tok = s.sampler.sample(row, s.history)
        if s.first_token_at is None:
            s.first_token_at = self.clock()
            self.metrics.first_token(s.first_token_at - job.submitted)
        if tok in self.eog:
            self._finish(s, "stop", flush=True)
            return 0
        lp = top_logprobs(row, tok, job.top_logprobs) if job.top_logprobs is not None else None
        s.history.append(tok)
        s.generated.append(tok)
        s.pending.append((len(s.text), lp, tok))
        s.text += s.decoder.feed(tok)
        if self._check_stop(s):
            return 1
        if len(s.generated) >= job.max_tokens or len(s.history) >= self.n_ctx:
            self._finish(s, "length", flush=True)
            return 1
        hold = stop_prefix_len(s.text[s.emitted:], job.stops, s.longest_stop - 1) if job.stops else 0
        self._send(s, len(s.text) - hold)
        s.last = tok
        return 1

    def _check_stop(self, s: _Live) -> bool:
        """Ends s at the first stop string in the text not yet sent (held-back text included)."""
        if not s.job.stops:
            return False
        hits = [p for p in (s.text.find(stop, s.emitted) for stop in s.job.stops) if p >= 0]
        if not hits:
            return False
        cut = min(hits)
        # tokens that begin inside the stop string produced no text the client sees: not sent
        self._send(s, cut, all_tokens=False)
        s.text = s.text[:cut]
        s.pending = []
        self._end(s, "stop")
        return True

    def _send(self, s: _Live, upto: int, all_tokens: bool = False) -> None:
        """Sends text[emitted:upto] with the tokens that begin before upto (or every pending token)."""
        text = s.text[s.emitted:upto]
        n = len(s.pending) if all_tokens else sum(1 for off, _, _ in s.pending if off < upto)
        toks, s.pending = s.pending[:n], s.pending[n:]
        s.emitted = max(s.emitted, upto)
        if not text and not toks:
            return
        self._emit(s.job, Event("delta", text=text, tokens=[lp for _, lp, _ in toks if lp is not None],
                                token_ids=[t for _, _, t in toks]))

    def _finish(self, s: _Live, reason: str, flush: bool) -> None:
        if flush:
            s.text += s.decoder.flush()
            if self._check_stop(s):
                return
        self._send(s, len(s.text), all_tokens=True)
        self._end(s, reason)

    def _end(self, s: _Live, reason: str) -> None:
        s.job.done = True
        self._remove(s)
        self.metrics.finish(reason)
        self._emit(s.job, Event("done", finish_reason=reason, prompt_tokens=len(s.job.prompt),
                                cached_tokens=s.cached, completion_tokens=len(s.generated)))

    def _release(self, s: _Live, reason: str) -> None:
        s.job.done = True
        self._remove(s)
        self.metrics.finish(reason)

    def _fail(self, s: _Live, status: int, message: str, error_type: str) -> None:
        s.job.done = True
        self._remove(s)
        self.metrics.finish("error")
        self._emit(s.job, Event("error", status=status, message=message, error_type=error_type))

    def _remove(self, s: _Live) -> None:
        self._live.pop(s.slot, None)
        self._slot_used_at[s.slot] = self.clock()
