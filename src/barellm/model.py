"""The public face: load a model by name or path, then tokenize, score, generate, stream and chat.

Model is thin: the tokenizer turns text into ids, an engine turns ids into logits, the sampler picks
the next id, and the stream decoder turns ids back into text. The KV cache persists between calls,
so a prompt that starts with what the cache already holds is only fed from where it differs.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from barellm import hub
from barellm.arch.config import ModelConfig, config_of
from barellm.cpu import default_threads
from barellm.errors import BarellmError, FormatError, InvalidRequest
from barellm.sampling import Sampler, SamplingParams

ENGINES = ("auto", "native", "reference")
ACTIVATIONS = ("q8x2", "q8")  # the native engine's activation precisions (engine.ACTIVATIONS)


@dataclass
class Completion:
    """Everything about one generation; `text` is what generate() returns."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"      # "stop" (end of generation or stop string) or "length"
    prompt_tokens: int = 0
    cached_tokens: int = 0             # prompt tokens whose KV entries were reused
    prefill_seconds: float = 0.0       # prompt processing, up to the first token's logits
    decode_seconds: float = 0.0


@dataclass
class Piece:
    """One step of a generation: the token, the text it completes (may be empty), its logits."""

    token_id: int
    text: str
    logits: np.ndarray


def _open_source(path: Path) -> Any:
    from barellm.cache import open_model

    return open_model(path)


