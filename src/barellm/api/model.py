"""The public face: load a model by name or path, then tokenize, score, generate, stream and chat.

Model is thin: the tokenizer turns text into ids, an engine turns ids into logits, and the model's
Scheduler (generate/scheduler.py, the one the server runs) feeds every generation's prompt and tokens
through the engine in shared forward passes, its Generation (generation.py: sampling, stop strings, limits,
the text held back for them, logprobs) deciding each next token and what text it makes. A method turns its
keywords into a Request (generate/request.py), holds it to the model's limits with the check every front
end makes, and runs the scheduler's rounds from the calling thread until its result is in. The KV cache
slots are the scheduler's and persist between calls, so a prompt that starts with what a slot already holds
is only fed from where it differs.

Sharing a Model: every generation owns a KV cache slot from its first token to its end (a stream: until it
is exhausted, closed or dropped; between two of its pieces it waits, holding it). `load(..., slots=N)` gives
N slots. A generation that finds no free slot waits for one while other threads hold them; when the only
holders are unfinished generations of its own thread (an open stream), waiting could never end, so it raises
SlotsBusy instead. Generations of several threads run side by side, one thread at a time running the rounds
that advance them all.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from barellm.api.chatting import Chats, split_reasoning
from barellm.api.completion import Completion, Stream, filled
from barellm.api.openai import OpenAIFacade, model_method
from barellm.arch.config import ModelConfig, config_of
from barellm.cpu import default_threads
from barellm.errors import BarellmError, FormatError, InvalidRequest, SlotsBusy
from barellm.generate.request import Event, Options, Request, check, from_options, takes_options
from barellm.generate.scheduler import UNBOUNDED, EmbedJob, Scheduler

if TYPE_CHECKING:
    from typing_extensions import Unpack

ENGINES = ("auto", "native", "reference")
ACTIVATIONS = ("q8x2", "q8")  # the native engine's activation precisions (engine.ACTIVATIONS)
KV_TYPES = ("f16", "q8_0", "f32")  # what the KV cache holds (runtime/kv_cache.py's KV_TYPES)


def _nowhere(ev: Event) -> None:
    pass


class Model:
    """A loaded model: tokenize, score (logits), generate, stream, chat.

    Safe to share between threads (see the module docstring): each generation holds its own KV cache slot;
    with one slot (the default) generations from several threads run one after another, with slots=N up to
    N at once. An unfinished stream keeps its slot until it ends, is closed or is dropped.

    The generation methods take Options' keywords (generate/request.py: max_tokens, temperature, top_k, ...),
    listed with their types and defaults in each method's signature; the OpenAI-shaped ones (create_completion,
    create_chat_completion) are its OpenAIFacade's (`model.openai`, api/openai.py), offered as its own.
    """

    def __init__(self, path: Path, *, threads: int | None = None, context: int | None = None,
                 engine: str = "auto", chat_template: str | None = None, slots: int = 1,
                 activations: str = "q8x2", kv_type: str | None = None, verify: bool = False,
                 draft: str | os.PathLike[str] | None = None, defaults: Mapping[str, Any] | None = None) -> None:
        from barellm.api.drafting import speculator
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
        from barellm.store.catalog import display_name
        from barellm.store.converted import open_model

        self.path = path
        self.name = display_name(path)   # what messages print: a registered or file name, never a cache hash
        self.source = open_model(path, verify=verify)
        md = self.source.metadata
        self.metadata: dict[str, Any] = md
        self.config: ModelConfig = config_of(self.source)
        # defaults: what the model's source states (an Ollama model's params): generation options a call
        # leaves out, and `context` for the context size when none is given
        self.defaults: dict[str, Any] = dict(defaults or {})
        stated_ctx = self.defaults.pop("context", None)
        n_ctx = context or min(self.config.context_length,
                               stated_ctx if isinstance(stated_ctx, int) and stated_ctx >= 16 else 4096)
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
        # the one scheduler of this model's engine: the Python API runs its rounds from the calling threads,
        # a server from its own thread (serving()); its clock times the prefill and decode of a Completion.
        # With draft, its step decodes speculatively (prompt lookup or a draft model: api/drafting.py)
        self.scheduler = Scheduler(self.engine, self.tokenizer, n_ctx=self.n_ctx, max_queue=UNBOUNDED,
                                   clock=time.perf_counter, speculator=speculator(draft, self))
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}   # thread id -> slots its unfinished generations hold or wait for
        self._served = False              # a server runs the scheduler (see serving())
        self.system: str | None = None    # a preset's system prompt: chat_prompt() starts a chat with it
        self.chats = Chats(self)          # its chats' prompts, reasoning format and requests (api/chatting.py)

    def _make_engine(self, engine: str) -> tuple[str, Any]:
        if engine in ("auto", "native"):
            from barellm.runtime.engine import NativeEngine, NativeUnsupported, unsupported_reason

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

    # --- the scheduler: every generation, scoring and embedding goes through it -----------------

    @property
    def speculator(self) -> Any:
        """How this model drafts (generate/speculative/ Speculator: .kind "lookup" or "model", .name), or None:
        what load(..., draft=...) asked for, which the scheduler's step runs."""
        return self.scheduler.speculator

    @property
    def stats(self) -> Any:
        """The scheduler's counters (generate/stats.py): tokens, steps, time to first token."""
        return self.scheduler.metrics

    def serving(self, served: bool) -> None:
        """A server takes the scheduler (True: its own thread runs it from now on) or gives it back (False).
        Meanwhile this Model's own calls are refused; what the slots hold stays known to the scheduler, so a
        call afterwards reuses only what is still there."""
        with self._lock:
            if served and self._held:
                raise InvalidRequest("this Model has unfinished generations (open streams?); finish them before "
                                     "serving it")
            self._served = bool(served)
        if not served:
            self.scheduler.configure(max_queue=UNBOUNDED)

    def _check_served(self) -> None:
        if self._served:
            raise InvalidRequest("this Model is being served: the server's scheduler owns its engine (every slot); "
                                 "load a second Model for direct calls")

    def reset(self) -> None:
        """Forgets what the free slots' caches hold (the next call feeds its whole prompt)."""
        self._check_served()
        self.scheduler.forget_free()

    def _events(self, job: Request | EmbedJob, pause: bool = False) -> Iterator[Event]:
        """Submits job and yields its events as the scheduler's rounds make them: rounds this thread runs, or
        another thread waiting on its own request (one round advances every live sequence). pause: the
        request waits, holding its slots, while its reader is away (between two of a stream's pieces). An
        error event raises; a job still running when this generator is closed or dropped is cancelled.

        A job that would wait for slots that only unfinished generations of this thread hold (open streams)
        could wait forever: SlotsBusy instead."""
        self._check_served()
        events: deque[Event] = deque()
        job.emit = events.append
        sched = self.scheduler
        me = threading.get_ident()
        with self._lock:
            held = self._held.get(me, 0)
            if held and self.slots - held < job.n:
                raise SlotsBusy(
                    f"all {self.slots} KV cache slot(s) of this Model are held by unfinished generations of this "
                    f"thread (an open stream?): finish or close them first, or load the model with more slots "
                    f"(barellm.load(..., slots=N))")
            self._held[me] = held + job.n
        try:
            sched.submit(job)

            def ready() -> bool:
                return bool(events) or job.done

            while True:
                if not events:
                    job.paused = False
                    sched.run_until(ready)
                    if not events:
                        return
                ev = events.popleft()
                if ev.kind == "error":
                    raise BarellmError(ev.message)
                if pause:
                    job.paused = True
                yield ev
        finally:
            with self._lock:
                left = self._held[me] - job.n
                if left:
                    self._held[me] = left
                else:
                    del self._held[me]
            if not job.done:
                sched.cancel(job)

    # --- scoring --------------------------------------------------------------------------------

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Next-token logits after every prefix of ids: float32 [len(ids), n_vocab]."""
        ids = [int(t) if isinstance(t, (int, np.integer)) and not isinstance(t, bool) else t for t in ids]
        self._check_ids(ids)
        if not ids:
            raise InvalidRequest("logits needs at least one token")
        if len(ids) > self.n_ctx:
            raise InvalidRequest(f"{len(ids)} tokens do not fit the context of {self.n_ctx}")
        for ev in self._events(EmbedJob([ids], _nowhere, logits=True)):
            if ev.kind == "embeddings":
                return np.array(ev.data, copy=True)
        raise BarellmError("the scoring job ended without its logits")

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
        L2-normalised (normalize=False keeps the raw pooled vector). Each embedding is bit-identical however
        the texts are batched or cut into chunks (native engine)."""
        one = isinstance(texts, str)
        ids = self.embed_ids([texts] if one else texts)
        pooling = pooling or self.pooling
        if pooling not in ("mean", "last"):
            raise InvalidRequest(f'pooling must be "mean" or "last", got {pooling!r}')
        if not ids:
            return np.empty((0, self.config.dim), np.float32)
        if getattr(self.engine, "hidden_batch", None) is None:
            raise InvalidRequest(f"the {self.engine_name} engine cannot return hidden states")
        for ev in self._events(EmbedJob(ids, _nowhere, pooling=pooling, normalize=normalize)):
            if ev.kind == "embeddings":
                return ev.data[0] if one else ev.data
        raise BarellmError("the embedding job ended without its vectors")

    # --- generation -----------------------------------------------------------------------------

    def _request(self, options: dict[str, Any]) -> Request:
        """The Request the keywords ask for (generate/request.py), checked but for its prompt."""
        if self.defaults:
            options = {**self.defaults, **options}
        return from_options(options, lambda **c: self.structured().from_options(**c))

    def structured(self) -> Any:
        """The model's structured.Vocabulary (llguidance's view of its tokenizer; built on first use):
        compiles JSON schemas, regexes and grammars into constraints for this model."""
        from barellm.generate.structured import vocabulary

        return vocabulary(self, self.tokenizer, self.config.n_vocab)

    @property
    def tool_format(self) -> Any:
        """How this model meets tools (text/toolcalls.py): its template's own rendering or the built-in form."""
        from barellm.text.toolcalls import tool_format

        fmt = getattr(self, "_tool_format", None)
        if fmt is None:
            fmt = self._tool_format = tool_format(self.template.source, self.tokenizer)
        return fmt

    def tool_grammar(self, tools: Sequence[dict[str, Any]], mode: str, name: str | None = None,
                     parallel: bool = True) -> Any:
        """The constraint of tool_choice "required" (mode "required") or a named function (mode "function"):
        output that is tool calls only, with arguments valid for the function's schema, ending with the
        turn's calls (the model, not the mask, decides whether another call follows one)."""
        from barellm.text.toolcalls import call_grammar, validate_tools

        src = call_grammar(validate_tools(tools), self.tool_format, name if mode == "function" else None,
                           parallel and mode == "required")
        return self.structured().lark(src, "tool_choice", end_on_exit=True)

    @property
    def openai(self) -> OpenAIFacade:
        """The model's OpenAI-shaped methods (api/openai.py); create_completion and create_chat_completion are
        also its own."""
        return OpenAIFacade(self)

    create_completion = model_method(OpenAIFacade.create_completion)
    create_chat_completion = model_method(OpenAIFacade.create_chat_completion)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        if isinstance(prompt, Sequence):
            return [int(t) if isinstance(t, (int, np.integer)) and not isinstance(t, bool) else t for t in prompt]
        raise InvalidRequest(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _submit(self, ids: list[int], req: Request) -> Request:
        """req with its prompt, held to this model's limits (the one check every front end makes)."""
        req.prompt = ids
        check(req, n_ctx=self.n_ctx, n_vocab=self.config.n_vocab, n_slots=self.slots)
        return req

    def _run(self, req: Request, c: Completion, pause: bool = False) -> Iterator[Event]:
        """req's events, c filled from them as they come (counts, each choice's text, ids, logprobs and finish
        reason, the prefill and decode times); yields the deltas."""
        return filled(c, req, self._events(req, pause))

    def _complete(self, req: Request) -> Completion:
        req.stream = False   # each choice's text in one piece at its end
        c = Completion()
        for _ in self._run(req, c):
            pass
        return c

    @takes_options()
    def complete(self, prompt: str | Sequence[int], **options: Unpack[Options]) -> Completion:
        """Like generate() but returns the whole Completion (ids, finish reason, counts, timings, and with
        logprobs / top_logprobs the log-probabilities; with n > 1 every choice in .choices)."""
        req = self._request(options)
        return self._complete(self._submit(self._prompt_ids(prompt), req))

    @takes_options()
    def generate(self, prompt: str | Sequence[int], **options: Unpack[Options]) -> str:
        """The continuation of prompt. max_tokens (default None: until the end of generation or the context
        is full; finish_reason "length" says a limit ended it), temperature (0.8; 0 = greedy), top_k, top_p,
        min_p, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, logit_bias ({token id:
        bias}, OpenAI's: added to the logit, -100 bans), seed, stop (a string or list of strings, not included
        in the text), allowed_tokens (a uint32 bitmask over the vocabulary, or a function of the generated
        ids returning one: only those tokens may be chosen), draft (False: no speculative decoding for this
        call, where the model drafts: load(..., draft=...); the output is the same either way).
        Constrained output (the barellm[structured] extra; one of): json_schema (a JSON schema, dict or
        text: the output is one JSON value valid against it), regex (the output matches it as a whole),
        grammar (llguidance's Lark dialect or llama.cpp's GBNF)."""
        return self.complete(prompt, **options).text

    @takes_options()
    def stream(self, prompt: str | Sequence[int], **options: Unpack[Options]) -> Stream:
        """generate() as it happens: yields text pieces (whole UTF-8 characters) as they come; once it is
        exhausted its finish_reason says why it ended (see Stream). The stream holds a KV cache slot from its
        first piece until it is exhausted, closed or dropped."""
        req = self._request(options)
        if req.n != 1:
            raise InvalidRequest("stream() generates one sequence; use complete(..., n=...) for several")
        return self._stream(self._submit(self._prompt_ids(prompt), req))

    def _stream(self, req: Request, split: tuple[str, bool] | None = None) -> Stream:
        c = Completion()
        return Stream(self._pieces(req, c, split), c)

    def _pieces(self, req: Request, c: Completion, split: tuple[str, bool] | None = None
                ) -> Iterator[tuple[str, str]]:
        if split is not None:
            yield from split_reasoning(self._run(req, c, pause=True), c, *split, token_bytes=self.tokenizer.token_bytes)
            return
        for ev in self._run(req, c, pause=True):
            if ev.text:
                yield "content", ev.text

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
            raise InvalidRequest(f"{self.name} has no fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, "
                                 "<|fim_middle|> or their kin): this model cannot infill")
        n_predict = max_tokens if max_tokens is not None and max_tokens > 0 else min(256, self.n_ctx // 4)
        return infill_ids(self.tokenizer, fim, prefix, suffix, extra=extra, prompt=prompt, n_ctx=self.n_ctx,
                          n_predict=n_predict, repo_level=repo_level)

    @takes_options()
    def infill(self, prefix: str, suffix: str, *, extra: Sequence[dict[str, str]] = (), prompt: str = "",
               **options: Unpack[Options]) -> str:
        """The code that fills the hole between prefix and suffix (a FIM-trained model: Qwen2.5-Coder, ...).
        extra: other files as context, [{"filename": ..., "text": ...}]; keywords as generate(). Besides the
        model's end token, the fill ends before a line that repeats the suffix's first line and before a line
        indented less than the hole's (text/infill.py end_rules; min_indent=0 turns that one off)."""
        return self.complete_infill(prefix, suffix, extra=extra, prompt=prompt, **options).text

    @takes_options()
    def complete_infill(self, prefix: str, suffix: str, *, extra: Sequence[dict[str, str]] = (), prompt: str = "",
                        **options: Unpack[Options]) -> Completion:
        """infill() as a whole Completion (token ids, finish reason, counts, timings)."""
        req = self._request(self._infill_options(prefix + prompt, suffix, options))
        ids = self.infill_prompt(prefix, suffix, extra=extra, prompt=prompt, max_tokens=req.max_tokens)
        return self._complete(self._submit(ids, req))

    @staticmethod
    def _infill_options(before: str, suffix: str, options: Any) -> dict[str, Any]:
        """options with the fill's end rules added: stop strings joined to the caller's, min_indent unless
        given."""
        from barellm.text.infill import end_rules

        stops, indent = end_rules(before, suffix)
        given = options.get("stop")
        mine = [given] if isinstance(given, str) else list(given) if isinstance(given, (list, tuple)) else []
        if given is not None and not mine and not isinstance(given, (list, tuple)):
            return dict(options)   # a malformed stop: from_options names it
        return {**options, "stop": mine + stops, "min_indent": options.get("min_indent", indent)}

    # --- chat -----------------------------------------------------------------------------------

    @property
    def reasoning_format(self) -> str | None:
        """How this model's replies carry their reasoning (text/reasoning.py): "harmony" (gpt-oss's
        channels), "think" (<think>...</think>), or None (a model that does not reason aloud)."""
        return self.chats.reasoning_format

    def chat_prompt(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None, *,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of the rendered chat template (special tokens parsed, no extra BOS). tools: OpenAI's
        tool objects, rendered by the template when it knows tools, else in the built-in form
        (text/toolcalls.py); assistant messages with tool_calls and tool messages render either way.
        template_kwargs: further template variables (text/reasoning.template_kwargs checks a request's)."""
        return self._chat_prompt(messages, add_generation_prompt, tools, template_kwargs)[0]

    def _chat_prompt(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                     tools: Sequence[dict[str, Any]] | None = None,
                     template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], bool]:
        """chat_prompt's ids, and whether the prompt leaves the reply inside a <think> block."""
        return self.chats.prompt(messages, add_generation_prompt, tools, template_kwargs)

    @takes_options()
    def chat(self, messages: Sequence[dict[str, Any]], *, reasoning_effort: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, **options: Unpack[Options]) -> str:
        """The assistant's reply to messages ([{"role": ..., "content": ...}, ...]); a content may be a string
        or OpenAI's text parts ([{"type": "text", "text": ...}, ...]). Keywords as generate(), and
        reasoning_effort ("low", "medium", "high": gpt-oss's template reads it) and chat_template_kwargs
        (further template variables, e.g. {"enable_thinking": False} for Qwen3).

        A reasoning model's reply (reasoning_format) is its answer only: complete_chat() gives the whole
        Completion, whose `reasoning` holds what the model thought first."""
        return self.complete_chat(messages, reasoning_effort=reasoning_effort,
                                  chat_template_kwargs=chat_template_kwargs, **options).text

    @takes_options()
    def complete_chat(self, messages: Sequence[dict[str, Any]], *, reasoning_effort: str | None = None,
                      chat_template_kwargs: dict[str, Any] | None = None, **options: Unpack[Options]) -> Completion:
        """chat() as the whole Completion: `text` the answer, `reasoning` a reasoning model's reasoning (both
        for every choice in .choices), ids, finish reason, counts and timings."""
        return self.chats.complete(*self.chats.request(messages, dict(options), reasoning_effort,
                                                      chat_template_kwargs))

    @takes_options()
    def chat_stream(self, messages: Sequence[dict[str, Any]], *, reasoning_effort: str | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None, **options: Unpack[Options]) -> Stream:
        """chat() as it happens, as stream() gives generate(): the answer's pieces; a reasoning model's
        reasoning goes to the stream's `reasoning` (and its parts(), beside the answer's pieces)."""
        req, split = self.chats.request(messages, dict(options), reasoning_effort, chat_template_kwargs)
        if req.n != 1:
            raise InvalidRequest("chat_stream() generates one sequence; use complete(..., n=...) for several")
        return self._stream(req, split)

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({self.name}, {c.arch}, {c.n_layers} layers, dim {c.dim}, vocab {c.n_vocab}, "
                f"context {self.n_ctx}, engine {self.engine_name}, threads {self.threads})")


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
    from barellm.store import catalog, presets

    preset = presets.find(os.fspath(model)) if model is not None else None
    path = catalog.resolve(model)
    defaults = catalog.options_of(path)
    if preset is not None:   # a preset's parameters over its model's own; its system prompt starts each chat
        defaults = {**defaults, **preset.options}
    try:
        out = Model(path, threads=threads, context=context, engine=engine, chat_template=chat_template,
                    slots=slots, activations=activations, kv_type=kv_type, verify=verify, draft=draft,
                    defaults=defaults)
        if preset is not None:
            out.name, out.system = preset.name, preset.system
        return out
    except BarellmError:
        raise
    except (OSError, MemoryError) as e:
        raise BarellmError(f"{path}: cannot load: {e}") from e
