"""One generation request, whichever front end made it, and the one check that holds it to a model's limits.

The Python API (Model's keywords: `Options`, read by `from_options`), the OpenAI routes and the Ollama routes
each turn what they were given into a `Request`, and each passes it through `check` before it goes to the
Scheduler: the prompt against the vocabulary and the context, max_tokens against the room left, n against
the slots, logit_bias against the vocabulary, the sampling parameters' ranges. A failed check is an
InvalidRequest that names the parameter (`param`, as the HTTP error shape wants it), worded the same
whichever API was called.

The Scheduler reports what becomes of a request in `Event`s, handed to the request's `emit`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypedDict, TypeVar

import numpy as np

from barellm.errors import InvalidRequest
from barellm.generate.generation import DEFAULT_MAX_TOKENS, Allowed
from barellm.generate.sampling import SamplingParams, TokenLogprob
from barellm.generate.timings import Timings

__all__ = ["Event", "OPTION_DEFAULTS", "Options", "Request", "SamplingOptions", "check", "from_options",
           "takes_options"]


@dataclass
class Event:
    """What the scheduler tells a request's owner. kind is one of:

    "start"  the request has its slot(s): cached_tokens, prompt_tokens
    "delta"  new text (may be "") of choice `index` and the tokens that produced it (logprobs when asked)
    "done"   choice `index` ended: finish_reason ("stop" or "length"), usage counts of that choice, and
             stop_type: "eos" (the text ended: an end token, or a line indented less than min_indent,
             which ends a fill), "word" (stop_word, a stop string) or "limit" (max_tokens, the context, the
             time limit: finish_reason "length")
    "error"  status, message, error_type (the request ended without completing)
    "embeddings"  an EmbedJob's result: data, float32 [inputs, dim] (or a scoring job's logits); prompt_tokens
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


def _nowhere(ev: Event) -> None:
    pass


@dataclass(eq=False)
class Request:
    """A generation: its prompt, how to sample, when to end, what to report, and how its events travel. The
    scheduler's bookkeeping of it rides along at the end."""

    prompt: list[int] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = DEFAULT_MAX_TOKENS   # None: until the end of generation or the context
    emit: Callable[[Event], None] = _nowhere      # called from the thread running the scheduler; must not block
    stops: list[str] = field(default_factory=list)
    top_logprobs: int | None = None     # None: no logprobs; k >= 0: the chosen token's and k alternatives
    timeout: float | None = None        # seconds from submission
    cache_prompt: bool = True           # False: prefill the whole prompt, reusing no cached prefix
    n: int = 1                          # choices, each in its own slot, sharing the prompt's KV entries
    stream: bool = True                 # False: one "delta" per choice, just before its "done"
    stream_interval: float = 0.0        # streamed deltas are gathered and sent at most once per this many seconds
    grammar: Any = None                 # a structured.Grammar every choice's output follows (None: free)
    min_indent: int = 0                 # a new line indented less ends the text (infill)
    allowed: Allowed = None             # an allowed-token bitmask, or a function of the generated ids giving one
    timings: Timings | None = None      # this request's own account of its token loop (None: the scheduler's)
    draft: bool = True                  # speculative decoding where the scheduler drafts; False: off for this one
    # --- the scheduler's bookkeeping ---
    submitted: float = 0.0
    cancelled: bool = False
    done: bool = False
    live: int = 0                       # choices still generating
    paused: bool = False                # its reader has not taken what it has: no step advances it meanwhile
    admitted_at: float | None = None      # when it got its slots (the scheduler's clock)
    first_token_at: float | None = None   # when the first choice's first logits were ready (the prefill's end)

    @property
    def deadline(self) -> float | None:
        return None if self.timeout is None else self.submitted + self.timeout

    def choice_params(self, index: int) -> SamplingParams:
        """Choice i draws with seed + i, so choice 0 is what n=1 gives."""
        if index == 0 or self.params.seed is None:
            return self.params
        return replace(self.params, seed=self.params.seed + index)