class Model:
    """A loaded model. Not safe to use from several threads at once (one KV cache)."""

    def __init__(self, path: Path, *, threads: int | None = None, context: int | None = None,
                 engine: str = "auto", chat_template: str | None = None, slots: int = 1,
                 activations: str = "q8x2") -> None:
        from barellm.text.chat import ChatTemplate, template_for
        from barellm.text.tokenizer import Tokenizer

        if engine not in ENGINES:
            raise InvalidRequest(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        if activations not in ACTIVATIONS:
            raise InvalidRequest(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        if threads is not None and not (isinstance(threads, int) and 1 <= threads <= 256):
            raise InvalidRequest(f"threads must be an integer in 1..256, got {threads!r}")
        self.path = path
        self.source = _open_source(path)
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
        if not (isinstance(slots, int) and 1 <= slots <= 256):
            raise InvalidRequest(f"slots must be an integer in 1..256, got {slots!r}")
        self.slots = slots
        self.threads = threads or default_threads()
        self.activations = activations
        self.engine_name, self.engine = self._make_engine(engine)
        self._cached: list[int] = []   # the tokens whose KV entries the engine holds, in order
        self._served = False           # a server's scheduler owns the engine (see serving())

    def _make_engine(self, engine: str) -> tuple[str, Any]:
        if engine in ("auto", "native"):
            from barellm.engine import NativeEngine, unsupported_reason

            reason = unsupported_reason(self.config, self.source)
            if reason is None:
                return "native", NativeEngine(self.config, self.source, n_ctx=self.n_ctx, threads=self.threads,
                                              n_slots=self.slots, activations=self.activations)
            if engine == "native":
                raise FormatError(f"the native engine cannot run this model: {reason}")
            warnings.warn(f"the native engine cannot run this model ({reason}); using the NumPy reference engine, "
                          "which is slow", RuntimeWarning, stacklevel=3)
        from barellm.arch import reference_engine

        return "reference", reference_engine(self.config, self.source, self.n_ctx, self.slots)

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

    # --- scoring --------------------------------------------------------------------------------

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Next-token logits after every prefix of ids: float32 [len(ids), n_vocab]."""
        ids = [int(t) for t in ids]
        self._check_ids(ids)
        if not ids:
            raise InvalidRequest("logits needs at least one token")
        if len(ids) > self.n_ctx:
            raise InvalidRequest(f"{len(ids)} tokens do not fit the context of {self.n_ctx}")
        out = self._engine().forward(ids, 0, all_logits=True)
        self._cached = list(ids)
        return np.array(out, copy=True)

    def _feed(self, ids: list[int]) -> tuple[np.ndarray, int]:
        """Brings the cache to hold ids; returns the last position's logits and how many were reused."""
        reuse = 0
        for a, b in zip(self._cached, ids, strict=False):
            if a != b:
                break
            reuse += 1
        reuse = min(reuse, len(ids) - 1)   # always feed at least one token to get its logits
        self._cached = self._cached[:reuse]
        logits = self._engine().forward(ids[reuse:], reuse)[-1]
        self._cached = list(ids)
        return logits, reuse

    # --- generation -----------------------------------------------------------------------------

    def _engine(self) -> Any:
        if self._served:
            raise InvalidRequest("this Model is being served: the server's scheduler owns its engine (every slot, "
                                 "slot 0 included); load a second Model for direct calls")
        return self.engine

    def serving(self, served: bool) -> None:
        """A server takes the engine (True) or gives it back (False). Meanwhile this Model's own calls are
        refused; either way the slot-0 cache the Model kept track of is forgotten (the server writes there)."""
        self._served = bool(served)
        self._cached = []

    def _params(self, kw: dict[str, Any]) -> tuple[SamplingParams, int, list[str]]:
        max_tokens = kw.pop("max_tokens", 128)
        stop = kw.pop("stop", None)
        unknown = set(kw) - set(SamplingParams.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(f"unknown generation parameter(s): {', '.join(sorted(unknown))}")
        params = SamplingParams().with_(**{k: v for k, v in kw.items() if k != "seed"})
        params = SamplingParams(**{**params.__dict__, "seed": kw.get("seed")}).validated()
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            raise InvalidRequest(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
        if stop is None:
            stops: list[str] = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stops = list(stop)
        else:
            raise InvalidRequest("stop must be a string or a list of strings")
        return params, max_tokens, [s for s in stops if s]

    def pieces(self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int,
               completion: Completion | None = None) -> Iterator[Piece]:
        """The token loop: yields each generated token with its text until end of generation or
        max_tokens; stop strings are the caller's business (see _stream_text)."""
        ids = [int(t) for t in prompt_ids]
        self._check_ids(ids)
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if len(ids) >= self.n_ctx:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; the context holds {self.n_ctx}")
        c = completion if completion is not None else Completion()
        c.prompt_tokens = len(ids)
        sampler = Sampler(params)
        decoder = self.tokenizer.stream_decoder()
        t0 = time.perf_counter()
        logits, c.cached_tokens = self._feed(ids)
        c.prefill_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        history = list(ids)
        try:
            for _ in range(max_tokens):
                tok = sampler.sample(logits, history)
                if tok in self.tokenizer.eog_ids:
                    c.finish_reason = "stop"
                    return
                history.append(tok)
                c.token_ids.append(tok)
                yield Piece(tok, decoder.feed(tok), logits)
                if len(history) >= self.n_ctx:
                    c.finish_reason = "length"
                    return
                logits = self._engine().forward([tok], len(history) - 1)[-1]
                self._cached.append(tok)
            c.finish_reason = "length"
        finally:
            tail = decoder.flush()
            if tail:
                yield Piece(-1, tail, logits)
            c.decode_seconds = time.perf_counter() - t0

    def _stream_text(self, prompt_ids: Sequence[int], kw: dict[str, Any], c: Completion) -> Iterator[str]:
        params, max_tokens, stops = self._params(dict(kw))
        pending = ""  # text held back because it could be the start of a stop string
        hold = max((len(s) for s in stops), default=1) - 1
        for piece in self.pieces(prompt_ids, params, max_tokens, c):
            pending += piece.text
            if stops:
                hits = [(pending.find(s), s) for s in stops if s in pending]
                if hits:
                    cut = min(i for i, _ in hits)
                    if pending[:cut]:
                        c.text += pending[:cut]
                        yield pending[:cut]
                    c.finish_reason = "stop"
                    return
                keep = _stop_prefix_len(pending, stops, hold)
                out, pending = pending[: len(pending) - keep], pending[len(pending) - keep:]
            else:
                out, pending = pending, ""
            if out:
                c.text += out
                yield out
        if pending:
            c.text += pending
            yield pending

    def complete(self, prompt: str | Sequence[int], **kw: Any) -> Completion:
        """Like generate() but returns the whole Completion (ids, finish reason, counts, timings)."""
        c = Completion()
        for _ in self._stream_text(self._prompt_ids(prompt), kw, c):
            pass
        return c

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        if isinstance(prompt, Sequence):
            return [int(t) for t in prompt]
        raise InvalidRequest(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def generate(self, prompt: str | Sequence[int], **kw: Any) -> str:
        """The continuation of prompt. Keywords: max_tokens (128), temperature (0.8; 0 = greedy),
        top_k, top_p, min_p, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty,
        seed, stop (a string or list of strings, not included in the text)."""
        return self.complete(prompt, **kw).text

    def stream(self, prompt: str | Sequence[int], **kw: Any) -> Iterator[str]:
        """generate() as it happens: yields text pieces (whole UTF-8 characters) as they come."""
        return self._stream_text(self._prompt_ids(prompt), kw, Completion())

    # --- chat -----------------------------------------------------------------------------------

    def chat_prompt(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat template (special tokens parsed, no extra BOS)."""
        text = self.template.render(list(messages), add_generation_prompt=add_generation_prompt)
        ids = self.tokenizer.encode(text, add_special=False, parse_special=True)
        bos = self.tokenizer.bos_id
        if self.tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids   # the template did not write the BOS the model expects
        return ids

    def chat(self, messages: Sequence[dict[str, Any]], **kw: Any) -> str:
        """The assistant's reply to messages ([{"role": ..., "content": ...}, ...]); a content may be a string
        or OpenAI's text parts ([{"type": "text", "text": ...}, ...])."""
        c = Completion()
        for _ in self._stream_text(self.chat_prompt(messages), kw, c):
            pass
        return c.text

    def chat_stream(self, messages: Sequence[dict[str, Any]], **kw: Any) -> Iterator[str]:
        return self._stream_text(self.chat_prompt(messages), kw, Completion())

    def reset(self) -> None:
        """Forgets the KV cache contents (the next call feeds its whole prompt)."""
        self._cached = []

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({self.path.name}, {c.arch}, {c.n_layers} layers, dim {c.dim}, vocab {c.n_vocab}, "
                f"context {self.n_ctx}, engine {self.engine_name}, threads {self.threads})")

    # --- OpenAI's result objects: the dicts the server returns, built by openai_format ---------------

    def create_completion(self, prompt: str | Sequence[int], *, max_tokens: int | None = 16, stream: bool = False,
                          **kw: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """complete() as OpenAI's text_completion object (id, object, created, model, choices[0].text and
        finish_reason, usage), as llama-cpp-python's method of this name returns it; stream=True yields the
        chunk objects as they come. max_tokens None: the rest of the context; other keywords as generate()."""
        return self._openai(self._prompt_ids(prompt), False, max_tokens, stream, kw)

    def create_chat_completion(self, messages: Sequence[dict[str, Any]], *, max_tokens: int | None = None,
                               stream: bool = False, **kw: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """chat() as OpenAI's chat.completion object (choices[0].message), or with stream=True its
        chat.completion.chunk objects. max_tokens None: the rest of the context."""
        return self._openai(self.chat_prompt(messages), True, max_tokens, stream, kw)

    def _openai(self, ids: list[int], chat: bool, max_tokens: int | None, stream: bool, kw: dict[str, Any]
                ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        from barellm import openai_format as fmt

        kw = {**kw, "max_tokens": max(self.n_ctx - len(ids), 0) if max_tokens is None else max_tokens}
        self._params(dict(kw))   # a bad keyword fails here, not at a stream's first next()
        rid, name = fmt.new_id(chat), self.path.stem
        if stream:
            return self._openai_chunks(ids, chat, kw, rid, name)
        c = Completion()
        for _ in self._stream_text(ids, kw, c):
            pass
        build = fmt.chat_completion if chat else fmt.text_completion
        return build(rid, name, c.text, c.finish_reason, fmt.usage(c.prompt_tokens, len(c.token_ids), c.cached_tokens))

    def _openai_chunks(self, ids: list[int], chat: bool, kw: dict[str, Any], rid: str, name: str
                       ) -> Iterator[dict[str, Any]]:
        from barellm import openai_format as fmt

        created = int(time.time())
        c = Completion()
        if chat:
            yield fmt.chat_chunk(rid, name, role=True, created=created)
        for text in self._stream_text(ids, kw, c):
            yield (fmt.chat_chunk(rid, name, text=text, created=created) if chat
                   else fmt.text_chunk(rid, name, text=text, created=created))
        yield (fmt.chat_chunk(rid, name, finish_reason=c.finish_reason, created=created) if chat
               else fmt.text_chunk(rid, name, finish_reason=c.finish_reason, created=created))


def _stop_prefix_len(text: str, stops: list[str], longest: int) -> int:
    """Length of the longest end of text that could still grow into a stop string."""
    for n in range(min(longest, len(text)), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0


def load(model: str | os.PathLike[str] | None = None, *, threads: int | None = None, context: int | None = None,
         engine: str = "auto", chat_template: str | None = None, slots: int = 1,
         activations: str = "q8x2") -> Model:
    """Loads a model by name ("smollm2-135m", pulled on first use) or path.

    threads: worker threads (default: physical cores); context: KV cache size in tokens;
    engine: "native" (the C core), "reference" (NumPy float32, slow, exact) or "auto" (the default: native
    where it runs the model, else reference with a warning);
    chat_template: a built-in template name to use instead of the file's;
    slots: independent KV caches (sequences served side by side); the Model's own calls use slot 0;
    activations: the native engine's activation precision in the quantized matmuls: "q8x2" (the default,
    ~15 bits: logits within a mean KL of 0.0002 of the float reference on SmolLM2) or "q8" (8-bit blocks as
    llama.cpp uses: ~1.6x faster prefill, KL ~0.003).
    """
    path = hub.resolve(model)
    try:
        return Model(path, threads=threads, context=context, engine=engine, chat_template=chat_template,
                     slots=slots, activations=activations)
    except BarellmError:
        raise
    except (OSError, MemoryError) as e:
        raise BarellmError(f"{path}: cannot load: {e}") from e
