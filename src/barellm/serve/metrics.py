"""Server counters and gauges, rendered in Prometheus' text exposition format (version 0.0.4).

Written from the event loop (requests) and the scheduler thread (tokens, steps), read by GET /metrics:
one lock guards them all, as every update is a few integer additions. The per-token time breakdown is the
scheduler's own Timings (generate/timings.py), written by that thread alone, and the event loop's time spent
formatting and writing events, kept apart from it: /metrics reads both without stopping either.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

from barellm.generate.stats import RATE_WINDOW_S, SchedulerStats
from barellm.generate.timings import PHASES

# The paths that get their own label; anything else counts as "other", so a client probing random
# paths cannot grow the label set without bound.
KNOWN_ENDPOINTS = (
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
    "/tokenize", "/detokenize", "/openapi.json", "/v1/embeddings", "/infill",
)


def endpoint_label(path: str) -> str:
    if path in KNOWN_ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return "other"


class Metrics(SchedulerStats):
    """The scheduler's counters (SchedulerStats) and the HTTP side's: requests by endpoint and status, errors,
    the event loop's time spent writing."""

    def __init__(self, n_slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(n_slots, clock)
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.errors: dict[tuple[str, str], int] = defaultdict(int)
        self.write_seconds = 0.0                # formatting and sending events (the event loop)

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def error(self, endpoint: str, kind: str) -> None:
        with self._lock:
            self.errors[(endpoint, kind)] += 1

    def wrote(self, seconds: float) -> None:
        """Time the event loop spent turning events into response bytes and handing them to the server."""
        with self._lock:
            self.write_seconds += seconds

    def breakdown(self) -> tuple[dict[str, float], int]:
        """Seconds by phase of the token loop (timings.PHASES) and the tokens generated."""
        t = self.timings
        out = t.breakdown() if t is not None else dict.fromkeys(PHASES, 0.0)
        with self._lock:
            out["write"] = self.write_seconds
        return out, (t.tokens if t is not None else 0)

    def render(self) -> str:
        rate = self.tokens_per_second()
        phases, tokens = self.breakdown()
        t = self.timings
        drafted, accepted, checks, verified = ((t.drafted, t.accepted, t.verifications, t.verified) if t is not None
                                               else (0, 0, 0, 0))
        with self._lock:
            lines: list[str] = []

            def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
                lines.append(f"# HELP {name} {help_}")
                lines.append(f"# TYPE {name} {kind}")
                for labels, value in samples:
                    lines.append(f"{name}{labels} {_num(value)}")

            metric("barellm_requests_total", "counter", "HTTP requests answered, by endpoint and status code.",
                   [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())])
            metric("barellm_request_errors_total", "counter", "Requests answered with an error, by endpoint and type.",
                   [(f'{{endpoint="{e}",type="{t}"}}', n) for (e, t), n in sorted(self.errors.items())])
            metric("barellm_prompt_tokens_total", "counter", "Prompt tokens of admitted generations.",
                   [("", self.prompt_tokens)])
            metric("barellm_prompt_tokens_cached_total", "counter",
                   "Prompt tokens whose KV cache entries were reused instead of computed.", [("", self.cached_tokens)])
            metric("barellm_generated_tokens_total", "counter", "Tokens generated.", [("", self.generated_tokens)])
            metric("barellm_generation_finished_total", "counter", "Generations ended, by reason.",
                   [(f'{{reason="{r}"}}', n) for r, n in sorted(self.finished.items())])
            metric("barellm_generated_tokens_per_second", "gauge",
                   f"Generated tokens per second over the last {RATE_WINDOW_S:g} seconds.", [("", rate)])
            metric("barellm_time_to_first_token_seconds", "summary",
                   "From a request's arrival to its first generated token.",
                   [("_sum", self.ttft_sum), ("_count", self.ttft_count)])
            metric("barellm_batch_steps_total", "counter", "Batched forward passes run.", [("", self.steps)])
            metric("barellm_batch_step_seconds_total", "counter", "Time spent in batched forward passes.",
                   [("", self.step_seconds)])
            metric("barellm_batch_sequences_total", "counter",
                   "Sequences summed over batched forward passes (divide by steps for the mean batch size).",
                   [("", self.step_sequences)])
            metric("barellm_token_phase_seconds_total", "counter",
                   "Time of the token loop by phase: forward (the native executor), logits copy (the rest of the "
                   "engine call), sample, logprobs, detokenize, stop (stop strings and held-back text), bookkeeping "
                   "(the scheduler's own work), write (formatting and sending events, on the event loop).",
                   [(f'{{phase="{p}"}}', phases[p]) for p in PHASES])
            metric("barellm_token_phase_tokens_total", "counter", "Tokens the phase times were spent on.",
                   [("", tokens)])
            metric("barellm_token_phase_ms_per_token", "gauge",
                   "Milliseconds per generated token by phase (seconds_total / tokens_total, since start).",
                   [(f'{{phase="{p}"}}', 1000 * phases[p] / tokens if tokens else 0.0) for p in PHASES])
            metric("barellm_draft_tokens_total", "counter",
                   "Drafted tokens fed for checking (speculative decoding, serve --draft).", [("", drafted)])
            metric("barellm_draft_accepted_tokens_total", "counter",
                   "Drafted tokens the model chose too (divide by draft_tokens_total for the acceptance rate).",
                   [("", accepted)])
            metric("barellm_draft_verifications_total", "counter", "Sequence steps that checked drafted tokens.",
                   [("", checks)])
            metric("barellm_draft_verified_tokens_total", "counter",
                   "Tokens those steps gave (divide by verifications_total for the tokens per verification).",
                   [("", verified)])
            metric("barellm_queue_depth", "gauge", "Requests waiting for a slot.", [("", self.queue_depth)])
            metric("barellm_slots_in_use", "gauge", "KV cache slots holding a live sequence.",
                   [("", self.slots_in_use)])
            metric("barellm_slots", "gauge", "KV cache slots allocated at start-up.", [("", self.n_slots)])
        return "\n".join(lines) + "\n"


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))
