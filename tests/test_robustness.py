"""Model files and paths that are legal, odd or hostile: each loads and runs, or ends in one clean error
(a BarellmError), never a hang, a crash or a bare exception."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import barellm
from barellm.errors import BarellmError, FormatError
from barellm.formats import sniff
from barellm.formats.blm import BLMFile
from barellm.formats.gguf import GGUFFile

from tiny_model import write_tiny_llama

CLI = [sys.executable, "-m", "barellm.cli"]


# --- paths that are not regular files ----------------------------------------------------------------------

@pytest.fixture()
def odd_paths(tmp_path):
    """A named pipe, a socket and a character device, as model paths."""
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock.gguf"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    yield {"named pipe": fifo, "socket": sock_path, "character device": Path("/dev/zero")}
    sock.close()


def test_non_regular_paths_are_refused_before_any_read(odd_paths):
    import threading

    # a reader that blocks on the pipe is set free after a while (by opening its other end), so that a
    # regression fails here instead of hanging the test run
    done, hung = threading.Event(), []

    def unblock() -> None:
        if not done.wait(10):
            hung.append(True)
            while not done.is_set():
                try:
                    os.close(os.open(odd_paths["named pipe"], os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
                done.wait(0.1)

    watchdog = threading.Thread(target=unblock, daemon=True)
    watchdog.start()
    try:
        for kind, path in odd_paths.items():
            for opener in (sniff, GGUFFile, BLMFile, barellm.load):
                with pytest.raises(FormatError, match=f"{kind}|not a regular file"):
                    opener(path)
    finally:
        done.set()
        watchdog.join()
    assert not hung, "reading the named pipe blocked"


@pytest.mark.parametrize("command", [["run", "{path}", "hi", "-n", "1"], ["inspect", "{path}"],
                                     ["verify", "{path}"], ["convert", "{path}", "-o", "{out}"]])
def test_the_command_line_does_not_hang_on_a_named_pipe(tmp_path, command):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    args = [a.format(path=fifo, out=tmp_path / "o.blm") for a in command]
    proc = subprocess.run(CLI + args, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                          env=dict(os.environ, BARELLM_HOME=str(tmp_path / "home")))
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert err.startswith("error:") and "named pipe" in err and "\n" not in err, err
    assert not (tmp_path / "o.blm").exists()


def test_a_checkpoint_file_that_is_a_named_pipe_is_refused(tmp_path):
    from barellm.convert import convert

    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text("{}")
    os.mkfifo(root / "model.safetensors")
    with pytest.raises(BarellmError):
        convert(root, tmp_path / "out.blm")
    os.unlink(root / "config.json")
    os.mkfifo(root / "config.json")
    with pytest.raises(FormatError, match="directory without config.json|named pipe"):
        sniff(root)


def test_tiny_model_still_loads(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    assert sniff(path) == "gguf"
    barellm.load(str(path), engine="reference", context=32)
