"""Presets, as Ollama's Modelfile makes them: the parser, `barellm create/list/show/run/rm`, load(), and
/api/create through Ollama's own client, on the real SmolLM2."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import barellm
from barellm.__main__ import main
from barellm.errors import InvalidRequest
from barellm.store import catalog, presets
from barellm.store.presets import parse_modelfile

PIRATE = "You are a pirate.\nAnswer in one sentence."
MODELFILE = f'''# a preset
FROM smollm2-135m
SYSTEM """{PIRATE}"""
PARAMETER temperature 0
PARAMETER seed 7
PARAMETER num_predict 12
'''


# --- the Modelfile ----------------------------------------------------------------------------------

def test_every_instruction() -> None:
    got = parse_modelfile('''# comment
FROM ./model.gguf

system """First line.
Second line."""
PARAMETER temperature 0.5
PARAMETER top_k 20
PARAMETER top_p 0.9
PARAMETER min_p 0.05
PARAMETER repeat_penalty 1.1
PARAMETER repeat_last_n 32
PARAMETER presence_penalty 0.2
PARAMETER frequency_penalty 0.1
PARAMETER seed 42
PARAMETER num_predict 100
PARAMETER num_ctx 2048
PARAMETER stop "<|im_end|>"
PARAMETER stop END
TEMPLATE """{{ .Prompt }}"""
''')
    assert got["from"] == "./model.gguf"
    assert got["system"] == "First line.\nSecond line."
    assert got["template"] == "{{ .Prompt }}"
    assert got["parameters"] == {
        "temperature": 0.5, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "repeat_penalty": 1.1, "repeat_last_n": 32,
        "presence_penalty": 0.2, "frequency_penalty": 0.1, "seed": 42, "num_predict": 100, "num_ctx": 2048,
        "stop": ["<|im_end|>", "END"]}
    assert parse_modelfile('FROM m\nSYSTEM "quoted"\n')["system"] == "quoted"
    assert parse_modelfile("FROM m\nSYSTEM plain words\n")["system"] == "plain words"


def test_parameters_become_generation_options() -> None:
    p = presets.Preset("x", "m", None, {"num_predict": 5, "num_ctx": 1024, "stop": ["a"], "temperature": 0.0})
    assert p.options == {"max_tokens": 5, "context": 1024, "stop": ["a"], "temperature": 0.0}


@pytest.mark.parametrize("text, words", [
    ("FROM m\nADAPTER x.bin\n", "line 2: unknown instruction 'ADAPTER'"),
    ("FROM m\n\nPARAMETER mirostat 1\n", "line 3: unknown parameter 'mirostat'"),
    ("FROM m\nPARAMETER top_k many\n", "line 2: parameter top_k needs an integer"),
    ("FROM m\nPARAMETER temperature\n", "line 2: PARAMETER temperature needs a value"),
    ("FROM m\nPARAMETER temperature 5\n", "line 2: parameter temperature must be in [0, 2], got '5'"),
    ("FROM m\nSYSTEM\n", "line 2: SYSTEM needs a value"),
    ('FROM m\nSYSTEM """never\nends\n', 'line 2: a """ block that never ends'),
    ("# only\nSYSTEM hi\n", "no FROM line"),
])
def test_errors_name_the_line(text: str, words: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(words)):
        parse_modelfile(text)


# --- the command line ---------------------------------------------------------------------------------

@pytest.fixture
def preset_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "presets"
    monkeypatch.setattr(presets, "directory", lambda: d)
    return d


def _modelfile(tmp_path: Path, text: str) -> str:
    path = tmp_path / "Modelfile"
    path.write_text(text)
    return str(path)


def test_create_list_show_run_rm(smollm_gguf: Path, preset_dir: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["create", "pirate", "-f", _modelfile(tmp_path, MODELFILE + "TEMPLATE {{ .Prompt }}\n")]) == 0
    out, err = capsys.readouterr()
    assert "created pirate" in out and "TEMPLATE is stored but not applied" in err
    assert [p.name for p in preset_dir.iterdir()] == ["pirate.json"]   # written whole, no temporary left

    assert main(["list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("pirate "))
    assert row.split()[1] == "preset" and "FROM smollm2-135m" in row

    assert main(["show", "pirate"]) == 0
    out = capsys.readouterr().out
    assert "from                smollm2-135m" in out and "You are a pirate." in out
    assert "temperature         0.0" in out and "seed                7" in out and "architecture" in out

    # the preset's temperature, seed, num_predict and system prompt: what the options typed out give
    assert main(["run", "pirate", "Who are you?"]) == 0
    preset_out = capsys.readouterr().out
    assert main(["run", "smollm2-135m", "Who are you?", "--temperature", "0", "--seed", "7", "-n", "12",
                 "--system", PIRATE]) == 0
    assert capsys.readouterr().out == preset_out
    assert main(["run", "smollm2-135m", "Who are you?", "--temperature", "0", "-n", "12"]) == 0
    assert capsys.readouterr().out != preset_out   # the system prompt changes the answer
    assert main(["run", "pirate", "Who are you?", "-n", "3"]) == 0   # an option given wins
    assert len(capsys.readouterr().out) < len(preset_out)

    assert main(["rm", "pirate"]) == 0
    assert "its model stays" in capsys.readouterr().out
    assert not preset_dir.joinpath("pirate.json").exists() and smollm_gguf.is_file()
    assert main(["show", "pirate"]) == 1
    capsys.readouterr()


def test_a_relative_from_is_the_modelfiles_neighbour(smollm_gguf: Path, preset_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "m.gguf").symlink_to(smollm_gguf)
    (folder / "Modelfile").write_text("FROM ./m.gguf\n")
    assert main(["create", "local", "-f", str(folder / "Modelfile")]) == 0
    assert presets.find("local").base == str((folder / "m.gguf").resolve())
    capsys.readouterr()


def test_load_applies_the_system_prompt(smollm_gguf: Path, preset_dir: Path) -> None:
    catalog.create_preset("terse", "smollm2-135m", system="Be terse.",
                          parameters={"temperature": 0, "num_ctx": 512})
    model = barellm.load("terse")
    assert model.name == "terse" and model.n_ctx == 512 and model.defaults == {"temperature": 0.0}
    user = [{"role": "user", "content": "hi"}]
    assert model.chat_prompt(user) == model.chat_prompt([{"role": "system", "content": "Be terse."}, *user])
    own = [{"role": "system", "content": "Be long."}, *user]
    assert model.detokenize(model.chat_prompt(own)).count("Be terse.") == 0   # a chat's own system prompt wins


def test_create_refuses_bad_input(preset_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["create", "x", "-f", _modelfile(tmp_path, "FROM smollm2-135m\nPARAMETER mirostat 2\n")]) == 1
    assert "line 2: unknown parameter 'mirostat'" in capsys.readouterr().err
    assert main(["create", "x", "-f", _modelfile(tmp_path, "FROM no-such-model-9b\n")]) == 1
    assert "no-such-model-9b" in capsys.readouterr().err
    assert main(["create", "smollm2-135m", "-f", _modelfile(tmp_path, "FROM smollm2-135m\n")]) == 1
    assert "a model already" in capsys.readouterr().err
    assert main(["create", "a/b", "-f", _modelfile(tmp_path, "FROM smollm2-135m\n")]) == 1
    assert "no preset name" in capsys.readouterr().err
    assert main(["create", "x", "-f", _modelfile(tmp_path, f"FROM {tmp_path}\n")]) == 1
    assert "neither a model file nor a checkpoint directory" in capsys.readouterr().err
    assert main(["create", "x", "-f", str(tmp_path / "missing")]) == 1
    assert "cannot read the Modelfile" in capsys.readouterr().err
    assert not preset_dir.exists() or not any(preset_dir.iterdir())


# --- the server: /api/create through Ollama's client -------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(smollm_gguf: Path, tmp_path: Path) -> Iterator[str]:
    """`barellm serve` with a home of its own (the real cache's models linked in): presets land there."""
    httpx = pytest.importorskip("httpx")
    from barellm.files import home

    own = tmp_path / "home"
    own.mkdir()
    for sub in ("models", "blm"):
        if (home() / sub).is_dir():
            (own / sub).symlink_to(home() / sub)
    port = _free_port()
    env = {**os.environ, "BARELLM_HOME": str(own)}
    proc = subprocess.Popen([sys.executable, "-m", "barellm", "serve", "smollm2-135m", "--port", str(port),
                             "-c", "512", "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "the server exited"
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_api_create_then_chat(server: str) -> None:
    ollama = pytest.importorskip("ollama")
    import httpx

    client = ollama.Client(host=server)
    statuses = [s.status for s in client.create(model="captain", from_="smollm2-135m", system=PIRATE,
                                                 parameters={"temperature": 0, "seed": 3}, stream=True)]
    assert statuses[-1] == "success"
    assert client.create(model="captain2", from_="smollm2-135m", stream=False).status == "success"
    assert {"captain:latest", "captain2:latest", "smollm2-135m:latest"} <= {m.model for m in client.list().models}

    ask = [{"role": "user", "content": "Who are you?"}]
    got = client.chat(model="captain", messages=ask, options={"num_predict": 12}).message.content
    same = client.chat(model="smollm2-135m", messages=[{"role": "system", "content": PIRATE}, *ask],
                       options={"num_predict": 12, "temperature": 0, "seed": 3}).message.content
    assert got == same and got
    shown = client.show("captain")
    assert "FROM smollm2-135m" in shown.modelfile and PIRATE in shown.modelfile
    assert "temperature 0.0" in shown.parameters and "seed 3" in shown.parameters

    # the older form: a Modelfile's text
    r = httpx.post(f"{server}/api/create", json={"name": "terse", "stream": False,
                                                 "modelfile": "FROM smollm2-135m\nSYSTEM Be terse.\n"})
    assert r.status_code == 200 and r.json() == {"status": "success"}
    r = httpx.post(f"{server}/api/create", json={"name": "bad", "modelfile": "FROM smollm2-135m\nFOO x\n"})
    assert r.status_code == 400 and "line 2: unknown instruction 'FOO'" in r.json()["error"]
    r = httpx.post(f"{server}/api/create", json={"model": "bad", "from": "no-such-model-9b"})
    assert r.status_code == 404 and "no-such-model-9b" in r.json()["error"]
    with pytest.raises(ollama.ResponseError):
        client.create(model="bad", from_="smollm2-135m", parameters={"mirostat": 1})

    client.delete("captain")   # the preset alone
    left = {m.model for m in client.list().models}
    assert "captain:latest" not in left and "smollm2-135m:latest" in left
