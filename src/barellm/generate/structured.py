"""Constrained decoding: JSON schemas, regular expressions and grammars as per-token masks.

The engine behind it is llguidance (the `barellm[structured]` extra): it compiles a JSON schema, a regex
or a Lark / GBNF grammar into an Earley parser over a lexer, and for each step computes the bitmask of the
tokens that keep the output inside the language, in tens of microseconds for a 150k-token vocabulary.
The mask's layout is the sampler's own (uint32 words, bit i % 32 of word i // 32 for token i), so it goes
to the native sampler as it is: no pass over the vocabulary in Python. docs/structured.md says why this
engine rather than xgrammar or outlines-core.

Three objects:

- `Vocabulary`: llguidance's view of a model's tokenizer, built once per Model from barellm's own
  Tokenizer: every token's bytes (byte-level BPE and SentencePiece pieces as `Tokenizer.token_bytes` gives
  them), control tokens and turn markers flagged special (grammars name them as `<|im_end|>`; as text they
  are never matched), and the end-of-generation ids as llguidance's EOS set, so a finished grammar allows
  exactly the tokens that end a Generation.
- `Grammar`: one compiled constraint (a JSON schema, `json_object`, a regex, a grammar, or the tool-call
  grammar text/tools.py builds), checked when it is made: an unsupported schema keyword is an
  InvalidRequest naming it, never a silently unconstrained answer. Immutable and shared: the matcher it
  holds is copied for each generation. A grammar made with `end_on_exit` (the tool-call list's) also ends
  the generation where the output is complete and the model's own most likely next token lies outside
  it: a list the grammar lets go on (one more call) is not forced on by the mask when the model would stop.
- `Guide`: one generation's parser state. `mask()` gives the allowed tokens for the next step, `accept()`
  takes the token chosen and starts computing the next mask: on a worker thread when a core is free beside
  the engine's threads (llguidance releases the GIL while it works, and the driver is meanwhile inside the
  engine's forward pass, which releases it too, so the mask is usually ready when the logits are), else in
  line (a worker woken on a core the engine's threads use delays their barriers by more than the ~0.1 ms
  the mask costs: bench/structured.py).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from barellm.cpu import spare_core
from barellm.errors import InvalidRequest
from barellm.text.tokenizer import TokenType

__all__ = ["Grammar", "Guide", "StructuredUnavailable", "Vocabulary", "available", "spare_core", "JSON_WHITESPACE"]

# JSON whitespace in a constrained answer, at one place: a few spaces or tabs, or one line break and the next
# line's indentation. Unbounded whitespace lets a small model spin on blank lines until max_tokens; this still
# allows compact JSON and pretty-printing up to 10 levels deep (2 spaces a level).
JSON_WHITESPACE = r"[\x20\x09]{1,4}|\x0D?\x0A[\x20\x09]{0,20}"
_CACHE = 64        # compiled grammars kept per vocabulary


class StructuredUnavailable(InvalidRequest):
    """A request needs constrained decoding and llguidance is not installed."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise StructuredUnavailable("constrained decoding (json_schema, response_format, grammar, regex, forced tool "
                                    "calls) needs the llguidance package: pip install 'barellm[structured]'"
                                    ) from None
    return llguidance


def available() -> bool:
    """Whether constrained decoding can run here (llguidance is installed)."""
    try:
        _llguidance()
    except StructuredUnavailable:
        return False
    return True


