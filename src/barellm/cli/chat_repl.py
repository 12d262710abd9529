"""The interactive chat of `barellm chat` (and of `barellm run MODEL` with no prompt), modelled on Ollama's.

A session holds the conversation (an optional system message, then user and assistant turns) and the
sampling options, reads one message at a time and streams the reply. Lines that start with / are commands
(/help lists them) and never reach the model; a block between triple quotes is one multi-line message.

- Instruct models (a chat template in the file) see the conversation rendered by that template. A base
  model (no template) cannot hold a dialogue: the session says so at the start and runs as plain
  continuation, each message appended to the text so far and continued by the model (`--template`
  forces a chat format instead).
- Ctrl-C during a reply stops the reply, not the session: the text printed so far stays in the history
  as the assistant's turn, so what the model remembers is what the user saw. Ctrl-C at the prompt drops
  the line; Ctrl-D or /bye ends the session with status 0.
- When the conversation outgrows the context, the oldest turns are dropped (the system message is kept)
  with a one-line note, so that the prompt leaves room for a reply.
- A reply runs until the model ends it or the context is full, unless max_tokens is set (-n, /set
  max_tokens); a reply a limit cut short is followed by a one-line note that says which.
- A reasoning model's thinking (text/reasoning.py) is shown before its answer, dimmed on a terminal, and
  left out of piped output (--reasoning show|hide|auto). The history keeps the answer as the assistant's
  content and the thinking beside it (reasoning_content), which the model's template renders or drops.

Line editing and history come from prompt_toolkit when it is installed (`pip install 'barellm[chat]'`)
and both stdin and stdout are a terminal; otherwise from input() with readline where Python has it.
Piped input is read line by line, without prompts or banner.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import textwrap
import threading
from collections.abc import Iterator, Sequence
from dataclasses import fields
from typing import Any, Protocol, TextIO

from barellm.cli.reply import Reply, shows_reasoning, stream_reply
from barellm.errors import BarellmError, InvalidRequest
from barellm.generate.generation import DEFAULT_MAX_TOKENS
from barellm.generate.sampling import SamplingParams
from barellm.store.hub import is_instruct

HELP = """\
Commands:
  /set                    show the sampling parameters
  /set NAME VALUE         set one: temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
                          presence_penalty, frequency_penalty, seed, max_tokens, stop (adds a stop string);
                          VALUE 'default' restores the default
  /set system TEXT        the system message (kept when old turns are dropped); '/set system' clears it
  /set verbose | quiet    show tokens/s after each reply, or not
  /show                   the model: file, architecture, context, instruct or base, engine
  /show history           the conversation as the model sees it, and how much of the context it fills
  /show parameters | system | template
  /clear                  forget the conversation (the system message stays)
  /bye                    end the session (as does Ctrl-D)
  /help                   this list

Ctrl-C stops a reply (the part printed stays in the history) or drops the line being typed.
\"\"\" starts a multi-line message and \"\"\" ends it; a message that starts with / must go in such a block.
"""

PROMPT = ">>> "
CONTINUATION = "... "

# what /set accepts besides SamplingParams' fields, and the names Ollama users type
_OTHER_PARAMETERS = ("max_tokens", "stop")
_ALIASES = {"num_predict": "max_tokens", "temp": "temperature"}


@contextlib.contextmanager
def ctrl_c_sets(event: threading.Event) -> Iterator[threading.Event]:
    """While inside, Ctrl-C (SIGINT) sets `event` instead of raising KeyboardInterrupt wherever the
    program happens to be, so that a reply can be stopped between two tokens and the model left intact."""
    event.clear()
    if threading.current_thread() is not threading.main_thread():
        yield event
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: event.set())
    try:
        yield event
    finally:
        signal.signal(signal.SIGINT, previous)


# --- reading lines ------------------------------------------------------------------------------------


class LineReader(Protocol):
    """Reads one line; raises EOFError at Ctrl-D or the end of input, KeyboardInterrupt at Ctrl-C."""

    name: str

    def read(self, prompt: str) -> str: ...


class PlainReader:
    """input(): on a terminal with readline's editing and history where Python has readline."""

    def __init__(self, interactive: bool) -> None:
        self.interactive = interactive
        self.name = "input()"
        if interactive:
            try:
                import readline  # noqa: F401  (importing it gives input() line editing and history)

                self.name = "input() with readline"
            except ImportError:
                pass

    def read(self, prompt: str) -> str:
        return input(prompt if self.interactive else "")


def open_block(text: str) -> bool:
    """Whether text starts a triple-quote block that it does not also end (read_message's rule)."""
    head = text.lstrip()
    if not head.startswith('"""'):
        return False
    body = head[3:].rstrip()
    return not (len(body) >= 3 and body.endswith('"""'))


