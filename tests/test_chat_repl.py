"""The interactive chat: commands, history, Ctrl-C, context overflow, base models; first in-process on the
tiny model with scripted input, then in a real terminal (a pseudo-terminal driven by pexpect) on SmolLM2."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading

import pexpect
import pytest

import barellm
from barellm.cli.chat_repl import ChatSession, PlainReader, ctrl_c_sets, read_message, stream_reply

import tiny_model
from conftest import in_own_home
from tiny_model import write_tiny_llama

OWN_MODELS = ("tiny_path", "base_path")   # models this module writes: their tests run in their own cache (conftest)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    """The tiny model as a base model: the same file without a chat template."""
    original = tiny_model.tiny_llama_metadata

    def without_template(**kw):
        md, n = original(**kw)
        del md["tokenizer.chat_template"]
        return md, n

    mp = pytest.MonkeyPatch()
    mp.setattr(tiny_model, "tiny_llama_metadata", without_template)
    try:
        return write_tiny_llama(tmp_path_factory.mktemp("base") / "base.gguf")
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def tiny(tiny_path, scratch_home):
    with in_own_home(scratch_home):
        return barellm.load(tiny_path, context=256)


class Script:
    """A LineReader that plays lines; an exception instance in the list is raised instead (Ctrl-C, Ctrl-D)."""

    name = "script"

    def __init__(self, *lines):
        self.lines = list(lines)
        self.prompts: list[str] = []

    def read(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if not self.lines:
            raise EOFError
        item = self.lines.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item


def session(model, **kw) -> tuple[ChatSession, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    options = {"temperature": 0, "max_tokens": 6, **kw.pop("options", {})}
    return ChatSession(model, options, out=out, err=err, **kw), out, err


def test_commands_never_reach_the_model(tiny):
    s, out, err = session(tiny)
    assert s.run(Script("/help", "/set", "/show", "/show parameters", "/no-such", "/bye", "never read"),
                 interactive=False) == 0
    assert s.turns == [] and out.getvalue() == ""
    text = err.getvalue()
    assert "/set NAME VALUE" in text and "temperature" in text and "architecture" in text
    assert "unknown command /no-such" in text


def test_bye_and_end_of_input_exit_zero_and_stop_reading(tiny):
    script = Script("hello", "/bye", "not read")
    s, _, _ = session(tiny)
    assert s.run(script, interactive=False) == 0
    assert script.lines == ["not read"] and len(s.turns) == 2
    s, _, _ = session(tiny)
    assert s.run(Script("hello", EOFError()), interactive=True) == 0


def test_ctrl_c_at_the_prompt_drops_the_line_and_goes_on(tiny):
    s, _, _ = session(tiny)
    assert s.run(Script(KeyboardInterrupt(), "hello", KeyboardInterrupt(), "/bye"), interactive=True) == 0
    assert [t["role"] for t in s.turns] == ["user", "assistant"] and s.turns[0]["content"] == "hello"


def test_multi_line_block_is_one_message_and_holds_no_commands(tiny):
    script = Script('"""first line', "/not a command", 'last"""', '"""/one line"""', "/bye")
    assert read_message(script) == ("first line\n/not a command\nlast", True)
    assert script.prompts == [">>> ", "... ", "... "]
    assert read_message(script) == ("/one line", True)
    s, _, _ = session(tiny)
    s.run(Script('"""', "a", "/clear", '"""', "/bye"), interactive=False)
    assert s.turns[0] == {"role": "user", "content": "a\n/clear"} and len(s.turns) == 2


class InterruptingWriter(io.StringIO):
    """Output that presses Ctrl-C after `after` pieces of the reply: by setting the session's event, or by a
    real SIGINT to this process (the path a terminal's Ctrl-C takes)."""

    def __init__(self, after: int, action):
        super().__init__()
        self.after, self.action, self.pieces = after, action, 0

    def write(self, s: str) -> int:
        self.pieces += 1
        if self.pieces == self.after:
            self.action()
        return super().write(s)


@pytest.mark.parametrize("how", ["event", "sigint"])
def test_ctrl_c_in_a_reply_stops_it_and_keeps_the_session_and_history(tiny, how):
    s, _, err = session(tiny, options={"max_tokens": 60})
    before = signal.getsignal(signal.SIGINT)
    if how == "event":
        s.out = InterruptingWriter(4, s.stop.set)
    else:
        assert threading.current_thread() is threading.main_thread()
        s.out = InterruptingWriter(4, lambda: os.kill(os.getpid(), signal.SIGINT))
    reply = s.ask("tell me a long story")
    assert reply is not None and reply.interrupted
    printed = s.out.getvalue()
    # the partial reply is what was printed, and it stays in the history
    assert s.turns[-1] == {"role": "assistant", "content": reply.text} and printed.startswith(reply.text)
    assert 0 < len(reply.text) and reply.tokens < 60
    assert "reply stopped" in err.getvalue()
    # Ctrl-C is back to what it was outside a reply, and the next question sees the earlier turn
    assert signal.getsignal(signal.SIGINT) is before
    s.out = io.StringIO()
    assert s.ask("and then?") is not None
    assert [t["content"] for t in s.turns if t["role"] == "user"] == ["tell me a long story", "and then?"]
    assert len(s.prompt_ids()) > len(tiny.chat_prompt(s.turns[-2:]))


def test_ctrl_c_sets_restores_the_handler():
    event = threading.Event()
    before = signal.getsignal(signal.SIGINT)
    with ctrl_c_sets(event):
        os.kill(os.getpid(), signal.SIGINT)
    assert event.is_set() and signal.getsignal(signal.SIGINT) is before


def test_clear_forgets_the_history_but_keeps_the_system_message(tiny):
    s, _, err = session(tiny, system="be brief")
    s.run(Script("hello", "/clear", "/show history", "/bye"), interactive=False)
    assert s.turns == [] and s.messages == [{"role": "system", "content": "be brief"}]
    assert "history: 0 turns" in err.getvalue()


def test_set_changes_options_and_refuses_bad_values(tiny):
    s, _, err = session(tiny)
    for line in ("/set temperature 0.2", "/set parameter top_k 5", "/set num_predict 9", "/set stop END",
                 "/set seed 3", "/set system you are terse", "/set verbose"):
        assert s.command(line)
    assert s.options["temperature"] == 0.2 and s.options["top_k"] == 5 and s.options["max_tokens"] == 9
    assert s.options["stop"] == ["END"] and s.options["seed"] == 3
    assert s.system == "you are terse" and s.verbose
    before = dict(s.options)
    for line in ("/set temperature hot", "/set top_p 7", "/set max_tokens -1", "/set warmth 1", "/set seed"):
        s.command(line)
    assert s.options == before
    text = err.getvalue()
    assert "temperature takes a number" in text and "top_p must be in" in text and "unknown parameter" in text
    s.command("/set temperature default")
    assert "temperature" not in s.options
    s.command("/set")
    assert re.search(r"temperature +0\.8 \(default\)", err.getvalue()) and re.search(r"top_k +5\n", err.getvalue())


def test_verbose_prints_tokens_per_second(tiny):
    s, _, err = session(tiny, verbose=True)
    s.ask("hello")
    assert "tokens/s" in err.getvalue()


def test_history_twice_the_context_drops_the_oldest_turns_and_keeps_the_system(tiny_path):
    model = barellm.load(tiny_path, context=128)
    s, _, err = session(model, system="sys", options={"max_tokens": 8})
    for i in range(12):  # ~40 tokens a turn: about four times the context
        reply = s.ask(f"message number {i} with some words")
        assert reply is not None and reply.prompt_tokens + 8 <= 128
    assert s.messages[0] == {"role": "system", "content": "sys"}
    users = [t["content"] for t in s.turns if t["role"] == "user"]
    assert users[-1] == "message number 11 with some words" and "message number 0 with some words" not in users
    notes = [ln for ln in err.getvalue().splitlines() if "outgrew the context" in ln]
    assert notes and all("kept the system message" in ln for ln in notes)


def test_a_message_longer_than_the_context_is_refused_and_the_session_goes_on(tiny_path):
    model = barellm.load(tiny_path, context=32)
    s, _, err = session(model)
    s.ask("hi")
    kept = list(s.turns)
    assert s.ask("word " * 40) is None
    assert s.turns == kept and "was not sent" in err.getvalue()
    assert s.ask("hi again") is not None


def test_base_model_runs_as_plain_continuation_and_says_so(base_path):
    model = barellm.load(base_path, context=128)
    s, out, err = session(model)
    assert s.plain and not s.instruct
    s.run(Script("the cat", "/show", "/bye"), interactive=False)
    assert "base model" in err.getvalue() and "plain continuation" in err.getvalue()
    reply = s.turns[1]["content"]
    assert s.prompt_ids() == model.tokenize("the cat" + reply)
    s.turns.append({"role": "user", "content": "the dog"})
    assert s.plain_text(s.messages) == "the cat" + reply + ("" if reply.endswith("\n") else "\n") + "the dog"
    # a chat format asked for by name turns it into a chat, with a note that it is a guess
    s2, _, err2 = session(model, template="chatml")
    s2.banner(interactive=False)
    assert not s2.plain and "not tuned on" in err2.getvalue()
    assert s2.prompt_ids([{"role": "user", "content": "x"}]) == model.chat_prompt([{"role": "user", "content": "x"}])


def test_stream_reply_knows_when_the_context_ended_it(tiny_path):
    model = barellm.load(tiny_path, context=32)
    ids = model.tokenize("the cat sat on the mat")
    full = stream_reply(model, ids, {"temperature": 0, "max_tokens": 100}, io.StringIO())
    assert full.context_full and full.prompt_tokens + full.tokens == 32
    short = stream_reply(model, ids, {"temperature": 0, "max_tokens": 3}, io.StringIO())
    assert not short.context_full and short.tokens <= 3


def test_a_reply_without_max_tokens_runs_to_the_context_and_a_cut_one_says_so(tiny):
    ban = {i: -100 for i in tiny.tokenizer.eog_ids}   # the reply can only end at a limit
    out, err = io.StringIO(), io.StringIO()
    s = ChatSession(tiny, {"temperature": 0, "logit_bias": ban}, out=out, err=err)
    reply = s.ask("hello")
    assert reply.prompt_tokens + reply.tokens == tiny.n_ctx and reply.tokens > 128
    assert reply.context_full and not reply.max_tokens_hit
    assert "stopped at the context limit" in err.getvalue() and "cut at" not in err.getvalue()
    s._show_parameters()
    assert re.search(r"max_tokens +no limit \(default\)", err.getvalue())
    # max_tokens set: the reply stops there, with a note
    out, err = io.StringIO(), io.StringIO()
    s = ChatSession(tiny, {"temperature": 0, "logit_bias": ban, "max_tokens": 9}, out=out, err=err)
    reply = s.ask("hello")
    assert reply.tokens == 9 and reply.max_tokens_hit and not reply.context_full
    assert "the reply was cut at 9 tokens (max_tokens" in err.getvalue()
    s.command("/set max_tokens default")
    assert "max_tokens" not in s.options
    # a reply that ends by itself (here at a stop string within those 9 tokens): no note
    stop = reply.text[len(reply.text) // 2]
    out, err = io.StringIO(), io.StringIO()
    reply = ChatSession(tiny, {"temperature": 0, "logit_bias": ban, "max_tokens": 9, "stop": [stop]}, out=out,
                        err=err).ask("hello")
    assert reply.tokens < 9
    assert not reply.max_tokens_hit and not reply.context_full and err.getvalue() == ""


def test_plain_reader_is_used_without_a_terminal():
    r = PlainReader(interactive=False)
    assert r.name == "input()"


# --- in a terminal -----------------------------------------------------------------------------------------

PROMPT = ">>>"   # prompt_toolkit draws the space after it as a cursor move


def _spawn(model_path, *args: str, plain: bool = False):
    env = dict(os.environ, PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm", PYTHONUNBUFFERED="1")
    # with prompt_toolkit hidden, its import fails as if it were not installed
    code = "import sys; " + ("sys.modules['prompt_toolkit'] = None; " if plain else "") + \
        "from barellm.__main__ import main; sys.exit(main(sys.argv[1:]))"
    # Ctrl-C as at a terminal, whatever this run inherited: started in the background (`cmd &` in a script)
    # the runner ignores SIGINT, its children would too, and input() would never see the Ctrl-C
    child = pexpect.spawn(sys.executable, ["-c", code, "chat", str(model_path), "--temperature", "0", *args],
                          env=env, encoding="utf-8", timeout=120, dimensions=(50, 250),
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    child.expect(PROMPT)
    return child


def _say(child, line: str) -> None:
    """Types a line and waits until it is taken (its echo ends the line)."""
    child.send(line + "\r")
    child.expect_exact("\r\n")


@pytest.mark.model
def test_terminal_chat_ctrl_c_keeps_session_history_and_bye_exits_zero(smollm_gguf):
    child = _spawn(smollm_gguf, "-c", "256", "-n", "200")
    try:
        # arrow keys edit and recall lines instead of printing ^[[A
        _say(child, "/set seed 7")
        child.expect_exact("(set seed to 7)")
        child.expect(PROMPT)
        child.send("\x1b[A")
        _say(child, "")
        child.expect_exact("(set seed to 7)")
        child.expect(PROMPT)
        assert "^[[A" not in child.before
        # Ctrl-C at the prompt drops the line
        child.send("not to be sent")
        child.send("\x03")
        child.expect(PROMPT)
        _say(child, "/show history")
        child.expect_exact("history: 0 turns")
        child.expect(PROMPT)
        # Ctrl-C in the middle of a long reply stops it; the session and its history stay
        _say(child, "Write a very long story about a dragon who learns to fly.")
        child.expect(r"[A-Za-z]+ [A-Za-z]+ [A-Za-z]+ [A-Za-z]+")   # words of the reply (escapes have no spaces)
        child.send("\x03")
        child.expect_exact("(reply stopped")
        child.expect(PROMPT)
        _say(child, "/show history")
        child.expect(r"history: 1 turn, (\d+) of 256")
        used = int(child.match.group(1))
        child.expect_exact("user: Write a very long story about a dragon who learns to fly.")
        child.expect(r"assistant: (\S[^\r\n]*)")
        assert len(child.match.group(1)) >= 5
        child.expect(PROMPT)
        # the next question comes after the kept turn: the prompt holds both
        _say(child, "/set max_tokens 4")
        child.expect(PROMPT)
        _say(child, "What was it about?")
        child.expect(PROMPT)
        _say(child, "/show history")
        child.expect(r"history: 2 turns, (\d+) of 256")
        assert int(child.match.group(1)) > used
        child.expect(PROMPT)
        _say(child, "/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


@pytest.mark.model
def test_terminal_chat_history_twice_the_context_keeps_working(smollm_gguf):
    child = _spawn(smollm_gguf, "-c", "256", "-n", "6", "-v")
    sentence = "Here is a fact about the sea and the sky and the colour blue, number {}."
    try:
        dropped = 0
        for i in range(10):  # ~10 x 55 tokens: twice the context
            _say(child, " ".join(sentence.format(f"{i}.{j}") for j in range(2)))
            if child.expect([r"outgrew the context", r"tokens/s"]) == 0:
                dropped += 1
                child.expect(r"tokens/s")   # the reply still comes
            child.expect(r"context (\d+)/256\]")
            child.expect(PROMPT)
            assert "error" not in child.before
        assert dropped >= 3
        _say(child, "/show history")
        child.expect(r"history: (\d+) turns?")
        assert 1 <= int(child.match.group(1)) < 10
        child.expect(PROMPT)
        # the latest turn is kept, the oldest are gone
        assert "number 9.1" in child.before and "number 0.0" not in child.before
        child.sendeof()  # Ctrl-D
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


@pytest.mark.model
def test_terminal_chat_without_prompt_toolkit_uses_input(smollm_gguf):
    child = _spawn(smollm_gguf, "-c", "256", "-n", "4", plain=True)
    try:
        child.send("dropped line")
        child.send("\x03")
        child.expect(PROMPT)
        _say(child, "Hi")
        child.expect(PROMPT)
        _say(child, "/show history")
        child.expect_exact("history: 1 turn")
        child.expect_exact("user: Hi\r\n")
        child.expect(PROMPT)
        _say(child, "/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_terminal_multi_line_message_is_one_history_entry(tiny_path):
    """In prompt_toolkit's editor a \"\"\" block is one text: Enter inside it opens a line, and the history
    recalls the whole message at once (not its last line), which Enter sends again as it was."""
    child = _spawn(tiny_path, "-n", "2")
    try:
        child.send('"""\r')
        child.expect_exact("...")                     # the continuation prompt: the block is still open
        child.send("first line\r")
        child.send('second line"""\r')
        child.expect(PROMPT)
        _say(child, "/show history")
        child.expect_exact("user: first line\r\n  second line\r\n")
        child.expect(PROMPT)
        child.send("\x1b[A")                          # /show history
        child.send("\x1b[A")                          # the block, whole
        child.send("\r")
        child.expect(PROMPT)
        _say(child, "/show history")
        child.expect_exact("history: 2 turns")
        child.expect_exact("user: first line\r\n  second line\r\n")
        child.expect_exact("user: first line\r\n  second line\r\n")
        child.expect(PROMPT)
        _say(child, "/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.mark.model
def test_a_reply_on_a_terminal_is_rendered_and_wrapped_and_a_piped_one_is_plain(smollm_gguf):
    """`run` on a terminal 60 columns wide: Markdown rendered in colour (code highlighted, fences and
    backticks gone) and the prose wrapped between words; piped, the model's text byte for byte."""
    question = "Write a Python function that adds two numbers."
    argv = ["-m", "barellm", "run", question, "-n", "120", "--temperature", "0"]
    env = dict(os.environ, TERM="xterm")
    env.pop("NO_COLOR", None)
    piped = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, env=env).stdout
    model = barellm.load(smollm_gguf)
    ask = model.chat_prompt([{"role": "user", "content": question}])
    assert piped == "".join(model.stream(ask, max_tokens=120, temperature=0)) + "\n"
    assert "```python" in piped and "`" in piped.replace("```", "") and "\x1b" not in piped
    child = pexpect.spawn(sys.executable, argv, env=env, encoding="utf-8", timeout=120, dimensions=(50, 60))
    child.expect(pexpect.EOF)
    child.close()
    shown = child.before.replace("\r\n", "\n").split("note: ")[0]   # stdout, then the -n note on stderr
    assert "\x1b[35mdef\x1b[0m add_two_numbers" in shown             # a keyword of the code block
    plain = ANSI.sub("", shown)
    assert "`" not in plain
    assert max(len(line) for line in plain.splitlines()) < 60
    # wrapped between words: the same words in the same order, none cut in two
    assert re.findall(r"[\w'.,:()+*]+", plain) == re.findall(r"[\w'.,:()+*]+", piped.replace("`", ""))
    assert any(len(line) > 40 for line in plain.splitlines())  # the prose did reach the edge and wrap
