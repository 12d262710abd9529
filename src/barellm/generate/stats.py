"""What a scheduler counts as it runs: tokens, steps, finished generations, time to first token, occupancy,
and its token loop's Timings. The server renders them at /metrics (serve/metrics.py adds the HTTP side).

Written from the thread that runs the scheduler's steps, read from others: one lock guards them all, as every
update is a few integer additions.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable

from barellm.generate.timings import Timings

RATE_WINDOW_S = 10.0   # generated tokens/s is measured over this trailing window


class SchedulerStats:
    def __init__(self, n_slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.started = clock()
        self.n_slots = n_slots
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated_tokens = 0
        self.finished: dict[str, int] = defaultdict(int)   # by finish reason (stop, length, cancelled, error)
        self.steps = 0
        self.step_seconds = 0.0
        self.step_sequences = 0
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.queue_depth = 0
        self.slots_in_use = 0
        self._recent: deque[tuple[float, int]] = deque()   # (time, tokens) of recent decode steps
        self.timings: Timings | None = None     # the scheduler's token loop (its thread writes it)

    def admitted(self, prompt_tokens: int, cached_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += cached_tokens

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft_sum += seconds
            self.ttft_count += 1

    def step(self, seconds: float, sequences: int, generated: int) -> None:
        now = self._clock()
        with self._lock:
            self.steps += 1
            self.step_seconds += seconds
            self.step_sequences += sequences
            self.generated_tokens += generated
            if generated:
                self._recent.append((now, generated))
            self._trim(now)

    def finish(self, reason: str) -> None:
        with self._lock:
            self.finished[reason] += 1

    def occupancy(self, queue_depth: int, slots_in_use: int) -> None:
        with self._lock:
            self.queue_depth = queue_depth
            self.slots_in_use = slots_in_use

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        now = self._clock()
        with self._lock:
            self._trim(now)
            total = sum(n for _, n in self._recent)
            window = min(RATE_WINDOW_S, max(now - self.started, 1e-9))
        return total / window