class PromptToolkitReader:
    """prompt_toolkit's line editor: arrow keys, history of the session, Ctrl-C drops the line.

    A triple-quote block is edited as one text: Enter inside it starts a new line (shown after "... ")
    until a line ends with the closing quotes, so the whole message is one entry of the history, recalled
    and edited as a whole, instead of one entry per line."""

    name = "prompt_toolkit"

    def __init__(self) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.application.current import get_app
        from prompt_toolkit.filters import Condition
        from prompt_toolkit.history import InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings

        keys = KeyBindings()

        @keys.add("enter", filter=Condition(lambda: open_block(get_app().current_buffer.text)))
        def _(event: Any) -> None:
            event.current_buffer.insert_text("\n")

        self._session: Any = PromptSession(history=InMemoryHistory(), key_bindings=keys,
                                           prompt_continuation=CONTINUATION)

    def read(self, prompt: str) -> str:
        return self._session.prompt(prompt)


def make_reader(stdin: TextIO | None = None, stdout: TextIO | None = None) -> LineReader:
    """prompt_toolkit on a terminal when it is installed; input() otherwise."""
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    interactive = stdin.isatty() and stdout.isatty()
    if interactive:
        try:
            return PromptToolkitReader()
        except ImportError:
            pass
    return PlainReader(interactive)


def read_message(reader: LineReader) -> tuple[str, bool]:
    """One message: a line, or a block from a line starting with \"\"\" to one ending with \"\"\".
    Returns the text and whether it was a block (whose lines are never commands)."""
    line = reader.read(PROMPT)
    head = line.lstrip()
    if not head.startswith('"""'):
        return line, False
    body = head[3:]
    if len(body.rstrip()) >= 3 and body.rstrip().endswith('"""'):
        # a whole block at once: one line, or the lines prompt_toolkit's editor gathered
        return body.rstrip()[:-3].strip("\n"), True
    lines = [body] if body.strip() else []
    while True:
        nxt = reader.read(CONTINUATION)
        if nxt.rstrip().endswith('"""'):
            lines.append(nxt.rstrip()[:-3])
            return "\n".join(lines).strip("\n"), True
        lines.append(nxt)


# --- the session --------------------------------------------------------------------------------------


def _parameter_names() -> list[str]:
    return [*_OTHER_PARAMETERS, *(f.name for f in fields(SamplingParams))]