class SamplingOptions(TypedDict, total=False):
    """The keywords every generation method of the Python API takes, the OpenAI-shaped ones included (these add
    their own max_tokens and logprobs, in OpenAI's sense)."""

    temperature: float              # 0 is greedy
    top_k: int                      # 0 = off
    top_p: float                    # 1 = off
    min_p: float                    # 0 = off
    repeat_penalty: float           # 1 = off
    repeat_last_n: int              # tokens the penalties look back over (-1: all)
    presence_penalty: float
    frequency_penalty: float
    logit_bias: Mapping[int, float] | None   # {token id: added to its logit}; -100 bans a token
    seed: int | None                # the same seed, the same output
    stop: str | Sequence[str] | None         # the text ends before the first of these (not included)
    n: int                          # choices of the prompt, each in its own KV cache slot
    allowed_tokens: Allowed         # a uint32 bitmask over the vocabulary, or a function of the generated ids
    json_schema: Mapping[str, Any] | str | None   # the output is one JSON value valid against it
    grammar: str | None             # llguidance's Lark dialect or llama.cpp's GBNF
    regex: str | None               # the output matches it as a whole
    min_indent: int                 # a new line indented less than this ends the text (fill-in-the-middle)
    draft: bool                     # False: no speculative decoding for this call (load(..., draft=...))


class Options(SamplingOptions, total=False):
    """The keywords of the Python API's generation methods (generate, stream, complete, chat, infill, ...): what
    they put in a Request. Their defaults: OPTION_DEFAULTS."""

    max_tokens: int | None          # None: until the end of generation or a full context
    logprobs: bool                  # each token's log-probability
    top_logprobs: int | None        # ... and the k best alternatives
    timings: Timings | None         # a Timings to add this generation's phases to


_SAMPLING = {f.name: f.default for f in fields(SamplingParams)}
OPTION_DEFAULTS: dict[str, Any] = {
    "max_tokens": DEFAULT_MAX_TOKENS, **_SAMPLING, "stop": None, "n": 1, "logprobs": False, "top_logprobs": None,
    "allowed_tokens": None, "json_schema": None, "grammar": None, "regex": None, "min_indent": 0, "timings": None,
    "draft": True}
assert set(OPTION_DEFAULTS) == set(Options.__annotations__), "Options and OPTION_DEFAULTS disagree"
CONSTRAINTS = ("json_schema", "grammar", "regex")