class Vocabulary:
    """llguidance's tokenizer for one barellm Tokenizer and model vocabulary size (ids past the tokenizer's
    list, which some files pad the output matrix with, are tokens of no bytes: never allowed)."""

    def __init__(self, tokenizer: Any, n_vocab: int) -> None:
        llg = _llguidance()
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab
        self.words = (n_vocab + 31) // 32
        tokens: list[bytes] = []
        special: list[int] = []
        for i in range(n_vocab):
            if i >= tokenizer.vocab_size:
                tokens.append(b"")
                continue
            b = tokenizer.token_bytes(i)
            # Control tokens, and user-defined ones written like markup (Qwen's <tool_call>), are single
            # symbols to the model: a grammar names them (<tool_call>), plain text never matches them.
            kind = tokenizer.token_type(i)
            if kind == TokenType.CONTROL or (kind == TokenType.USER_DEFINED and b.startswith(b"<")
                                             and b.endswith(b">")):
                special.append(i)
            tokens.append(b)
        self.special = frozenset(special)
        self.eog = sorted(tokenizer.eog_ids)
        if not self.eog:
            raise InvalidRequest("constrained decoding needs an end-of-generation token; this model's tokenizer has "
                                 "none")

        enc = tokenizer.encode

        class _Source:   # what llguidance's TokenizerWrapper reads
            eos_token_id = self.eog[0]
            bos_token_id = tokenizer.bos_id

            def __call__(self, text: bytes | str) -> list[int]:
                if isinstance(text, bytes):
                    text = text.decode("utf-8", errors="replace")   # llguidance passes whole characters
                return enc(text, add_special=False, parse_special=False)

        _Source.tokens = tokens
        _Source.special_token_ids = special
        self.ll = llg.LLTokenizer(llg.TokenizerWrapper(_Source()), n_vocab=n_vocab, eos_token=self.eog)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    # --- grammars -----------------------------------------------------------------------------

    def grammar(self, kind: str, text: str, what: str, end_on_exit: bool = False) -> Grammar:
        """The compiled llguidance grammar `text` (cached by text). kind names it ("json_schema", ...), what
        is the request field that asked for it (error messages name it); end_on_exit: see Grammar."""
        key = (text, end_on_exit)
        with self._lock:
            g = self._cache.get(key)
            if g is not None:
                self._cache.move_to_end(key)
                return g
        g = Grammar(self, kind, text, what, end_on_exit)
        with self._lock:
            self._cache[key] = g
            while len(self._cache) > _CACHE:
                self._cache.popitem(last=False)
        return g

    def json_schema(self, schema: Any, what: str = "json_schema") -> Grammar:
        """Output that is one JSON value valid against schema (a dict, or its JSON text; True: any JSON value)."""
        llg = _llguidance()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidRequest(f"{what} is not valid JSON: {e}") from None
        if schema is True:
            schema = {}
        if not isinstance(schema, Mapping):
            raise InvalidRequest(f"{what} must be a JSON schema object, got {type(schema).__name__}")
        _check_numbers(schema, what)
        own = schema.get("x-guidance")   # llguidance's options in the schema win over the default whitespace
        defaults = {} if isinstance(own, Mapping) and {"whitespace_flexible", "whitespace_pattern"} & set(own) else \
            {"whitespace_pattern": JSON_WHITESPACE}
        try:
            text = llg.LLMatcher.grammar_from_json_schema(dict(schema), defaults=defaults)
        except (ValueError, TypeError) as e:
            raise InvalidRequest(f"{what}: {_one_line(str(e))}") from None
        return self.grammar("json_schema", text, what)

    def json_object(self, what: str = "response_format") -> Grammar:
        """Output that is one JSON object (OpenAI's response_format {"type": "json_object"})."""
        return self.json_schema({"type": "object"}, what)

    def regex(self, pattern: str, what: str = "regex") -> Grammar:
        """Output that matches pattern as a whole (Rust regex syntax: no look-around, no backreferences)."""
        if not isinstance(pattern, str):
            raise InvalidRequest(f"{what} must be a string")
        _check_repetitions(pattern, what)
        return self.grammar("regex", _llguidance().LLMatcher.grammar_from_regex(pattern), what)

    def lark(self, source: str, what: str = "grammar", end_on_exit: bool = False) -> Grammar:
        """Output in the language of a grammar: llguidance's Lark dialect, or GBNF (llama.cpp's; told apart by
        its ::= rules). end_on_exit: see Grammar."""
        if not isinstance(source, str):
            raise InvalidRequest(f"{what} must be a string")
        llg = _llguidance()
        try:
            text = llg.grammar_from("grammar", source)
        except Exception as e:  # noqa: BLE001 - the GBNF converter raises whatever its parser does
            raise InvalidRequest(f"{what}: {_one_line(str(e))}") from None
        return self.grammar("grammar", text, what, end_on_exit)

    def response_format(self, fmt: Any, what: str = "response_format") -> Grammar | None:
        """OpenAI's response_format: {"type": "text"} (None), {"type": "json_object"}, or {"type": "json_schema",
        "json_schema": {"name", "schema", "strict"}}."""
        if not isinstance(fmt, Mapping) or not isinstance(fmt.get("type"), str):
            raise InvalidRequest(f'{what} must be an object with "type": "text", "json_object" or "json_schema"')
        kind = fmt["type"]
        if kind == "text":
            return None
        if kind == "json_object":
            return self.json_object(what)
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, Mapping):
                raise InvalidRequest(f'{what}.json_schema must be an object {{"name": ..., "schema": {{...}}}}')
            schema = spec.get("schema")
            return self.json_schema({} if schema is None else schema, f"{what}.json_schema.schema")
        raise InvalidRequest(f'{what}.type must be "text", "json_object" or "json_schema", got {kind!r}')

    def from_options(self, *, json_schema: Any = None, grammar: str | None = None, regex: str | None = None
                     ) -> Grammar | None:
        """The one constraint the keywords ask for, or None; two at once is an InvalidRequest."""
        given = [k for k, v in (("json_schema", json_schema), ("grammar", grammar), ("regex", regex)) if v is not None]
        if len(given) > 1:
            raise InvalidRequest(f"{' and '.join(given)} are both constraints on the output: give one")
        if json_schema is not None:
            return self.json_schema(json_schema)
        if grammar is not None:
            return self.lark(grammar)
        if regex is not None:
            return self.regex(regex)
        return None


