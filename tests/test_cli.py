"""The command line on the tiny model: output, --help everywhere, one-line errors and exit codes."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import barellm
from barellm.__main__ import build_parser, command_parsers, main, parse_args
from barellm.cli.commands import is_model
from barellm.store import hub

from tiny_model import write_tiny_llama

SRC = Path(__file__).resolve().parent.parent / "src"


OWN_MODELS = ("tiny", "tiny_instruct")   # models this module writes: their tests run in their own cache (conftest)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # a base model (no chat template): `run` continues its prompt, printed first
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", chat_template=False))


@pytest.fixture(scope="module")
def tiny_instruct(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-instruct.gguf"))


def test_run_streams_prompt_and_continuation(tiny, capsys):
    assert main(["run", tiny, "the cat", "-n", "8", "--temperature", "0", "--engine", "reference"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the cat") and len(out) > len("the cat\n")


def test_run_answers_through_the_chat_template_of_an_instruct_model(tiny_instruct, capsys):
    model = barellm.load(tiny_instruct)
    ask = model.chat_prompt([{"role": "user", "content": "the cat"}])
    answer = "".join(model.stream(ask, max_tokens=6, temperature=0))
    assert main(["run", tiny_instruct, "the cat", "-n", "6", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == answer + "\n"      # the answer alone: the question is not echoed
    continued = "the cat" + model.generate("the cat", max_tokens=6, temperature=0) + "\n"
    for raw in ("--raw", "--no-chat"):
        assert main(["run", tiny_instruct, "the cat", "-n", "6", "--temperature", "0", raw]) == 0
        assert capsys.readouterr().out == continued
    assert main(["run", tiny_instruct, "the cat", "--chat", "--raw"]) == 1
    assert "contradict" in capsys.readouterr().err


def test_run_chat_on_a_base_model_takes_a_template_and_says_so(tiny, capsys):
    assert main(["run", tiny, "the cat", "-n", "3", "--temperature", "0", "--chat"]) == 0
    out, err = capsys.readouterr()
    assert not out.startswith("the cat") and "is a base model" in err


@pytest.mark.model
def test_run_asks_an_instruct_model_and_says_why_a_reply_is_empty(smollm_gguf):
    """SmolLM2-Instruct answers a question; continued as plain text, the question meets its end token at once,
    which a note explains instead of a silent exit."""
    def run(*extra):
        return subprocess.run([sys.executable, "-m", "barellm", "run", "smollm2-135m", "What is the capital of "
                               "France?", "-n", "32", "--temperature", "0", *extra], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(SRC)})

    asked = run()
    assert asked.returncode == 0 and "Paris" in asked.stdout and asked.stderr == ""
    raw = run("--raw")
    assert raw.returncode == 0 and raw.stdout == "What is the capital of France?\n"
    assert raw.stderr == ("note: the model ended its reply at once: its end token came first (no text generated); "
                          "without --raw, this instruct model answers the prompt as a chat message\n")


def test_run_same_seed_same_output(tiny, capsys):
    args = ["run", tiny, "the", "-n", "10", "--seed", "4", "--temperature", "1", "--engine", "reference"]
    main(args)
    a = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == a


def test_chat_reads_turns_from_stdin(tiny):
    r = subprocess.run([sys.executable, "-m", "barellm", "chat", tiny, "-n", "4", "--engine", "reference",
                        "--temperature", "0"], input="hello\n/reset\nagain\n", capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) >= 2


def test_inspect_shows_metadata_and_tensors(tiny, capsys):
    assert main(["inspect", tiny, "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "llama.block_count = 2" in out and "blk.1.ffn_down.weight" in out and "q4_1" in out


def test_every_command_has_help():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name in commands:
        with pytest.raises(SystemExit) as e:
            parser.parse_args([name, "--help"])
        assert e.value.code == 0


@pytest.mark.parametrize("argv, fragment", [
    (["run", "/no/such.gguf", "hi"], "neither a file nor a known model"),
    (["inspect", "/etc/hostname"], "not a model file"),
    (["run", "{tiny}", "hi", "--temperature", "-2", "--engine", "reference"], "temperature"),
    (["run", "{tiny}", "hi", "-c", "999999", "--engine", "reference"], "context"),
    (["pull", "no-such-model"], "unknown model"),
])
def test_errors_are_one_line_and_nonzero(tiny, capsys, argv, fragment):
    code = main([a.replace("{tiny}", tiny) for a in argv])
    err = capsys.readouterr().err
    assert code != 0
    assert err.startswith("error: ") and fragment in err and err.count("\n") == 1


@pytest.mark.parametrize("options, words", [
    (["--temperature", "-1"], "temperature must be in [0, 100]"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--min-p", "2"], "min_p must be in [0, 1]"),
    (["--repeat-penalty", "0"], "repeat_penalty must be in (0, 10]"),
    (["-n", "-1"], "-n/--max-tokens must be an integer >= 0"),
])
@pytest.mark.parametrize("command", ["run", "chat"])
def test_bad_sampling_options_fail_before_anything_loads_or_prints(tiny, capsys, monkeypatch, command, options,
                                                                   words):
    monkeypatch.setattr(hub, "DEFAULT_MODEL", tiny)

    def no_load(*args, **kw):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(barellm, "load", no_load)
    argv = [command, *options] + (["Hi"] if command == "run" else [])
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and words in err and err.count("\n") == 1


def test_a_prompt_the_model_refuses_is_not_echoed(tiny, capsys):
    assert main(["run", tiny, "the " * 100, "-c", "32"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: the prompt has") and err.count("\n") == 1


def test_bad_flag_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "barellm", "run", "--no-such-flag"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage:" in r.stderr


# --- run: options anywhere, [MODEL] [PROMPT], chat without a prompt ---------------------------------------


def test_options_may_come_before_between_and_after_the_words(tiny, capsys):
    outs = []
    for argv in (["run", tiny, "-n", "5", "the cat", "--temperature", "0"],
                 ["run", "-n", "5", tiny, "--temperature", "0", "the cat"],
                 ["run", "--temperature", "0", "-n", "5", tiny, "the", "cat"]):
        assert main(argv) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2] and outs[0].startswith("the cat")
    # every command reads its arguments intermixed
    args = parse_args(build_parser(), ["perplexity", "model", "--chunks", "1", "text.txt", "-c", "64"])
    assert args.words == ["model", "text.txt"] and args.chunks == 1 and args.ctx_size == 64


def test_run_words_that_are_not_a_model_are_the_prompt(tiny, capsys, monkeypatch):
    monkeypatch.setattr(hub, "DEFAULT_MODEL", tiny)
    assert main(["run", "the", "cat", "-n", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("the cat")
    assert is_model("smollm2-135m") and is_model("gemma3") and is_model(tiny) and is_model("/no/such.gguf")
    assert not is_model("the") and not is_model("-")


KNOWN = "(known: gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, smollm2-135m"   # then one's own models


@pytest.mark.parametrize("argv, hint", [
    (["run", "smollm2-13m", "Hello"], "did you mean smollm2-135m?"),     # a near miss of a known name
    (["run", "smollm2-13m"], "did you mean smollm2-135m?"),              # no prompt: no chat either
    (["run", "./no-such-file", "Hello"], ""),                             # shaped like a path
    (["run", "models/model.gguf", "Hello"], ""),
    (["run", "no-such.blm", "Hello"], ""),
    (["run", "llama3-8b", "Hello"], ""),                                  # NAME-<size>
    (["chat", "smollm2-13m"], "did you mean smollm2-135m?"),
    (["chat", "gemma-270m"], "did you mean gemma3-270m?"),
    (["serve", "smollm2-13m"], "did you mean smollm2-135m?"),
    (["serve", "qwen2.5-coder-7b", "--ray"], "did you mean qwen2.5-coder?"),  # before any cluster is joined
])
def test_a_model_that_does_not_resolve_is_an_error_not_a_prompt(tiny, capsys, monkeypatch, argv, hint):
    monkeypatch.setattr(hub, "DEFAULT_MODEL", tiny)
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: {argv[1]!r} is neither a file nor a known model") and KNOWN in err
    assert hint in err and ("did you mean" in err) == bool(hint)


def test_a_model_name_typo_in_the_python_api_names_the_known_models():
    with pytest.raises(barellm.ModelNotFound) as e:
        barellm.load("smollm2-13m")
    assert "did you mean smollm2-135m?" in str(e.value) and KNOWN in str(e.value)
    with pytest.raises(barellm.ModelNotFound, match="neither a file nor a known model"):
        barellm.load("./no-such-file.gguf")


def test_a_prompt_without_a_model_still_runs_the_default(tiny, capsys, monkeypatch):
    monkeypatch.setattr(hub, "DEFAULT_MODEL", tiny)
    model = barellm.load(tiny)
    for argv, prompt in ((["The capital of France is"], "The capital of France is"),
                         (["Once", "upon", "a", "time"], "Once upon a time"),
                         (["What is 1/2 + 1/4?"], "What is 1/2 + 1/4?"),     # a quoted prompt is no path
                         (["the" * 100], "the" * 100)):                      # nor is a word too long for one
        assert main(["run", *argv, "-n", "3", "--temperature", "0"]) == 0
        out = capsys.readouterr().out
        assert out == prompt + model.generate(prompt, max_tokens=3, temperature=0) + "\n"
    assert not any(is_model(w) for w in ("The", "Hello", "Paris", "COVID-19", "a" * 300, "x\0y", "-", ""))
    assert all(is_model(w) for w in ("smollm2", "default", "a/b", "x.gguf", "smollm2-13m", "phi-3.8b", tiny))


def test_run_dash_reads_the_prompt_from_stdin(tiny, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("the cat"))
    assert main(["run", tiny, "-", "-n", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("the cat")


def test_run_a_model_without_a_prompt_opens_the_chat(tiny):
    r = subprocess.run([sys.executable, "-m", "barellm", "run", tiny, "-n", "4", "--temperature", "0"],
                       input="hello\n/show history\n/bye\nnot read\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert tiny not in r.stdout                      # the name is not taken for the prompt
    assert "history: 1 turn" in r.stderr and "user: hello" in r.stderr and "not read" not in r.stderr


def test_run_notes_when_the_context_ends_the_output(tiny, capsys):
    assert main(["run", tiny, "the cat sat on the mat", "-c", "32", "-n", "100", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert "stopped at the context limit: 32 tokens" in err and err.count("\n") == 1
    # stopped by -n: its own note, not the context's
    assert main(["run", tiny, "the cat sat on the mat", "-c", "32", "-n", "5", "--temperature", "0"]) == 0
    assert "context" not in capsys.readouterr().err


def test_every_option_shows_its_default_in_help():
    parser = build_parser()
    missing = []
    for name, p in command_parsers(parser).items():
        for action in p._actions:
            if action.option_strings and action.nargs != 0 and not action.required:
                if "default" not in p._get_formatter()._expand_help(action):
                    missing.append(f"{name} {action.option_strings[-1]}")
    assert not missing, missing
    text = " ".join(command_parsers(parser)["run"].format_help().split())
    assert ("-n MAX_TOKENS, --max-tokens MAX_TOKENS tokens to generate at most (default: no limit, until the end of "
            "generation or the context is full;") in text
    assert "--temperature TEMPERATURE, --temp TEMPERATURE 0 = greedy (default: 0.8)" in text


def test_without_max_tokens_a_generation_runs_until_the_context_is_full(tiny):
    model = barellm.load(tiny, context=256)
    kw = {"temperature": 0, "logit_bias": {i: -100 for i in model.tokenizer.eog_ids}}   # no end token: only a limit
    room = 256 - len(model.tokenize("the cat"))
    c = model.complete("the cat", **kw)
    assert c.finish_reason == "length" and len(c.token_ids) == room and room > 128
    s = model.stream("the cat", **kw)
    assert s.finish_reason is None
    assert "".join(s) == c.text and s.finish_reason == "length" and s.token_ids == c.token_ids
    chat = model.chat_stream([{"role": "user", "content": "hi"}], **kw)
    text = "".join(chat)
    assert chat.finish_reason == "length" and chat.prompt_tokens + len(chat.token_ids) == 256 and text
    # a limit the caller sets still holds, and says so
    c = model.complete("the cat", max_tokens=128, **kw)
    assert c.finish_reason == "length" and len(c.token_ids) == 128
    assert model.complete("the cat", max_tokens=None, **kw).token_ids == model.complete("the cat", **kw).token_ids
    # a generation that ends by itself says "stop"
    c = model.complete("the cat", temperature=0)
    assert c.finish_reason == "stop" and len(c.token_ids) < room
    with pytest.raises(barellm.InvalidRequest, match="max_tokens"):
        model.complete("the cat", max_tokens=-1)


def test_run_says_when_a_limit_cuts_the_reply(tiny, capsys):
    # no -n: the reply goes on until the context is full, then a note says so
    assert main(["run", tiny, "the cat", "-c", "200", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert "stopped at the context limit: 200 tokens" in captured.err and captured.err.count("\n") == 1
    assert "asked" not in captured.err
    model = barellm.load(tiny, context=200)
    assert captured.out == "the cat" + model.generate("the cat", temperature=0) + "\n"
    # -n: cut there, and a note says so
    assert main(["run", tiny, "the cat", "-n", "7", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert err == "note: the reply was cut at 7 tokens (-n/--max-tokens)\n"


# --- list, rm ------------------------------------------------------------------------------------------


@pytest.fixture
def cache_with_tiny(tmp_path, monkeypatch, tiny):
    """A model cache holding the tiny model, pulled as a registered model would be, and a registered base
    model not pulled."""
    home = tmp_path / "home"
    monkeypatch.setenv("BARELLM_HOME", str(home))
    data = Path(tiny).read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    spec = hub.ModelSpec(name="tiny-chat", description="a tiny chat model", packages=("tiny-chat",),
                         members=("tiny.gguf",), filename="tiny.gguf", sha256=sha)
    monkeypatch.setitem(hub.REGISTRY, "tiny-chat", spec)
    monkeypatch.setitem(hub.REGISTRY, "tiny-base", hub.ModelSpec(
        name="tiny-base", description="a tiny base model", packages=("tiny-base",), members=("b.gguf",),
        filename="b.gguf", sha256="0" * 64, instruct=False))
    d = home / "models" / "tiny-chat"
    d.mkdir(parents=True)
    (d / "tiny.gguf").write_bytes(data)
    (d / "manifest.json").write_text(json.dumps({"name": "tiny-chat", "file": "tiny.gguf", "sha256": sha}))
    return home, d / "tiny.gguf"


def _list_row(capsys, name: str) -> list[str]:
    assert main(["list"]) == 0
    [line] = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(name + " ")]
    return line.split()


def test_list_shows_kind_size_on_disk_and_cache_state(cache_with_tiny, capsys):
    home, model_file = cache_with_tiny
    row = _list_row(capsys, "tiny-chat")
    assert row[1:3] == ["catalogue", "instruct"] and row[3] == f"{model_file.stat().st_size / 1e6:.1f}"
    assert row[5] == "gguf"
    barellm.load("tiny-chat")   # converts it into the .blm cache
    [blm] = (home / "blm").glob("*.blm")
    row = _list_row(capsys, "tiny-chat")
    assert row[3] == f"{(model_file.stat().st_size + blm.stat().st_size) / 1e6:.1f}"
    assert row[5:7] == ["converted,", "gguf"] and " ".join(row[7:]) == "a tiny chat model"
    row = _list_row(capsys, "tiny-base")
    assert row[2:6] == ["base", "-", "no", "a"]
    row = _list_row(capsys, "gemma3-270m")
    assert row[1:3] == ["catalogue", "base"]


def test_rm_frees_the_model_file_and_its_converted_blm(cache_with_tiny, capsys):
    home, model_file = cache_with_tiny
    barellm.load("tiny-chat")
    assert list((home / "blm").glob("*.blm")) and list((home / "blm" / "index").glob("*.json"))
    assert main(["rm", "tiny-chat"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("removed tiny-chat: ") and "freed" in out
    assert not (home / "models" / "tiny-chat").exists() and hub.cached_path("tiny-chat") is None
    assert not list((home / "blm").glob("*.blm")) and not list((home / "blm" / "index").glob("*.json"))
    assert not [p for p in (home / "models").iterdir()]        # no temporary left behind
    assert _list_row(capsys, "tiny-chat")[3:5] == ["-", "no"]
    # a second rm has nothing to remove
    assert main(["rm", "tiny-chat"]) == 1
    assert "not cached" in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [
    (["rm", "no-such-model"], "unknown model"),
    (["rm", "{tiny}"], "only deletes what barellm itself put in its cache"),   # a file outside the cache
])
def test_rm_refuses_what_is_not_a_cached_model(cache_with_tiny, tiny, capsys, argv, fragment):
    assert main([a.replace("{tiny}", tiny) for a in argv]) == 1
    assert fragment in capsys.readouterr().err
    assert Path(tiny).is_file() and cache_with_tiny[1].is_file()


def test_rm_leaves_a_pull_in_progress_alone_and_clears_a_dead_ones_leftovers(cache_with_tiny, capsys):
    home, model_file = cache_with_tiny
    live = model_file.parent / f".pull.{os.getpid()}.0123abcd.tmp"
    live.mkdir()
    assert main(["rm", "tiny-chat"]) == 1
    assert "a pull is writing" in capsys.readouterr().err and model_file.is_file()
    live.rmdir()
    # what a removal killed after its rename leaves: a temporary directory of a process that is gone
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = home / "models" / f".tiny-chat.{int(dead.stdout)}.89abcdef.tmp"
    leftover.mkdir()
    (leftover / "tiny.gguf").write_bytes(b"GGUF")
    assert main(["rm", "tiny-chat"]) == 0
    assert not leftover.exists() and not model_file.exists()


# --- the registry, pull without pip --------------------------------------------------------------------


def test_registry_says_which_models_are_instruct_and_which_base():
    assert hub.REGISTRY["smollm2-135m"].instruct and not hub.REGISTRY["gemma3-270m"].instruct
    assert hub.is_instruct({"tokenizer.chat_template": "{{ messages }}"})
    assert not hub.is_instruct({}) and not hub.is_instruct({"tokenizer.chat_template": " "})


@pytest.mark.model
def test_registry_kind_matches_the_files(smollm_gguf, gemma_gguf):
    from barellm.store.converted import open_model

    for cached in hub.list_cached():
        f = open_model(cached.path)
        assert hub.is_instruct(f.metadata) == hub.REGISTRY[cached.name].instruct, cached.name
        f.close()


def test_pull_without_pip_says_pip_is_missing(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    code = ("from barellm.store import hub\nfrom barellm.errors import BarellmError\n"
            "try:\n    hub.pull('smollm2-135m')\nexcept BarellmError as e:\n    print(e)\n")
    env = {**os.environ, "PYTHONPATH": str(SRC), "BARELLM_HOME": str(tmp_path / "home")}
    r = subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"pip is not available in this Python ({python})" in r.stdout and "-m ensurepip" in r.stdout
    assert not (tmp_path / "home" / "models" / "smollm2-135m" / "manifest.json").exists()


# --- the model argument: a word shaped like a model is never the prompt -------------------------------


@pytest.mark.parametrize("argv", [["run", "llama3.2", "hi"], ["run", "llama3.2:1b", "hi"], ["run", "meta/llama", "hi"],
                                  ["run", "qwen3:latest", "hi"], ["run", "-m", "llama3.2", "hi"]])
def test_an_unknown_model_shaped_word_is_an_error_listing_the_names(tiny, capsys, monkeypatch, argv):
    monkeypatch.setattr(hub, "DEFAULT_MODEL", tiny)
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "neither a file nor a known model" in err
    assert KNOWN in err and "-m MODEL" in err


@pytest.mark.model
@pytest.mark.parametrize("word", ["smollm2:latest", "SmolLM2-135M", "smollm2:135m", "SMOLLM2"])
def test_run_takes_a_name_in_any_case_with_its_latest_or_size_tag(smollm_gguf, capsys, word):
    expected = barellm.load("smollm2-135m").generate("hi", max_tokens=3, temperature=0)
    assert main(["run", word, "hi", "-n", "3", "--temperature", "0", "--raw"]) == 0
    assert capsys.readouterr().out == "hi" + expected + "\n"


def test_run_model_flag_makes_every_word_the_prompt(tiny, capsys, monkeypatch):
    monkeypatch.setattr(hub, "DEFAULT_MODEL", "/no/such.gguf")
    model = barellm.load(tiny)
    assert main(["run", "-m", tiny, "smollm2", "tells", "-n", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "smollm2 tells" + model.generate("smollm2 tells", max_tokens=3,
                                                                         temperature=0) + "\n"


def test_the_resolver_reads_names_as_the_catalogue_keys_them():
    from barellm.store import names

    assert hub.registered_name("SmolLM2-135M") == "smollm2-135m"
    assert hub.registered_name("smollm2:latest") == hub.registered_name("smollm2") == "smollm2-135m"
    assert hub.registered_name("qwen2.5-coder:0.5b") == "qwen2.5-coder-0.5b"
    assert hub.registered_name("smollm2:135m") == "smollm2-135m" and hub.registered_name("llama3.2") is None
    assert names.parse("hf.co/Org/Repo:q4_k_m") == names.Reference("huggingface", "hf.co/Org/Repo:q4_k_m",
                                                                    "Org/Repo", "q4_k_m")
    assert names.parse("hf://Org/Repo").kind == "huggingface" and names.parse("Org/Repo:Q8_0").kind == "huggingface"
    assert names.parse("ollama:qwen2.5-coder:1.5b") == names.Reference("ollama", "ollama:qwen2.5-coder:1.5b",
                                                                        "qwen2.5-coder", "1.5b")
    assert names.parse("ollama:llama3.2").tag is None and names.parse("x/y.gguf").kind == "path"
    assert all(is_model(w) for w in ("llama3.2", "phi3", "qwen3:latest", "a/b", "hf.co/a/b", "ollama:x",
                                     "SmolLM2-135M", "llama3.2:1b"))
    assert not any(is_model(w) for w in ("Once", "upon", "COVID-19", "Note:", "hi", "12:30", "mp3"))
