"""Ctrl-C on `barellm serve` with requests in flight: the graceful shutdown docs/server.md promises.

A real server process, real HTTP clients: a streamed and a whole chat completion, each asked for 1,500
tokens with the end token banned (so that they run long), are both generating when the server gets SIGINT.
Each must then either finish or end in the documented shape (503 `server_error` for the whole answer; a
`data: {"error": ...}` event and the end of the stream), the process must exit 0 within the grace period
(plus a margin for loading and unloading), and its log must hold no traceback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tiny_model import write_tiny_llama

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

SRC = str(Path(__file__).resolve().parent.parent / "src")
MARGIN = 60.0   # seconds past the grace period a loaded, busy 2-core machine may take to stop


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A `barellm serve` subprocess whose stderr is collected line by line as it comes."""

    def __init__(self, *args: str) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": SRC}
        self.proc = subprocess.Popen([sys.executable, "-m", "barellm", "serve", "smollm2-135m", "--port",
                                      str(self.port), "--slots", "2", "-t", "2", *args], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.said = threading.Condition()
        threading.Thread(target=self._collect, daemon=True).start()
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.log
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)

    def _collect(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self.said:
                self.lines.append(line)
                self.said.notify_all()

    @property
    def log(self) -> str:
        with self.said:
            return "".join(self.lines)

    def wait_for_log(self, words: str) -> None:
        with self.said:
            assert self.said.wait_for(lambda: words in "".join(self.lines) or self.proc.poll() is not None, 60)
        assert words in self.log, self.log


def _long_chat(stream: bool) -> dict[str, Any]:
    # SmolLM2's end tokens (<|endoftext|> 0, <|im_end|> 2) banned: only max_tokens ends the reply
    return {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 1500, "temperature": 1.0, "logit_bias": {"0": -100, "2": -100}, "stream": stream}


def _start_requests(base: str) -> tuple[dict[str, Any], list[threading.Thread], threading.Event]:
    """A whole and a streamed request, running; returns where their outcomes land, their threads, and an
    event set once the stream has carried text."""
    out: dict[str, Any] = {}
    streaming = threading.Event()

    def whole() -> None:
        r = httpx.post(f"{base}/v1/chat/completions", json=_long_chat(False), timeout=300)
        out["whole"] = (r.status_code, r.json())

    def stream() -> None:
        events: list[str] = []
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=_long_chat(True), timeout=300) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    if len(events) > 5:
                        streaming.set()
        out["stream"] = (r.status_code, events)

    threads = [threading.Thread(target=whole), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    return out, threads, streaming


def _both_running(base: str, streaming: threading.Event) -> None:
    assert streaming.wait(120), "the stream carried no text"
    deadline = time.monotonic() + 120
    while httpx.get(f"{base}/health", timeout=10).json()["slots_in_use"] < 2:
        assert time.monotonic() < deadline, "the two requests did not both start"
        time.sleep(0.1)


SHUTTING_DOWN = {"message": "the server is shutting down", "type": "server_error", "param": None,
                 "code": "server_error"}


def _outcome(out: dict[str, Any]) -> tuple[str, str]:
    """How each request ended, "finished" or "ended" (the documented shutdown error), asserting it was one
    of those two."""
    status, body = out["whole"]
    if status == 200:
        whole = "finished"
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 1500
    else:
        whole = "ended"
        assert status == 503 and body == {"error": SHUTTING_DOWN}
    status, events = out["stream"]
    assert status == 200 and all(e.startswith("data: ") for e in events)
    if events[-1] == "data: [DONE]":
        stream = "finished"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    else:
        stream = "ended"
        assert json.loads(events[-1][6:]) == {"error": SHUTTING_DOWN}   # then the end of the stream
        assert all("error" not in json.loads(e[6:]) for e in events[:-1])
    return whole, stream


@pytest.mark.model
@pytest.mark.parametrize("grace, interrupts", [(10.0, 1), (0.5, 1), (600.0, 2)],
                         ids=["default-grace", "short-grace", "second-ctrl-c"])
def test_ctrl_c_lets_requests_in_flight_finish_or_ends_them_as_documented(smollm_gguf: Path, grace: float,
                                                                         interrupts: int) -> None:
    args = [] if grace == 10.0 else ["--shutdown-timeout", str(grace)]   # 10 s is the default
    served = Served(*args)
    try:
        out, threads, streaming = _start_requests(served.base)
        _both_running(served.base, streaming)
        t0 = time.monotonic()
        served.proc.send_signal(signal.SIGINT)
        if interrupts == 2:
            served.wait_for_log("in flight get up to")
            served.proc.send_signal(signal.SIGINT)   # stops at once: the 600 s are not waited for
            limit = MARGIN
        else:
            limit = grace + MARGIN
        assert served.proc.wait(limit) == 0, served.log
        assert time.monotonic() - t0 < limit
        for t in threads:
            t.join(60)
        whole, stream = _outcome(out)
        if grace < 10:
            # 1,500 tokens take far more than half a second on any CPU this runs on
            assert (whole, stream) == ("ended", "ended"), out
        log = served.log
        assert "Traceback" not in log and "CancelledError" not in log and "ERROR" not in log, log
        assert "Shutting down: 2 request(s) in flight" in log
        # the listening socket closed at the signal: nothing new is accepted
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{served.base}/health", timeout=5)
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
            served.proc.wait()


def test_a_server_with_nothing_in_flight_stops_at_once(tmp_path: Path) -> None:
    """Ctrl-C on an idle server: no wait at all, status 0, a clean log."""
    tiny_path = write_tiny_llama(tmp_path / "tiny.gguf")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "barellm", "serve", str(tiny_path), "--port", str(port),
                             "--shutdown-timeout", "600"],
                            env={**os.environ, "PYTHONPATH": SRC, "BARELLM_HOME": str(tmp_path / "home")},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(MARGIN) == 0
        err = proc.stderr.read() if proc.stderr else ""
        assert "Traceback" not in err and "in flight" not in err and "Finished server process" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_shutdown_timeout_is_checked() -> None:
    r = subprocess.run([sys.executable, "-m", "barellm", "serve", "--shutdown-timeout", "-1"],
                       env={**os.environ, "PYTHONPATH": SRC}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr == "error: --shutdown-timeout must be in 0..86400 seconds, got -1.0\n"
