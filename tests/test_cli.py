"""The command line on the tiny model: output, --help everywhere, one-line errors and exit codes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from barellm.cli import build_parser, main

from tiny_model import write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


def test_run_streams_prompt_and_continuation(tiny, capsys):
    assert main(["run", tiny, "the cat", "-n", "8", "--temperature", "0", "--engine", "reference"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the cat") and len(out) > len("the cat\n")


def test_run_same_seed_same_output(tiny, capsys):
    args = ["run", tiny, "the", "-n", "10", "--seed", "4", "--temperature", "1", "--engine", "reference"]
    main(args)
    a = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == a


def test_chat_reads_turns_from_stdin(tiny):
    r = subprocess.run([sys.executable, "-m", "barellm.cli", "chat", tiny, "-n", "4", "--engine", "reference",
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


def test_bad_flag_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "barellm.cli", "run", "--no-such-flag"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage:" in r.stderr