_INT_RANGE = (-(1 << 63), (1 << 64) - 1)

# Counted repetitions in a regex, nested ones multiplied: llguidance's lexer unrolls them into states, so
# a{1000000} compiles but fails at the first or second mask ("too many expressions constructed"), which
# ended the reply empty with constraint_failed; a{100000} costs seconds of mask time. Past this it is
# refused with the request, as RE2 refuses counts past 1000.
MAX_REPETITION = 10_000
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def _check_repetitions(pattern: str, what: str) -> None:
    """Refuses a regex whose counted repetitions ({n}, {n,}, {n,m}), nested ones multiplied, pass
    MAX_REPETITION. Escapes and character classes are skipped; the rest of the syntax is llguidance's to
    check."""
    inside = [1]     # per open group: the largest repetition product within it so far
    last = 1         # the repetition product of the atom or group just read
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            # \p{Greek}, \x{263a}, \u{...}: braces that belong to the escape
            if i + 2 < n and pattern[i + 1] in "pPxuU" and pattern[i + 2] == "{":
                close = pattern.find("}", i + 2)
                i = n if close < 0 else close + 1
            else:
                i += 2
            last = 1
        elif c == "[":
            i = _class_end(pattern, i)
            last = 1
        elif c == "(":
            inside.append(1)
            i += 1
        elif c == ")":
            last = inside.pop() if len(inside) > 1 else 1
            inside[-1] = max(inside[-1], last)
            i += 1
        elif c == "{" and (m := _COUNT.match(pattern, i)):
            low, high = int(m.group(1)), m.group(2)
            count = max(low, int(high)) if high else low
            last *= count
            if last > MAX_REPETITION:
                raise InvalidRequest(f"{what}: the repetition {m.group(0)} at character {i} asks for {last:,} "
                                     f"repeats (nested counts multiplied); at most {MAX_REPETITION:,} are "
                                     "supported")
            inside[-1] = max(inside[-1], last)
            i = m.end()
        else:
            last = 1
            i += 1


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class that opens at pattern[start] ("["), nested classes included."""
    depth, i, n = 0, start, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            depth += 1
            i += 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":   # a ] first in a class is a literal
                i += 1
            continue
        if c == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def _check_numbers(value: Any, where: str) -> None:
    """Refuses an integer in a schema that the schema compiler cannot hold (past 64 bits, as `minimum: 10**300`
    is), naming where it is, instead of the compiler's 'Value is not JSON serializable'."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, bool):
            continue
        if isinstance(v, int):
            if not _INT_RANGE[0] <= v <= _INT_RANGE[1]:
                digits = len(str(abs(v)))
                raise InvalidRequest(f"{at} is an integer of {digits} digits; numbers in a schema must fit "
                                     "64 bits (-2^63 .. 2^64-1)")
        elif isinstance(v, Mapping):
            stack.extend((x, f"{at}.{k}") for k, x in v.items())
        elif isinstance(v, (list, tuple)):
            stack.extend((x, f"{at}[{i}]") for i, x in enumerate(v))


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + "..."


class Grammar:
    """A compiled, checked constraint for one Vocabulary. `guide()` starts a generation's parser.

    end_on_exit: where the output so far is complete, the generation ends (as at an end-of-generation
    token) when the model's most likely next token is one the grammar does not allow, instead of the mask
    forcing it to go on. For a grammar that may repeat after it is complete (tool calls: one more call, or
    the end), it is the model, not the mask, that decides whether more comes."""

    def __init__(self, vocab: Vocabulary, kind: str, text: str, what: str, end_on_exit: bool = False) -> None:
        llg = _llguidance()
        self.vocab = vocab
        self.kind = kind
        self.text = text
        self.end_on_exit = end_on_exit
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(text, vocab.ll)
        if failed:
            raise InvalidRequest(f"{what}: {_describe(messages[0] if messages else 'invalid')}")
        matcher = llg.LLMatcher(vocab.ll, text, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"{what}: {_describe(matcher.get_error())}")
        # A grammar that lets no output begin (`root ::= root`, a schema that is only a $ref cycle, a regex
        # of an empty character class) compiles; its first mask is where llguidance finds it out. Then it
        # is refused here, with the request, instead of the reply ending empty.
        probe = matcher.deep_copy()
        buf = np.zeros(vocab.words, np.uint32)
        probe.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
        if probe.is_error() or not (buf.any() or probe.is_accepting()):
            raise InvalidRequest(f"{what} can never be satisfied: no output matches it (llguidance: "
                                 f"{_stop_reason(probe.get_error()) or 'no token can begin it'})")
        self._matcher = matcher

    def guide(self, background: bool = True) -> Guide:
        return Guide(self, background)

    def accepts(self, token_ids: Sequence[int]) -> bool:
        """Whether token_ids are a complete output of this grammar (a check for tests and tools)."""
        m = self._matcher.deep_copy()
        return m.consume_tokens([int(t) for t in token_ids]) and m.is_accepting()

    def __repr__(self) -> str:
        return f"Grammar({self.kind}, {len(self.text)} characters)"


