"""`barellm ps`, `stop` and `show` through the command line: ps and stop against a real `barellm serve`
process, show on a model file."""

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

from tiny_model import write_tiny_llama

SRC = str(Path(__file__).resolve().parent.parent / "src")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "BARELLM_HOME": str(home), "PYTHONPATH": SRC}
    env.pop("BARELLM_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "barellm", *args], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny: Path) -> Iterator[tuple[Path, str]]:
    """`barellm serve tiny.gguf` on a temporary cache and a free port; yields the cache and the port."""
    pytest.importorskip("uvicorn")
    home = tmp_path_factory.mktemp("home")
    port = str(_free_port())
    env = {**os.environ, "BARELLM_HOME": str(home), "PYTHONPATH": SRC}
    env.pop("BARELLM_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "barellm", "serve", str(tiny), "--port", port,
                             "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while _cli(home, "ps", "--port", port).returncode != 0:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "the server exited"
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)
        yield home, port
    finally:
        proc.terminate()
        proc.wait(60)


def test_ps_lists_the_loaded_models_and_stop_unloads_one(served: tuple[Path, str]) -> None:
    home, port = served
    ps = _cli(home, "ps", "--port", port)
    assert ps.returncode == 0, ps.stderr
    header, *rows = ps.stdout.splitlines()
    assert header.split() == ["NAME", "SIZE", "CONTEXT", "IN", "USE", "QUANT", "UNTIL"]
    assert len(rows) == 1 and re.match(r"tiny:latest\s+[\d.]+ MB\s+256\s+0\s+\S+\s+kept loaded$", rows[0]), rows
    stop = _cli(home, "stop", "tiny", "--port", port)
    assert stop.returncode == 0 and stop.stdout == "stopped tiny\n", stop.stderr
    assert _cli(home, "ps", "--port", port).stdout.splitlines()[1:] == []
    again = _cli(home, "stop", "tiny", "--port", port)
    assert again.returncode == 1
    assert again.stderr == f"error: tiny is not loaded in the server at http://127.0.0.1:{port} (loaded: none)\n"


def test_ps_and_stop_without_a_server_say_so(tmp_path: Path) -> None:
    port = str(_free_port())
    for args in (["ps"], ["stop", "smollm2-135m"]):
        r = _cli(tmp_path, *args, "--port", port)
        assert r.returncode == 1 and r.stdout == ""
        assert r.stderr.startswith(f"error: no barellm server answers at http://127.0.0.1:{port} (")
        assert r.stderr.endswith("start one with `barellm serve`, or give its --host and --port\n")


def test_show_describes_a_model_file(tiny: Path, tmp_path: Path) -> None:
    r = _cli(tmp_path, "show", str(tiny))
    assert r.returncode == 0, r.stderr
    rows = dict(re.findall(r"^    (\w[\w ]*?) {2,}(\S.*)$", r.stdout, re.M))
    assert rows["architecture"] == "llama" and rows["context length"] == "256" and rows["embedding length"] == "64"
    assert rows["quantization"] == "Q4_1" and rows["kind"].startswith("instruct")   # its matrices' type
    assert re.fullmatch(r"\d+M", rows["parameters"])
    assert "<|im_start|>" in r.stdout
    template = _cli(tmp_path, "show", str(tiny), "--template")
    assert template.returncode == 0 and template.stdout.startswith("{% for message in messages %}")
    missing = _cli(tmp_path, "show", "no-such-model-xyz")
    assert missing.returncode == 1 and missing.stderr.startswith("error: ") and "no-such-model-xyz" in missing.stderr


@pytest.mark.model
def test_show_names_the_quantization_as_llama_cpp_does(qwen05_gguf: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "barellm", "show", "qwen2.5-coder-0.5b"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": SRC})
    assert r.returncode == 0, r.stderr
    assert re.search(r"^    quantization {8}Q4_K_M$", r.stdout, re.M)
    assert re.search(r"^    architecture {8}qwen2$", r.stdout, re.M)
    assert re.search(r"^    context length {6}32768$", r.stdout, re.M)