def _integer(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


R = TypeVar("R", bound=Request)


def from_options(options: Mapping[str, Any], constrain: Callable[..., Any] | None = None,
                 cls: type[R] = Request) -> R:  # type: ignore[assignment]
    """The Request (a cls) the Python API's keywords ask for (Options; those not given take their defaults).
    constrain compiles json_schema / grammar / regex into a Grammar (the model's structured vocabulary does)."""
    unknown = set(options) - set(OPTION_DEFAULTS)
    if unknown:
        raise InvalidRequest(f"unknown generation parameter(s): {', '.join(sorted(unknown))}")
    o = {**OPTION_DEFAULTS, **options}
    # a sampling keyword given as None keeps its default (but seed: None is a random one)
    params = SamplingParams().with_(**{k: o[k] for k in _SAMPLING if k != "seed"})
    params = replace(params, seed=o["seed"]).validated()
    stop = o["stop"]
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise InvalidRequest("stop must be a string or a list of strings", "stop")
    logprobs, top = o["logprobs"], o["top_logprobs"]
    if not isinstance(logprobs, bool):
        raise InvalidRequest(f"logprobs must be True or False, got {logprobs!r}", "logprobs")
    if top is not None and not (_integer(top) and top >= 0):
        raise InvalidRequest(f"top_logprobs must be an integer >= 0, got {top!r}", "top_logprobs")
    timings = o["timings"]
    if timings is not None and not isinstance(timings, Timings):
        raise InvalidRequest("timings must be a barellm.generate.timings.Timings", "timings")
    wanted = {k: o[k] for k in CONSTRAINTS if o[k] is not None}
    grammar = None
    if wanted:
        if o["allowed_tokens"] is not None:
            raise InvalidRequest(f"allowed_tokens and {next(iter(wanted))} both constrain the output: give one",
                                 "allowed_tokens")
        if constrain is None:
            raise InvalidRequest(f"{next(iter(wanted))} needs a model to compile it against")
        grammar = constrain(**wanted)
    return cls(params=params, max_tokens=o["max_tokens"], stops=[s for s in stops if s], n=o["n"],
               top_logprobs=top if top else (0 if logprobs else None), allowed=o["allowed_tokens"],
               grammar=grammar, min_indent=o["min_indent"], timings=timings, draft=o["draft"])


def check(req: Request, *, n_ctx: int, n_vocab: int, n_slots: int, clamp_max_tokens: bool = True,
          prompt_param: str = "prompt") -> None:
    """Holds req to the model's limits, the same for every front end; an InvalidRequest names what is wrong.

    The prompt must be token ids of the vocabulary, at least one, leaving room for a token in the context
    (n_ctx); a max_tokens past that room is cut to it with clamp_max_tokens (the Python API and Ollama, whose
    generations stop at a full context), else refused (OpenAI's routes); n may not exceed the slots;
    logit_bias and an allowed-token mask must fit the vocabulary; draft is True or False. prompt_param names
    the prompt in errors ("messages" for a chat)."""
    prompt = req.prompt
    for i, t in enumerate(prompt):
        if not _integer(t) or not 0 <= t < n_vocab:
            raise InvalidRequest(f"{prompt_param}[{i}] = {t!r} is outside the vocabulary (0..{n_vocab - 1})",
                                 prompt_param)
    if not prompt:
        raise InvalidRequest("the prompt is empty (it encodes to no tokens)", prompt_param)
    room = n_ctx - len(prompt)
    if room < 1:
        raise InvalidRequest(f"the prompt has {len(prompt)} tokens; the context holds {n_ctx}, including the reply",
                             prompt_param, "context_length_exceeded")
    m = req.max_tokens
    if m is not None:
        if not _integer(m) or m < 0:
            raise InvalidRequest(f"max_tokens must be an integer >= 0 or None (no limit), got {m!r}", "max_tokens")
        if m > room:
            if not clamp_max_tokens:
                raise InvalidRequest(f"the prompt has {len(prompt)} tokens and max_tokens is {m}: together over the "
                                     f"context of {n_ctx} tokens", "max_tokens", "context_length_exceeded")
            req.max_tokens = room
    n = req.n
    if not _integer(n) or n < 1:
        raise InvalidRequest(f"n must be an integer >= 1, got {n!r}", "n")
    if n > n_slots:
        raise InvalidRequest(f"n = {n} needs {n} KV cache slots at once; this model has {n_slots} "
                             f"(barellm.load(..., slots={n}); barellm serve --slots {n})", "n")
    bias = req.params.logit_bias
    if bias:
        bad = next((k for k in bias if not 0 <= int(k) < n_vocab), None)
        if bad is not None:
            raise InvalidRequest(f"logit_bias names token {bad}, outside the vocabulary (0..{n_vocab - 1})",
                                 "logit_bias")
    top = req.top_logprobs
    if top is not None and not (_integer(top) and 0 <= top <= n_vocab):
        raise InvalidRequest(f"top_logprobs must be an integer in 0..{n_vocab}, got {top!r}", "top_logprobs")
    if not _integer(req.min_indent) or req.min_indent < 0:
        raise InvalidRequest(f"min_indent must be an integer >= 0, got {req.min_indent!r}", "min_indent")
    if not isinstance(req.draft, bool):
        raise InvalidRequest(f"draft must be True or False (speculative decoding on or off), got {req.draft!r}",
                             "draft")
    allowed = req.allowed
    if allowed is not None and not callable(allowed):
        words = (n_vocab + 31) // 32
        allowed = req.allowed = np.ascontiguousarray(allowed, dtype=np.uint32).reshape(-1)
        if allowed.shape[0] < words:
            raise InvalidRequest(f"allowed_tokens must be a uint32 bitmask of {words} words (one bit per token), "
                                 f"got {allowed.shape[0]}", "allowed_tokens")


def takes_options(leave_out: Sequence[str] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Shows a method's **options as the keyword-only parameters they are (Options' names, types and defaults;
    but those in leave_out, and those the method declares itself), so that help() and inspect.signature list
    them; type checkers read them from the method's Unpack[Options] annotation itself."""
    def show(method: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(method)
        # the annotations' text, as the method's own parameters show theirs
        hints = {k: getattr(v, "__forward_arg__", v) for k, v in Options.__annotations__.items()}
        params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        taken = {p.name for p in params} | set(leave_out)
        params += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=hints.get(k, Any))
                   for k, d in OPTION_DEFAULTS.items() if k not in taken]
        method.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        return method
    return show