class ChatSession:
    """A conversation with one model: its history, sampling options and commands."""

    def __init__(self, model: Any, options: dict[str, Any] | None = None, *, system: str | None = None,
                 template: str | None = None, verbose: bool = False, out: TextIO | None = None,
                 err: TextIO | None = None, reasoning: str = "auto") -> None:
        self.model = model
        self.options: dict[str, Any] = dict(options or {})
        self.system = system or None
        self.turns: list[dict[str, str]] = []
        self.reasoning = reasoning        # --reasoning: show, hide, or auto (shown on a terminal)
        self._inside = False              # the last prompt rendered leaves the reply inside <think>
        self.template = template
        self.instruct = is_instruct(model.metadata)
        # a base model continues text, unless a chat format was asked for by name
        self.plain = not self.instruct and template is None
        self.verbose = verbose
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.stop = threading.Event()

    # --- what the model sees -----------------------------------------------------------------------

    @property
    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns

    def plain_text(self, messages: Sequence[dict[str, str]]) -> str:
        """The conversation as one text for a base model: each message starts a line, and each reply
        continues the message before it."""
        text = ""
        for m in messages:
            if m["role"] != "assistant" and text and not text.endswith("\n"):
                text += "\n"
            text += m["content"]
        return text

    def prompt_ids(self, messages: Sequence[dict[str, str]] | None = None) -> list[int]:
        messages = self.messages if messages is None else list(messages)
        if not messages:
            return []
        if self.plain:
            return self.model.tokenize(self.plain_text(messages))
        if hasattr(self.model, "_chat_prompt"):
            ids, self._inside = self.model._chat_prompt(messages)
            return list(ids)
        return self.model.chat_prompt(messages)

    def _reasoning(self) -> tuple[str, bool] | None:
        """The reply's reasoning format and whether the last prompt leaves it inside the thinking."""
        fmt = None if self.plain else getattr(self.model, "reasoning_format", None)
        return (fmt, self._inside) if isinstance(fmt, str) else None

    def _reserve(self) -> int:
        """Context tokens kept free for a reply: max_tokens, up to half the context (half of it without one)."""
        max_tokens = self.options.get("max_tokens", DEFAULT_MAX_TOKENS)
        half = self.model.n_ctx // 2
        return half if max_tokens is None else min(int(max_tokens), half)

    def _fit(self) -> list[int] | None:
        """The prompt for the last user message, the oldest turns dropped until it leaves room for a
        reply; None (nothing dropped) when the message cannot fit the context at all."""
        n_ctx = self.model.n_ctx
        system = self.messages[: len(self.messages) - len(self.turns)]
        alone = len(self.prompt_ids(system + self.turns[-1:]))
        if alone >= n_ctx:
            self._note(f"error: this message takes {alone} tokens with the system message; the context holds "
                       f"{n_ctx} (-c/--context); it was not sent")
            return None
        reserve = self._reserve()
        ids = self.prompt_ids()
        dropped = 0
        while len(ids) + reserve > n_ctx and len(self.turns) > 1:
            del self.turns[0]                      # the oldest user message
            if len(self.turns) > 1 and self.turns[0]["role"] == "assistant":
                del self.turns[0]                  # and its reply
            dropped += 1
            ids = self.prompt_ids()
        if dropped:
            self._note(f"note: the conversation outgrew the context ({n_ctx} tokens): dropped the {dropped} "
                       f"oldest turn{'s' if dropped > 1 else ''}" + (", kept the system message" if self.system
                                                                      else ""))
        return ids

    # --- one exchange ------------------------------------------------------------------------------

    def ask(self, text: str) -> Reply | None:
        """Sends a user message and streams the reply; the exchange joins the history (a reply stopped by
        Ctrl-C as far as it got)."""
        self.turns.append({"role": "user", "content": text})
        try:
            with ctrl_c_sets(self.stop):
                ids = self._fit()
                if ids is None:
                    self.turns.pop()
                    return None
                reply = stream_reply(self.model, ids, self.options, self.out, self.stop,
                                     reasoning=self._reasoning(),
                                     show_reasoning=shows_reasoning(self.reasoning, self.out))
        except BarellmError:
            self.turns.pop()
            raise
        turn = {"role": "assistant", "content": reply.text}
        if reply.reasoning:
            turn["reasoning_content"] = reply.reasoning
        self.turns.append(turn)
        if not reply.text.endswith("\n"):
            self.out.write("\n")
        self.out.flush()
        if reply.interrupted:
            self._note("(reply stopped; what was printed stays in the history)")
        elif reply.context_full:
            self._note(f"note: the reply stopped at the context limit ({self.model.n_ctx} tokens, -c/--context); "
                       "the oldest turns make room for the next one")
        elif reply.max_tokens_hit:
            self._note(f"note: the reply was cut at {reply.tokens} tokens (max_tokens; /set max_tokens default "
                       "lifts the limit)")
        if self.verbose:
            self._note(f"[{reply.tokens} tokens, {reply.tokens_per_second:.1f} tokens/s; prompt {reply.prompt_tokens}"
                       f" tokens, first token after {reply.first_token_seconds:.2f} s; context "
                       f"{reply.prompt_tokens + reply.tokens}/{self.model.n_ctx}{reply.draft_note}]")
        return reply

    # --- commands ----------------------------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Runs a /command; False when the session should end."""
        name, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if name in ("/bye", "/exit", "/quit"):
            return False
        if name in ("/help", "/?"):
            self.err.write(HELP)
        elif name in ("/clear", "/reset"):
            self.turns.clear()
            self._note("(history cleared)")
        elif name == "/set":
            self._set(rest)
        elif name == "/show":
            self._show(rest)
        else:
            self._note(f"unknown command {name}; /help lists them")
        return True

    def _set(self, rest: str) -> None:
        if not rest:
            self._show_parameters()
            return
        key, _, value = rest.partition(" ")
        if key == "parameter":  # Ollama's spelling: /set parameter NAME VALUE
            key, _, value = value.strip().partition(" ")
        key, value = _ALIASES.get(key, key), value.strip()
        if key == "system":
            self.system = value or None
            self._note("(system message set)" if value else "(system message cleared)")
            return
        if key in ("verbose", "quiet"):
            self.verbose = key == "verbose"
            self._note(f"({'showing' if self.verbose else 'not showing'} tokens/s after each reply)")
            return
        if key not in _parameter_names():
            self._note(f"error: unknown parameter {key!r} (known: {', '.join(_parameter_names())}, system, "
                       "verbose, quiet)")
            return
        if not value:
            self._note(f"error: /set {key} needs a value ('default' restores the default)")
            return
        try:
            self.options = self._with_option(key, value)
        except InvalidRequest as e:
            self._note(f"error: {e}")
            return
        self._note(f"(set {key} to {self._shown(key)})")

    def _with_option(self, key: str, value: str) -> dict[str, Any]:
        options = dict(self.options)
        if value == "default":
            options.pop(key, None)
            return options
        if key == "stop":
            options["stop"] = [*options.get("stop", []), value]
            return options
        kind = int if key in ("max_tokens", "top_k", "repeat_last_n", "seed") else float
        try:
            parsed = kind(value)
        except ValueError:
            raise InvalidRequest(f"{key} takes {'an integer' if kind is int else 'a number'}, got {value!r}") from None
        if key == "max_tokens":
            if parsed < 0:
                raise InvalidRequest(f"max_tokens must be an integer >= 0, got {parsed}")
        else:
            sampling = {k: v for k, v in options.items() if k not in _OTHER_PARAMETERS}
            SamplingParams(**{**sampling, key: parsed}).validated()
        options[key] = parsed
        return options

    def _shown(self, key: str) -> str:
        if key in self.options:
            value = self.options[key]
            return ", ".join(repr(s) for s in value) if key == "stop" else str(value)
        if key == "stop":
            return "(none)"
        if key == "max_tokens":
            return "no limit (default): until the reply ends or the context is full"
        default = getattr(SamplingParams(), key)
        return "(random)" if key == "seed" and default is None else f"{default} (default)"

    def _show_parameters(self) -> None:
        for key in _parameter_names():
            self.err.write(f"  {key:<18} {self._shown(key)}\n")
        self.err.write(f"  {'system':<18} {self.system if self.system else '(none)'}\n")
        self.err.write(f"  {'verbose':<18} {'on' if self.verbose else 'off'}\n")

    def _kind(self) -> str:
        if self.plain:
            return "base model (no chat template in the file): plain continuation"
        if not self.instruct:
            return f"base model, chatting with the built-in {self.template!r} template it was not tuned on"
        if self.template:
            return f"instruct, with the template {self.template!r} instead of the file's"
        return "instruct (chat template from the file)"

    def _show(self, what: str) -> None:
        m = self.model
        if what in ("", "info", "model"):
            c = m.config
            name = m.metadata.get("general.name")
            rows = [
                ("model", f"{m.name}" + (f" ({name})" if isinstance(name, str) and name != m.name else "")),
                ("architecture", f"{c.arch}, {c.n_layers} layers, dim {c.dim}, vocab {c.n_vocab}"),
                ("context", f"{m.n_ctx} tokens (trained on {c.context_length})"),
                ("kind", self._kind()),
                ("engine", f"{m.engine_name}, {m.threads} threads"),
            ]
            for k, v in rows:
                self.err.write(f"  {k:<13} {v}\n")
        elif what == "history":
            used = len(self.prompt_ids())
            n = sum(t["role"] == "user" for t in self.turns)
            over = self.turns and used + self._reserve() > m.n_ctx
            self.err.write(f"history: {n} turn{'' if n == 1 else 's'}, {used} of {m.n_ctx} context tokens"
                           f"{' as plain text' if self.plain else ''}"
                           f"{'; the oldest turns make room before the next reply' if over else ''}\n")
            for msg in self.messages:
                self.err.write(f"{msg['role']}: {textwrap.indent(msg['content'], '  ').lstrip()}\n")
        elif what == "parameters":
            self._show_parameters()
        elif what == "system":
            self.err.write(f"{self.system if self.system else '(no system message)'}\n")
        elif what == "template":
            self.err.write("(none: a base model, run as plain continuation)\n" if self.plain
                           else m.template.source.rstrip("\n") + "\n")
        else:
            self._note(f"unknown /show {what!r}: /show, /show history, parameters, system or template")

    def _note(self, text: str) -> None:
        self.out.flush()
        self.err.write(text + "\n")
        self.err.flush()

    # --- the loop ----------------------------------------------------------------------------------

    def banner(self, interactive: bool) -> None:
        m = self.model
        if self.plain:
            self._note(f"note: {m.name} is a base model (its file has no chat template): it continues your "
                       "text rather than answering it, with the conversation so far as context; --template "
                       "chatml or gemma forces a chat format it was not tuned on")
        elif not self.instruct:
            self._note(f"note: {m.name} is a base model (its file has no chat template); chatting with the "
                       f"built-in {self.template!r} template, which it was not tuned on")
        if interactive:
            self._note(f"{m.name}: {'base' if not self.instruct else 'instruct'}, context {m.n_ctx} tokens. "
                       "/help for commands, /bye or Ctrl-D to end")

    def run(self, reader: LineReader, *, interactive: bool) -> int:
        """Reads messages until /bye or the end of input; returns the exit status."""
        self.banner(interactive)
        while True:
            try:
                text, block = read_message(reader)
            except KeyboardInterrupt:
                # Ctrl-C at the prompt drops the line being typed; the session goes on
                if isinstance(reader, PlainReader):
                    self.out.write("\n")
                if not interactive:
                    return 130
                continue
            except EOFError:
                if interactive:
                    self.out.write("\n")
                return 0
            if not block:
                if not text.strip():
                    continue
                if text.lstrip().startswith("/"):
                    if not self.command(text):
                        return 0
                    continue
            try:
                self.ask(text)
            except BarellmError as e:
                self._note(f"error: {e}")
