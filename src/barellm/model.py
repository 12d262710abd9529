"""The public face: load a model by name or path, then tokenize, score, generate, stream and chat.

Model is thin: the tokenizer turns text into ids, an engine turns ids into logits, and a Generation
(generation.py: sampling, stop strings, limits, the text held back for them, logprobs) decides each next
token and what text it makes. The KV cache slots persist between calls, so a prompt that starts with what a
slot already holds is only fed from where it differs.

Sharing a Model: every generation owns a KV cache slot from its first token to its end (a stream: until it
is exhausted, closed or dropped). `load(..., slots=N)` gives N slots. A generation that finds no free slot
waits for one while other threads hold them; when the only holders are unfinished generations of its own
thread (an open stream), waiting could never end, so it raises SlotsBusy instead. Generations in separate
slots may run from several threads at once: their engine calls take turns, each on its own cache.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from barellm.arch.config import ModelConfig, config_of
from barellm.cpu import default_threads
from barellm.errors import BarellmError, FormatError, InvalidRequest, SlotsBusy
from barellm.generation import DEFAULT_MAX_TOKENS, Delta, Generation, SlotTable, Timings, pooled
from barellm.sampling import SamplingParams, TokenLogprob

ENGINES = ("auto", "native", "reference")
ACTIVATIONS = ("q8x2", "q8")  # the native engine's activation precisions (engine.ACTIVATIONS)
KV_TYPES = ("f16", "q8_0", "f32")  # what the KV cache holds (engine.KV_TYPES)
GENERATION_KEYWORDS = ("max_tokens", "stop", "n", "logprobs", "top_logprobs", "allowed_tokens", "timings",
                       "json_schema", "grammar", "regex", "min_indent", "draft")


@dataclass
class Choice:
    """One of the n sequences a complete(..., n=n) call generates."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)   # every generated token (a stop string's too)
    finish_reason: str = "length"
    logprobs: list[TokenLogprob] | None = None            # one per token of the text, when asked