def _stop_reason(message: str) -> str:
    """The reason line of llguidance's parser-state dump ("Stop: NoExtensionBias"), in words."""
    for line in message.splitlines():
        if line.startswith("Stop: "):
            why = line.removeprefix("Stop: ").strip()
            return {"NoExtensionBias": "no token can begin it"}.get(why, why)
    return _one_line(message, 200) if message else ""


def _describe(message: str) -> str:
    """llguidance's error as one line, with its usual prefix for schema problems kept readable."""
    msg = _one_line(message)
    if msg.startswith("Unimplemented keys:"):
        return "unsupported JSON schema keyword(s) " + msg.removeprefix("Unimplemented keys:").strip()
    return msg


_WORKER: ThreadPoolExecutor | None = None
_WORKER_LOCK = threading.Lock()


def _worker() -> ThreadPoolExecutor:
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="barellm-mask")
        return _WORKER


class Guide:
    """One generation's parser: mask() -> the allowed tokens now; accept(token) -> advance.

    With background=True the next mask is computed on a worker thread from accept() on, overlapping the
    forward pass that makes the next logits; mask() waits for it (spare_core says when that pays). A parser
    that fails (it cannot, as long as only masked tokens are accepted) allows only the end-of-generation
    tokens, so the generation ends rather than the step raising; `error` says what happened."""

    __slots__ = ("grammar", "matcher", "buf", "_pending", "background", "error")

    def __init__(self, grammar: Grammar, background: bool = True) -> None:
        self.grammar = grammar
        self.matcher = grammar._matcher.deep_copy()
        self.buf = np.zeros(grammar.vocab.words, np.uint32)
        self.background = background
        self.error: str | None = None
        self._pending: Future[None] | None = None
        self._start()

    def _compute(self) -> None:
        m = self.matcher
        m.unsafe_compute_mask_ptr(self.buf.ctypes.data, self.buf.nbytes)

    def _start(self) -> None:
        if self.background:
            self._pending = _worker().submit(self._compute)
        else:
            self._compute()

    def mask(self) -> np.ndarray:
        """The allowed-token bitmask for the next token (valid until the next accept)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        if self.matcher.is_error():
            self._fail(self.matcher.get_error())
        return self.buf

    def accept(self, token: int) -> None:
        """The token chosen under the last mask; starts computing the next one."""
        if self._pending is not None:   # accept without mask(): never in a Generation, but keep the state sane
            self._pending.result()
            self._pending = None
        if not self.matcher.consume_token(int(token)):
            self._fail(self.matcher.get_error() or f"token {token} is not allowed here")
            return
        self._start()

    @property
    def accepting(self) -> bool:
        """Whether the output so far is a complete sentence of the grammar."""
        return self.matcher.is_accepting()

    def exits(self, row: np.ndarray) -> bool:
        """For an end_on_exit grammar: whether the generation ends here, before a token is drawn: the output
        is complete and the most likely token of the logits `row` is not allowed by the last mask()."""
        if not self.grammar.end_on_exit or self.error is not None or not self.matcher.is_accepting():
            return False
        top = int(np.argmax(row))
        return not (int(self.buf[top >> 5]) >> (top & 31)) & 1

    def _fail(self, why: str) -> None:
        self.error = why
        self.buf[:] = 0
        for t in self.grammar.vocab.eog:
            self.buf[t // 32] |= np.uint32(1 << (t % 32))


def vocabulary(owner: Any, tokenizer: Any, n_vocab: int) -> Vocabulary:
    """owner's Vocabulary, built on first use (about 0.4 s for a 150k-token vocabulary) and kept on owner."""
    v = getattr(owner, "_structured_vocab", None)
    if v is None:
        lock = owner.__dict__.setdefault("_structured_lock", threading.Lock())
        with lock:
            v = getattr(owner, "_structured_vocab", None)
            if v is None:
                v = Vocabulary(tokenizer, n_vocab)
                owner._structured_vocab = v
    return v