@dataclass
class Completion:
    """Everything about one generation; `text` is what generate() returns.

    text, token_ids, finish_reason and logprobs are those of the first choice; `choices` holds all n."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"      # "stop" (end of generation or stop string) or "length"
    prompt_tokens: int = 0
    cached_tokens: int = 0             # prompt tokens whose KV entries were reused
    prefill_seconds: float = 0.0       # prompt processing, up to the first token's logits
    decode_seconds: float = 0.0
    logprobs: list[TokenLogprob] | None = None   # with logprobs / top_logprobs: one per token of the text
    choices: list[Choice] = field(default_factory=list)
    timings: Timings | None = None     # seconds per phase of the token loop (generation.PHASES)


class Stream(Iterator[str]):
    """What stream() and chat_stream() return: an iterator of text pieces. The token ids generated so far
    are in `token_ids`; once the stream is exhausted, `finish_reason` says why it ended ("stop": an
    end-of-generation token or a stop string; "length": max_tokens or the full context); None before that
    and for a stream closed early. close() ends it and gives its KV cache slot back, as dropping it does."""

    def __init__(self, pieces: Iterator[str], completion: Completion) -> None:
        self._pieces = pieces
        self.completion = completion     # filled as the generation runs
        self._ended = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        try:
            return next(self._pieces)
        except StopIteration:
            self._ended = True
            raise

    def close(self) -> None:
        close = getattr(self._pieces, "close", None)
        if close is not None:
            close()

    @property
    def token_ids(self) -> list[int]:
        return self.completion.choices[0].token_ids if self.completion.choices else []

    @property
    def prompt_tokens(self) -> int:
        return self.completion.prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        if not self._ended:
            return None
        return self.completion.choices[0].finish_reason if self.completion.choices else "length"


def _open_source(path: Path, verify: bool = False) -> Any:
    from barellm.cache import open_model

    return open_model(path, verify=verify)


@dataclass
class _Request:
    params: SamplingParams
    max_tokens: int | None        # None: no limit but the context
    stops: list[str]
    n: int
    top_logprobs: int | None
    allowed: Any
    timings: Timings | None
    grammar: Any = None           # a structured.Grammar: every choice follows it
    min_indent: int = 0           # a new line indented less ends the text (llama.cpp's n_indent)
    draft: bool = True            # speculative decoding when the Model drafts (load(..., draft=...)); False: off

    def params_for(self, index: int) -> SamplingParams:
        """Choice i draws with seed + i, so choice 0 is what n=1 gives."""
        if index == 0 or self.params.seed is None:
            return self.params
        return SamplingParams(**{**self.params.__dict__, "seed": self.params.seed + index})


class Model:
    """A loaded model: tokenize, score (logits), generate, stream, chat.

    Safe to share between threads (see the module docstring): each generation holds its own KV cache slot;
    with one slot (the default) generations from several threads run one after another, with slots=N up to
    N at once. An unfinished stream keeps its slot until it ends, is closed or is dropped.
    """

    def __init__(self, path: Path, *, threads: int | None = None, context: int | None = None,
                 engine: str = "auto", chat_template: str | None = None, slots: int = 1,
                 activations: str = "q8x2", kv_type: str | None = None, verify: bool = False,
                 draft: str | os.PathLike[str] | None = None) -> None:
        from barellm.text.chat import ChatTemplate, template_for
        from barellm.text.tokenizer import Tokenizer

        if engine not in ENGINES:
            raise InvalidRequest(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        if activations not in ACTIVATIONS:
            raise InvalidRequest(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        if kv_type is not None and kv_type not in KV_TYPES:
            raise InvalidRequest(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        if threads is not None and not (isinstance(threads, int) and 1 <= threads <= 256):
            raise InvalidRequest(f"threads must be an integer in 1..256, got {threads!r}")
        from barellm.catalog import display_name

        self.path = path
        self.name = display_name(path)   # what messages print: a registered or file name, never a cache hash
        self.source = _open_source(path, verify)
        md = self.source.metadata
        self.metadata: dict[str, Any] = md
        self.config: ModelConfig = config_of(self.source)
        n_ctx = context or min(self.config.context_length, 4096)
        if not (isinstance(n_ctx, int) and 16 <= n_ctx <= self.config.context_length):
            raise InvalidRequest(f"context must be an integer in 16..{self.config.context_length}, got {context!r}")
        self.n_ctx = n_ctx
        self.tokenizer = Tokenizer.from_metadata(md)
        self.template = ChatTemplate(
            template_for(md, chat_template),
            bos_token=self.tokenizer.token_text(self.tokenizer.bos_id) if self.tokenizer.bos_id is not None else "",
            eos_token=self.tokenizer.token_text(self.tokenizer.eos_id) if self.tokenizer.eos_id is not None else "",
        )
        # what the header holds is in Python objects by now (strings, the tokenizer's scores and token types):
        # its pages need not stay resident beside them
        self.source.release_header()
        if not (isinstance(slots, int) and 1 <= slots <= 256):
            raise InvalidRequest(f"slots must be an integer in 1..256, got {slots!r}")
        self.slots = slots
        self.threads = threads or default_threads()
        self.activations = activations
        self.kv_type = kv_type  # None: the engine's default (native f16, reference f32)
        self.engine_name, self.engine = self._make_engine(engine)
        self._table = SlotTable(slots)            # what each slot's cache holds; guarded by _cond
        self._owner: list[int | None] = [None] * slots   # the thread holding each busy slot
        self._cond = threading.Condition()
        self._engine_lock = threading.Lock()      # one engine call at a time (one thread pool)
        self._served = False                      # a server's scheduler owns the engine (see serving())
        # each slot's decode logits land in its own row here: nothing is allocated per token
        self._rows = np.empty((slots, 1, self.config.n_vocab), np.float32) if self.engine_name == "native" else None
        # speculative decoding (barellm.speculative): prompt lookup or a draft model; None: plain decoding
        self.speculator: Any = None
        if draft is not None:
            from barellm.speculative import speculator

            self.speculator = speculator(draft, self)

    def _make_engine(self, engine: str) -> tuple[str, Any]:
        if engine in ("auto", "native"):
            from barellm.engine import NativeEngine, NativeUnsupported, unsupported_reason

            reason = unsupported_reason(self.config, self.source)
            if reason is None:
                try:
                    return "native", NativeEngine(self.config, self.source, n_ctx=self.n_ctx, threads=self.threads,
                                                  n_slots=self.slots, activations=self.activations,
                                                  kv_type=self.kv_type or "f16")
                except NativeUnsupported as e:
                    if engine == "native":
                        raise
                    reason = str(e).removeprefix("the native engine cannot run this model: ")
            if engine == "native":
                raise FormatError(f"the native engine cannot run this model: {reason}")
            warnings.warn(f"the native engine cannot run this model ({reason}); using the NumPy reference engine, "
                          "which is slow", RuntimeWarning, stacklevel=3)
        from barellm.arch import reference_engine

        return "reference", reference_engine(self.config, self.source, self.n_ctx, self.slots, self.kv_type or "f32")

    # --- text <-> ids -------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of text; add_special applies the model's BOS rule."""
        if not isinstance(text, str):
            raise InvalidRequest(f"text must be a string, got {type(text).__name__}")
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int], skip_special: bool = False) -> str:
        self._check_ids(ids)
        return self.tokenizer.decode(list(ids), skip_special=skip_special)

    def _check_ids(self, ids: Sequence[int]) -> None:
        for t in ids:
            if not isinstance(t, (int, np.integer)) or not 0 <= int(t) < self.config.n_vocab:
                raise InvalidRequest(f"token id {t!r} is out of range 0..{self.config.n_vocab - 1}")

    # --- slots and the engine -------------------------------------------------------------------

    def _acquire(self, n: int, prompt: Sequence[int]) -> list[tuple[int, int]]:
        """n free slots for prompt, the one whose cache serves it best first: [(slot, reused tokens)]."""
        if n > self.slots:
            raise InvalidRequest(f"n={n} needs {n} KV cache slots; this Model has {self.slots} "
                                 f"(barellm.load(..., slots={n}))")
        me = threading.get_ident()
        with self._cond:
            while True:
                self._check_served()
                if len(self._table.free()) >= n:
                    break
                mine = sum(1 for o in self._owner if o == me)
                if self.slots - mine < n:
                    raise SlotsBusy(
                        f"all {self.slots} KV cache slot(s) of this Model are held by unfinished generations of "
                        f"this thread (an open stream?): finish or close them first, or load the model with more "
                        f"slots (barellm.load(..., slots=N))")
                self._cond.wait()
            out = []
            for _ in range(n):
                slot = self._table.choose(prompt)
                assert slot is not None
                out.append((slot, self._table.take(slot, prompt)))
                self._owner[slot] = me
            return out

    def _release(self, slots: Sequence[int]) -> None:
        with self._cond:
            for s in slots:
                self._table.release(s)
                self._owner[s] = None
            self._cond.notify_all()

    def _check_served(self) -> None:
        if self._served:
            raise InvalidRequest("this Model is being served: the server's scheduler owns its engine (every slot); "
                                 "load a second Model for direct calls")

    def _forward(self, tokens: Sequence[int], start: int, slot: int, all_logits: bool = False) -> np.ndarray:
        with self._engine_lock:
            self._check_served()
            if self._rows is not None and not all_logits:
                return self.engine.forward(tokens, start, False, slot=slot, out=self._rows[slot])
            return self.engine.forward(tokens, start, all_logits, slot=slot)

    def _forward_batch(self, seqs: Sequence[tuple[int, Sequence[int], int]],
                       tails: Sequence[int] | None = None) -> np.ndarray:
        with self._engine_lock:
            self._check_served()
            if tails is None:
                return self.engine.forward_batch(seqs)
            return self.engine.forward_batch(seqs, tails)

    def _copy_prefix(self, src: int, dst: int, n: int) -> bool:
        copy = getattr(self.engine, "copy_prefix", None)
        if copy is None:
            return False
        with self._engine_lock:
            self._check_served()
            copy(src, dst, n)
        return True

    def serving(self, served: bool) -> None:
        """A server takes the engine (True) or gives it back (False). Meanwhile this Model's own calls are
        refused; either way what the slots held is forgotten (the server writes there)."""
        with self._cond:
            if served and any(self._table.busy):
                raise InvalidRequest("this Model has unfinished generations (open streams?); finish them before "
                                     "serving it")
            self._served = bool(served)
            self._table.forget()
            self._cond.notify_all()

    def reset(self) -> None:
        """Forgets what the free slots' caches hold (the next call feeds its whole prompt)."""
        with self._cond:
            for s in self._table.free():
                self._table.forget(s)

    # --- scoring --------------------------------------------------------------------------------

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Next-token logits after every prefix of ids: float32 [len(ids), n_vocab]."""
        ids = [int(t) for t in ids]
        self._check_ids(ids)
        if not ids:
            raise InvalidRequest("logits needs at least one token")
        if len(ids) > self.n_ctx:
            raise InvalidRequest(f"{len(ids)} tokens do not fit the context of {self.n_ctx}")
        [(slot, _)] = self._acquire(1, ids)
        try:
            with self._cond:
                self._table.forget(slot)
            out = self._forward(ids, 0, slot, all_logits=True)
            with self._cond:
                self._table.tokens[slot] = list(ids)
        finally:
            self._release([slot])
        return np.array(out, copy=True)

    # --- embeddings -----------------------------------------------------------------------------

    @property
    def pooling(self) -> str:
        """How embed() pools a text's hidden states by default: the file's {arch}.pooling_type when it names
        mean or last-token pooling (embedding models' GGUF files carry it), else "mean" (generative models
        have no trained pooling; the mean of the final hidden states separates meanings better than the last
        token's state, which is tuned to predict the next token)."""
        kind = self.metadata.get(f"{self.config.arch}.pooling_type")
        return {3: "last"}.get(kind, "mean") if isinstance(kind, int) else "mean"

    def embed_ids(self, inputs: Sequence[str | Sequence[int]]) -> list[list[int]]:
        """The token ids embed() feeds for each input: a text tokenized with the model's BOS rule, or ids as
        given; each must hold at least one token and fit the context."""
        if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
            raise InvalidRequest("embed takes a list of texts (or of token-id lists)")
        out = []
        for i, x in enumerate(inputs):
            ids = self.tokenize(x) if isinstance(x, str) else [int(t) if isinstance(t, (int, np.integer))
                                                                and not isinstance(t, bool) else t for t in x]
            self._check_ids(ids)
            if not ids:
                raise InvalidRequest(f"input {i} is empty (it has no tokens)")
            if len(ids) > self.n_ctx:
                raise InvalidRequest(f"input {i} has {len(ids)} tokens; the context holds {self.n_ctx}")
            out.append(ids)
        return out

    def embed(self, texts: str | Sequence[str | Sequence[int]], *, pooling: str | None = None,
              normalize: bool = True) -> np.ndarray:
        """Embeddings of texts (or token-id lists): float32 [len(texts), dim] (a single text: [dim]).

        Each is the model's final normed hidden states (what its logits are made from) pooled over the text:
        pooling "mean" (every token; the default, see `pooling`) or "last" (the last token's), then
        L2-normalised (normalize=False keeps the raw pooled vector). Texts run side by side in the free
        slots; each embedding is bit-identical however the texts are batched (native engine)."""
        one = isinstance(texts, str)
        ids = self.embed_ids([texts] if one else texts)
        pooling = pooling or self.pooling
        if pooling not in ("mean", "last"):
            raise InvalidRequest(f'pooling must be "mean" or "last", got {pooling!r}')
        out = np.empty((len(ids), self.config.dim), np.float32)
        if not ids:
            return out
        hidden = getattr(self.engine, "hidden_batch", None)
        if hidden is None:
            raise InvalidRequest(f"the {self.engine_name} engine cannot return hidden states")
        slots = [s for s, _ in self._acquire_any(min(len(ids), self.slots), ids[0])]
        try:
            for g in range(0, len(ids), len(slots)):
                group = ids[g:g + len(slots)]
                with self._engine_lock:
                    self._check_served()
                    rows = hidden([(slot, t, 0) for slot, t in zip(slots, group, strict=False)],
                                  last_only=pooling == "last")
                with self._cond:
                    for slot in slots:
                        self._table.forget(slot)   # the cache holds the embedded text now, not a prompt
                o = 0
                for j, t in enumerate(group):
                    mine = rows[j:j + 1] if pooling == "last" else rows[o:o + len(t)]
                    out[g + j] = pooled(mine, pooling, normalize)
                    o += len(t)
        finally:
            self._release(slots)
        return out[0] if one else out

    def _acquire_any(self, n: int, prompt: Sequence[int]) -> list[tuple[int, int]]:
        """Up to n free slots (at least one, waiting for it as _acquire does)."""
        with self._cond:
            self._check_served()
            free = len(self._table.free())
        return self._acquire(max(1, min(n, free)) if free else 1, prompt)

    # --- generation -----------------------------------------------------------------------------

    def _request(self, kw: dict[str, Any]) -> _Request:
        kw = dict(kw)
        max_tokens = kw.pop("max_tokens", DEFAULT_MAX_TOKENS)
        stop = kw.pop("stop", None)
        n = kw.pop("n", 1)
        logprobs = kw.pop("logprobs", False)
        top = kw.pop("top_logprobs", None)
        allowed = kw.pop("allowed_tokens", None)
        timings = kw.pop("timings", None)
        min_indent = kw.pop("min_indent", 0)
        draft = kw.pop("draft", True)
        constraint = {k: kw.pop(k) for k in ("json_schema", "grammar", "regex") if kw.get(k) is not None}
        for k in ("json_schema", "grammar", "regex"):
            kw.pop(k, None)
        unknown = set(kw) - set(SamplingParams.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(f"unknown generation parameter(s): {', '.join(sorted(unknown))}")
        params = SamplingParams().with_(**{k: v for k, v in kw.items() if k != "seed"})
        params = SamplingParams(**{**params.__dict__, "seed": kw.get("seed")}).validated()
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 0):
            raise InvalidRequest(f"max_tokens must be an integer >= 0 or None (no limit), got {max_tokens!r}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequest(f"n must be an integer >= 1, got {n!r}")
        if stop is None:
            stops: list[str] = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stops = list(stop)
        else:
            raise InvalidRequest("stop must be a string or a list of strings")
        if not isinstance(logprobs, bool):
            raise InvalidRequest(f"logprobs must be True or False, got {logprobs!r}")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool)
                                or not 0 <= top <= self.config.n_vocab):
            raise InvalidRequest(f"top_logprobs must be an integer in 0..{self.config.n_vocab}, got {top!r}")
        top_logprobs = top if top else (0 if logprobs else None)
        if params.logit_bias:
            bad = [k for k in params.logit_bias if not 0 <= int(k) < self.config.n_vocab]
            if bad:
                raise InvalidRequest(f"logit_bias token id {bad[0]} is outside the vocabulary "
                                     f"(0..{self.config.n_vocab - 1})")
        if allowed is not None and not callable(allowed):
            allowed = np.ascontiguousarray(allowed, dtype=np.uint32).reshape(-1)
            if allowed.shape[0] < (self.config.n_vocab + 31) // 32:
                raise InvalidRequest(f"allowed_tokens must be a uint32 bitmask of {(self.config.n_vocab + 31) // 32} "
                                     f"words (one bit per token), got {allowed.shape[0]}")
        if timings is not None and not isinstance(timings, Timings):
            raise InvalidRequest("timings must be a barellm.generation.Timings")
        if not isinstance(min_indent, int) or isinstance(min_indent, bool) or min_indent < 0:
            raise InvalidRequest(f"min_indent must be an integer >= 0, got {min_indent!r}")
        if not isinstance(draft, bool):
            raise InvalidRequest(f"draft must be True or False (speculative decoding on or off), got {draft!r}")
        grammar = None
        if constraint:
            if allowed is not None:
                raise InvalidRequest(f"allowed_tokens and {next(iter(constraint))} both constrain the output: give one")
            grammar = self.structured().from_options(**constraint)
        return _Request(params, max_tokens, [s for s in stops if s], n, top_logprobs, allowed, timings, grammar,
                        min_indent, draft)

    def _mask_thread(self) -> bool:
        from barellm.structured import spare_core

        return spare_core(self.threads)

    def structured(self) -> Any:
        """The model's structured.Vocabulary (llguidance's view of its tokenizer; built on first use):
        compiles JSON schemas, regexes and grammars into constraints for this model."""
        from barellm.structured import vocabulary

        return vocabulary(self, self.tokenizer, self.config.n_vocab)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
        elif isinstance(prompt, Sequence):
            ids = [int(t) if isinstance(t, (int, np.integer)) and not isinstance(t, bool) else t for t in prompt]
        else:
            raise InvalidRequest(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        self._check_ids(ids)
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if len(ids) >= self.n_ctx:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; the context holds {self.n_ctx}")
        return ids

    def _run(self, ids: list[int], req: _Request, c: Completion) -> Iterator[tuple[int, Delta]]:
        """The token loop of req.n choices of one prompt: yields (choice, what became visible)."""
        n = req.n
        timings = c.timings = req.timings if req.timings is not None else Timings()
        c.prompt_tokens = len(ids)
        gens = [Generation(ids, self.tokenizer, params=req.params_for(i), max_tokens=req.max_tokens, n_ctx=self.n_ctx,
                           stops=req.stops, top_logprobs=req.top_logprobs, allowed=req.allowed,
                           n_vocab=self.config.n_vocab, timings=timings,
                           guide=req.grammar.guide(self._mask_thread()) if req.grammar is not None else None,
                           min_indent=req.min_indent) for i in range(n)]
        c.choices = [Choice(i) for i in range(n)]
        for ch, g in zip(c.choices, gens, strict=True):
            ch.token_ids = g.generated    # every generated token, filled as they come
        if gens[0].done:   # max_tokens=0: nothing to compute
            return
        clock = time.perf_counter
        slots = self._acquire(n, ids)
        t_start = clock()
        try:
            (main, c.cached_tokens), others = slots[0], slots[1:]
            executor = timings.seconds["forward"]   # a timed engine (time_engine) adds the prefill's runs: not ours
            rows = [self._forward(ids[c.cached_tokens:], c.cached_tokens, main)[-1]] * n
            table = self._table.tokens
            table[main][:] = ids
            for i, (slot, reuse) in enumerate(others, 1):
                # the other choices start from a copy of the prompt's cache, or prefill it themselves
                if self._copy_prefix(main, slot, len(ids)):
                    table[slot][:] = ids
                else:
                    rows[i] = self._forward(ids[reuse:], reuse, slot)[-1]
                    table[slot][:] = ids
            timings.seconds["forward"] = executor
            t_decode = clock()
            c.prefill_seconds = t_decode - t_start
            live = list(range(n))
            which = [s for s, _ in slots]
            spec = self.speculator.session() if self.speculator is not None and req.draft else None
            while True:
                for i in live:
                    for d in (spec.verify(which[i], gens[i], rows[i], table[which[i]]) if spec is not None
                              else (gens[i].step(rows[i]),)):
                        if d is not None:
                            yield i, d
                for i in live:
                    if gens[i].done:
                        c.choices[i].finish_reason = gens[i].finish_reason or "length"
                live = [i for i in live if not gens[i].done]
                if not live:
                    break
                feeds = ([[gens[i].next_token] for i in live] if spec is None else
                         spec.plan([(which[i], gens[i], True) for i in live]))
                t0 = clock()
                if len(live) == 1 and len(feeds[0]) == 1:
                    g = gens[live[0]]
                    rows[live[0]] = self._forward((g.next_token,), g.position, which[live[0]])[0]
                elif all(len(f) == 1 for f in feeds):
                    out = self._forward_batch([(which[i], (gens[i].next_token,), gens[i].position) for i in live])
                    for j, i in enumerate(live):
                        rows[i] = out[j]
                else:   # drafted tokens: every fed token's logits, to check the draft against
                    out = self._forward_batch([(which[i], f, gens[i].position)
                                               for i, f in zip(live, feeds, strict=True)], [len(f) for f in feeds])
                    ends = np.cumsum([len(f) for f in feeds]).tolist()
                    for i, f, end in zip(live, feeds, ends, strict=True):
                        rows[i] = out[end - len(f):end]
                dt = clock() - t0
                timings.engine += dt
                if spec is not None:
                    spec.measured(sum(len(f) for f in feeds), dt)
                for i in live:   # the drafted tokens join the record once verify accepts them
                    table[which[i]].append(gens[i].next_token)
        finally:
            t_end = clock()
            c.decode_seconds = max(0.0, t_end - t_start - c.prefill_seconds)
            timings.wall += c.decode_seconds
            self._release([s for s, _ in slots])

    def complete(self, prompt: str | Sequence[int], **kw: Any) -> Completion:
        """Like generate() but returns the whole Completion (ids, finish reason, counts, timings, and with
        logprobs / top_logprobs the log-probabilities; with n > 1 every choice in .choices)."""
        req = self._request(kw)
        ids = self._prompt_ids(prompt)
        return self._complete(ids, req)

    def _complete(self, ids: list[int], req: _Request) -> Completion:
        c = Completion()
        texts: list[list[str]] = [[] for _ in range(req.n)]
        lps: list[list[TokenLogprob]] = [[] for _ in range(req.n)]
        for i, d in self._run(ids, req, c):
            texts[i].append(d.text)
            lps[i].extend(d.logprobs)
        for ch in c.choices:
            ch.text = "".join(texts[ch.index])
            ch.logprobs = lps[ch.index] if req.top_logprobs is not None else None
        first = c.choices[0]
        c.text, c.token_ids, c.finish_reason, c.logprobs = first.text, first.token_ids, first.finish_reason, \
            first.logprobs
        return c

    def generate(self, prompt: str | Sequence[int], **kw: Any) -> str:
        """The continuation of prompt. Keywords: max_tokens (default None: until the end of generation or the
        context is full; finish_reason "length" says a limit ended it), temperature (0.8; 0 = greedy),
        top_k, top_p, min_p, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty,
        logit_bias ({token id: bias}, OpenAI's: added to the logit, -100 bans), seed, stop (a string or
        list of strings, not included in the text), allowed_tokens (a uint32 bitmask over the vocabulary,
        or a function of the generated ids returning one: only those tokens may be chosen).
        Constrained output (the barellm[structured] extra; one of): json_schema (a JSON schema, dict or
        text: the output is one JSON value valid against it), regex (the output matches it as a whole),
        grammar (llguidance's Lark dialect or llama.cpp's GBNF)."""
        return self.complete(prompt, **kw).text

    def stream(self, prompt: str | Sequence[int], **kw: Any) -> Stream:
        """generate() as it happens: yields text pieces (whole UTF-8 characters) as they come; once it is
        exhausted its finish_reason says why it ended (see Stream). The stream holds a KV cache slot from its
        first piece until it is exhausted, closed or dropped."""
        req = self._request(kw)
        if req.n != 1:
            raise InvalidRequest("stream() generates one sequence; use complete(..., n=...) for several")
        return self._stream(self._prompt_ids(prompt), req)

    def _stream(self, ids: list[int], req: _Request) -> Stream:
        c = Completion()
        return Stream(self._pieces(ids, req, c), c)

    def _pieces(self, ids: list[int], req: _Request, c: Completion) -> Iterator[str]:
        for _, d in self._run(ids, req, c):
            if d.text:
                yield d.text

    # --- fill-in-the-middle ----------------------------------------------------------------------

    @property
    def fim(self) -> Any:
        """The model's fill-in-the-middle tokens (text/infill.py FimTokens), or None when it has none."""
        if not hasattr(self, "_fim"):
            from barellm.text.infill import fim_tokens

            self._fim = fim_tokens(self.metadata, self.tokenizer)
        return self._fim

    def infill_prompt(self, prefix: str, suffix: str, *, extra: Sequence[dict[str, str]] = (), prompt: str = "",
                      max_tokens: int | None = None, repo_level: bool = True) -> list[int]:
        """The token ids of a fill-in-the-middle prompt: the model's FIM markers around prefix and suffix, other
        files (extra: [{"filename", "text"}]) before them as repository context: llama.cpp server's /infill
        layout (text/infill.py), whose repository and file lines are written even without other files (when the
        model has those tokens); repo_level=False gives the bare prefix-suffix-middle form instead. Cut to leave
        max_tokens (default: a quarter of the context, at most 256)."""
        from barellm.text.infill import infill_ids

        fim = self.fim
        if fim is None:
            raise InvalidRequest(f"{self.path.name} has no fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, "
                                 "<|fim_middle|> or their kin): this model cannot infill")
        n_predict = max_tokens if max_tokens is not None and max_tokens > 0 else min(256, self.n_ctx // 4)
        return infill_ids(self.tokenizer, fim, prefix, suffix, extra=extra, prompt=prompt, n_ctx=self.n_ctx,
                          n_predict=n_predict, repo_level=repo_level)

    def infill(self, prefix: str, suffix: str, *, extra: Sequence[dict[str, str]] = (), prompt: str = "",
               **kw: Any) -> str:
        """The code that fills the hole between prefix and suffix (a FIM-trained model: Qwen2.5-Coder, ...).
        extra: other files as context, [{"filename": ..., "text": ...}]; keywords as generate(). Besides the
        model's end token, the fill ends before a line that repeats the suffix's first line and before a line
        indented less than the hole's (text/infill.py end_rules; min_indent=0 turns that one off)."""
        return self.complete_infill(prefix, suffix, extra=extra, prompt=prompt, **kw).text

    def complete_infill(self, prefix: str, suffix: str, *, extra: Sequence[dict[str, str]] = (), prompt: str = "",
                        **kw: Any) -> Completion:
        """infill() as a whole Completion (token ids, finish reason, counts, timings)."""
        kw = self._infill_kw(prefix + prompt, suffix, kw)
        req = self._request(kw)
        ids = self.infill_prompt(prefix, suffix, extra=extra, prompt=prompt, max_tokens=req.max_tokens)
        return self._complete(self._prompt_ids(ids), req)

    @staticmethod
    def _infill_kw(before: str, suffix: str, kw: dict[str, Any]) -> dict[str, Any]:
        """kw with the fill's end rules added: stop strings joined to the caller's, min_indent unless given."""
        from barellm.text.infill import end_rules

        stops, indent = end_rules(before, suffix)
        given = kw.get("stop")
        mine = [given] if isinstance(given, str) else list(given) if isinstance(given, (list, tuple)) else []
        if given is not None and not mine and not isinstance(given, (list, tuple)):
            return kw   # a malformed stop: _request names it
        return {**kw, "stop": mine + stops, "min_indent": kw.get("min_indent", indent)}

    # --- chat -----------------------------------------------------------------------------------

    def chat_prompt(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered chat template (special tokens parsed, no extra BOS). tools: OpenAI's
        tool objects, rendered by the template when it knows tools, else in the built-in form
        (text/tools.py); assistant messages with tool_calls and tool messages render either way."""
        from barellm.text.tools import prepare_messages, validate_tools

        msgs: list[Any] = list(messages)
        extra: dict[str, Any] = {}
        if tools or any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in msgs):
            if all(isinstance(m, dict) for m in msgs):
                msgs, extra = prepare_messages(msgs, validate_tools(tools) if tools else None, self.tool_format)
        text = self.template.render(msgs, add_generation_prompt=add_generation_prompt, **extra)
        ids = self.tokenizer.encode(text, add_special=False, parse_special=True)
        bos = self.tokenizer.bos_id
        if self.tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids   # the template did not write the BOS the model expects
        return ids

    def chat(self, messages: Sequence[dict[str, Any]], **kw: Any) -> str:
        """The assistant's reply to messages ([{"role": ..., "content": ...}, ...]); a content may be a string
        or OpenAI's text parts ([{"type": "text", "text": ...}, ...])."""
        req = self._request(kw)
        return self._complete(self._prompt_ids(self.chat_prompt(messages)), req).text

    def chat_stream(self, messages: Sequence[dict[str, Any]], **kw: Any) -> Stream:
        req = self._request(kw)
        if req.n != 1:
            raise InvalidRequest("chat_stream() generates one sequence; use complete(..., n=...) for several")
        return self._stream(self._prompt_ids(self.chat_prompt(messages)), req)

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({self.name}, {c.arch}, {c.n_layers} layers, dim {c.dim}, vocab {c.n_vocab}, "
                f"context {self.n_ctx}, engine {self.engine_name}, threads {self.threads})")

    # --- OpenAI's result objects: the dicts the server returns, built by openai_format ---------------

    def create_completion(self, prompt: str | Sequence[int], *, max_tokens: int | None = 16, stream: bool = False,
                          response_format: dict[str, Any] | None = None, suffix: str | None = None,
                          **kw: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """complete() as OpenAI's text_completion object (id, object, created, model, choices[0].text and
        finish_reason, usage), as llama-cpp-python's method of this name returns it; stream=True yields the
        chunk objects as they come. max_tokens None: the rest of the context; other keywords as generate()."""
        constraint = self.structured().response_format(response_format) if response_format is not None else None
        if suffix:   # fill-in-the-middle: prompt is the text before the hole
            if not isinstance(prompt, str):
                raise InvalidRequest("suffix needs a string prompt (the text before the hole)")
            ids = self.infill_prompt(prompt, suffix, max_tokens=max_tokens, repo_level=False)
            return self._openai(ids, False, max_tokens, stream, self._infill_kw(prompt, suffix, kw), constraint,
                                prompt_chars=len(prompt))
        return self._openai(self._prompt_ids(prompt), False, max_tokens, stream, kw, constraint,
                            prompt_chars=len(prompt) if isinstance(prompt, str) else 0)

    @property
    def tool_format(self) -> Any:
        """How this model meets tools (text/tools.py): its template's own rendering or the built-in form."""
        from barellm.text.tools import tool_format

        fmt = getattr(self, "_tool_format", None)
        if fmt is None:
            fmt = self._tool_format = tool_format(self.template.source, self.tokenizer)
        return fmt

    def tool_grammar(self, tools: Sequence[dict[str, Any]], mode: str, name: str | None = None,
                     parallel: bool = True) -> Any:
        """The constraint of tool_choice "required" (mode "required") or a named function (mode "function"):
        output that is tool calls only, with arguments valid for the function's schema, ending with the
        turn's calls (the model, not the mask, decides whether another call follows one)."""
        from barellm.text.tools import call_grammar, validate_tools

        src = call_grammar(validate_tools(tools), self.tool_format, name if mode == "function" else None,
                           parallel and mode == "required")
        return self.structured().lark(src, "tool_choice", end_on_exit=True)

    def create_chat_completion(self, messages: Sequence[dict[str, Any]], *, max_tokens: int | None = None,
                               stream: bool = False, tools: Sequence[dict[str, Any]] | None = None,
                               tool_choice: Any = None, parallel_tool_calls: bool = True,
                               response_format: dict[str, Any] | None = None,
                               **kw: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """chat() as OpenAI's chat.completion object (choices[0].message), or with stream=True its
        chat.completion.chunk objects. max_tokens None: the rest of the context.

        tools, tool_choice ("auto" by default with tools; "none", "required", {"type": "function",
        "function": {"name": ...}}), parallel_tool_calls: OpenAI's; the model's calls come back as
        message.tool_calls (streamed: delta.tool_calls) with finish_reason "tool_calls". "required" and a
        named function constrain the output to calls whose arguments fit the function's schema.
        response_format: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}."""
        from barellm.text.tools import resolve_choice, validate_tools

        tools = validate_tools(tools) if tools else None
        mode, fn = resolve_choice(tools, tool_choice)
        constraint = None
        if response_format is not None:
            constraint = self.structured().response_format(response_format)
        if mode in ("required", "function"):
            if constraint is not None or any(kw.get(k) is not None for k in ("json_schema", "grammar", "regex")):
                raise InvalidRequest(f"tool_choice {mode!r} constrains the output to tool calls; it cannot be "
                                     "combined with response_format, json_schema, grammar or regex")
            assert tools is not None
            constraint = self.tool_grammar(tools, mode, fn, parallel_tool_calls)
        ids = self.chat_prompt(messages, tools=tools if mode != "none" else None)
        names = [t["function"]["name"] for t in tools] if tools and mode != "none" else None
        return self._openai(ids, True, max_tokens, stream, kw, constraint, tool_names=names)

    def _openai(self, ids: list[int], chat: bool, max_tokens: int | None, stream: bool, kw: dict[str, Any],
                constraint: Any = None, tool_names: Sequence[str] | None = None, prompt_chars: int = 0
                ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        from barellm import openai_format as fmt

        if "timings" in kw:
            raise InvalidRequest("unknown generation parameter here: timings (complete() takes it)")
        kw = dict(kw)
        if chat:   # OpenAI's chat shape: logprobs a flag, top_logprobs the count
            logprobs, top = kw.pop("logprobs", False), kw.pop("top_logprobs", None)
            if not isinstance(logprobs, bool):
                raise InvalidRequest(f"logprobs must be True or False here, got {logprobs!r}")
            if top is not None and not logprobs:
                raise InvalidRequest("top_logprobs needs logprobs=True")
            if logprobs:
                kw["top_logprobs"] = top or 0
        else:      # the legacy completions shape: logprobs is the count
            if "top_logprobs" in kw:
                raise InvalidRequest("create_completion takes logprobs=k (the alternatives per token)")
            k = kw.pop("logprobs", None)
            if k is not None:
                if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 20:
                    raise InvalidRequest(f"logprobs must be an integer in 0..20, got {k!r}")
                kw["top_logprobs"] = k
        kw["max_tokens"] = max(self.n_ctx - len(ids), 0) if max_tokens is None else max_tokens
        req = self._request(kw)   # a bad keyword fails here, not at a stream's first next()
        if constraint is not None:
            if req.grammar is not None or req.allowed is not None:
                raise InvalidRequest("response_format and json_schema / grammar / regex / allowed_tokens both "
                                     "constrain the output: give one")
            req.grammar = constraint
        ids = self._prompt_ids(ids)
        rid, name = fmt.new_id(chat), self.name
        if stream:
            return self._openai_chunks(ids, chat, req, rid, name, tool_names, prompt_chars)
        c = self._complete(ids, req)
        usage = fmt.usage(c.prompt_tokens, sum(len(ch.token_ids) for ch in c.choices), c.cached_tokens)
        token_bytes = self.tokenizer.token_bytes
        body: dict[str, Any] | None = None
        for ch in c.choices:
            lps = None
            if ch.logprobs is not None:
                lps = (fmt.chat_logprobs(ch.logprobs, token_bytes) if chat else
                       fmt.completion_logprobs(ch.logprobs, token_bytes, prompt_chars)[0])
            if not chat:
                one = fmt.text_completion(rid, name, ch.text, ch.finish_reason, usage, logprobs=lps)
            else:
                content: str | None = ch.text
                calls, reason = None, ch.finish_reason
                if tool_names is not None:
                    from barellm.text.tools import parse_tool_calls

                    parsed, calls = parse_tool_calls(ch.text, tool_names)
                    if calls:
                        content = parsed
                        reason = "tool_calls" if reason == "stop" else reason
                one = fmt.chat_completion(rid, name, content, reason, usage, logprobs=lps, tool_calls=calls)
            if body is None:
                body = one
            else:
                body["choices"].append({**one["choices"][0], "index": ch.index})
        assert body is not None
        return body

    def _openai_chunks(self, ids: list[int], chat: bool, req: _Request, rid: str, name: str,
                       tool_names: Sequence[str] | None = None, prompt_chars: int = 0) -> Iterator[dict[str, Any]]:
        from barellm import openai_format as fmt
        from barellm.text.tools import ToolCallStream

        created = int(time.time())
        c = Completion()
        token_bytes = self.tokenizer.token_bytes
        calls = [ToolCallStream(tool_names) for _ in range(req.n)] if tool_names is not None else None
        offsets = [prompt_chars] * req.n

        def indexed(chunk: dict[str, Any], i: int) -> dict[str, Any]:
            chunk["choices"][0]["index"] = i
            return chunk

        def lps_of(d: Delta, i: int) -> dict[str, Any] | None:
            if req.top_logprobs is None:
                return None
            if chat:
                return fmt.chat_logprobs(d.logprobs, token_bytes)
            out, offsets[i] = fmt.completion_logprobs(d.logprobs, token_bytes, offsets[i])
            return out

        def pieces(i: int, parts: list[tuple[str, Any]], lps: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
            assert calls is not None
            for kind, p in parts:
                if kind == "content":
                    yield indexed(fmt.chat_chunk(rid, name, text=p, logprobs=lps, created=created), i)
                else:
                    deltas = fmt.tool_call_deltas([p], calls[i].sent)
                    calls[i].sent += 1
                    yield indexed(fmt.chat_chunk(rid, name, tool_calls=deltas, logprobs=lps, created=created), i)
                lps = None

        if chat:
            for i in range(req.n):
                yield indexed(fmt.chat_chunk(rid, name, role=True, created=created), i)
        for i, d in self._run(ids, req, c):
            if not d.text and not d.logprobs:
                continue
            lps = lps_of(d, i)
            if calls is not None:
                yield from pieces(i, calls[i].feed(d.text), lps)
            elif chat:
                yield indexed(fmt.chat_chunk(rid, name, text=d.text, logprobs=lps, created=created), i)
            else:
                yield indexed(fmt.text_chunk(rid, name, text=d.text, logprobs=lps, created=created), i)
        for ch in c.choices:
            reason = ch.finish_reason
            if calls is not None:
                yield from pieces(ch.index, calls[ch.index].finish(), None)
                if calls[ch.index].calls and reason == "stop":
                    reason = "tool_calls"
            yield indexed(fmt.chat_chunk(rid, name, finish_reason=reason, created=created) if chat
                          else fmt.text_chunk(rid, name, finish_reason=reason, created=created), ch.index)


def load(model: str | os.PathLike[str] | None = None, *, threads: int | None = None, context: int | None = None,
         engine: str = "auto", chat_template: str | None = None, slots: int = 1,
         activations: str = "q8x2", kv_type: str | None = None, verify: bool = False,
         draft: str | os.PathLike[str] | None = None) -> Model:
    """Loads a model by name ("smollm2-135m", pulled on first use) or path.

    threads: worker threads (default: physical cores); context: KV cache size in tokens;
    engine: "native" (the C core), "reference" (NumPy float32, slow, exact) or "auto" (the default: native
    where it runs the model, else reference with a warning);
    chat_template: a built-in template name to use instead of the file's;
    slots: independent KV caches: generations (streams, threads, the n choices of one call) that may be under
    way at once; a server serves that many sequences side by side;
    activations: the native engine's activation precision in the quantized matmuls: "q8x2" (the default,
    ~15 bits: logits within a mean KL of 0.0002 of the float reference on SmolLM2) or "q8" (8-bit blocks as
    llama.cpp uses: ~1.6x faster prefill, KL ~0.003);
    kv_type: what the KV cache holds: "f16" (the native engine's default), "q8_0" (ggml's 8-bit blocks of 32
    with an f16 scale: 53% of f16's memory; head_dim a multiple of 32) or "f32"; the reference engine keeps
    float32 and rounds K and V to what the type would hold (exact f32 by default);
    verify: check every tensor of the model file against its checksum before running it (every load checks
    a sample of them);
    draft: speculative decoding (the output stays exactly what plain decoding gives): "lookup" drafts from
    the prompt and the text so far (what a code edit repeats), a model name or path drafts with that smaller
    model, which must share this model's vocabulary (e.g. "qwen2.5-coder-0.5b" for "qwen2.5-coder-1.5b");
    drafting turns itself off where it does not pay. A generation's draft=False turns it off for that call.
    """
    from barellm import catalog

    path = catalog.resolve(model)
    try:
        return Model(path, threads=threads, context=context, engine=engine, chat_template=chat_template,
                     slots=slots, activations=activations, kv_type=kv_type, verify=verify, draft=draft)
    except BarellmError:
        raise
    except (OSError, MemoryError) as e:
        raise BarellmError(f"{path}: cannot load: {e}") from e
